"""Prompts of different lengths run together: their tokens packed one after another ([N, ...], N the sum of
the lengths) for the per-token work (projections, norms, experts), and as rows padded at their ends to the
longest ([n, T, ...]) for a sequence mixer. The pad is the caller's to choose (a value that changes nothing:
zero input, a decay of one); a causal mixer never lets a real token see it."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Ragged:
    """The prompts' lengths and where each packed token sits: `index` its place in the padded [n * longest],
    `owner` its prompt (0..n-1), `position` its position in it; `last` each prompt's last token, packed."""

    lengths: tuple[int, ...]
    index: torch.Tensor
    owner: torch.Tensor
    position: torch.Tensor
    last: torch.Tensor

    @classmethod
    def of(cls, lengths: list[int] | tuple[int, ...], device: torch.device | str = "cpu") -> Ragged:
        if not lengths or min(lengths) < 1:
            raise ValueError(f"Ragged needs at least one prompt, each of at least one token; got lengths {lengths}")
        longest = max(lengths)
        owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        position = torch.cat([torch.arange(T) for T in lengths])
        last = torch.tensor(lengths).cumsum(0) - 1
        return cls(tuple(lengths), (owner * longest + position).to(device), owner.to(device), position.to(device),
                   last.to(device))

    @property
    def longest(self) -> int:
        return max(self.lengths)

    def padded(self, packed: torch.Tensor, pad: float = 0.0) -> torch.Tensor:
        """[N, ...] -> [n, longest, ...], `pad` after each prompt's end."""
        out = packed.new_full((len(self.lengths) * self.longest, *packed.shape[1:]), pad)
        out[self.index] = packed
        return out.view(len(self.lengths), self.longest, *packed.shape[1:])

    def packed(self, padded: torch.Tensor) -> torch.Tensor:
        """[n, longest, ...] -> [N, ...]: the real tokens only."""
        return padded.reshape(-1, *padded.shape[2:])[self.index]
