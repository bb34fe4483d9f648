"""Population with elitism and tournament selection. Pure: no Ray, no MLflow, no torch."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from evo.core.records import Evaluated


@dataclass(frozen=True)
class PopulationSettings:
    size: int = 8  # survivors kept between generations
    elite: int = 2  # best members that always survive and are always offered as parents
    tournament: int = 3  # contestants per tournament

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"population size must be >= 1, got {self.size}")
        if not 0 <= self.elite <= self.size:
            raise ValueError(f"elite must be in [0, size={self.size}], got {self.elite}")
        if self.tournament < 1:
            raise ValueError(f"tournament must be >= 1, got {self.tournament}")


class Population:
    """The best correct engines seen so far. Only `ok` results may enter; failures never do."""

    def __init__(self, settings: PopulationSettings) -> None:
        self.settings = settings
        self._members: list[Evaluated] = []

    def offer(self, candidate: Evaluated) -> bool:
        """Add a candidate if it is correct and good enough; return whether it entered."""
        if not math.isfinite(candidate.fitness):
            return False
        if any(m.proposal.hash == candidate.proposal.hash for m in self._members):
            return False
        self._members.append(candidate)
        # Stable order: fitness, then hash, so ties break the same way in every run.
        self._members.sort(key=lambda m: (m.fitness, m.proposal.hash))
        entered = candidate in self._members[: self.settings.size]
        del self._members[self.settings.size :]
        return entered

    @property
    def members(self) -> tuple[Evaluated, ...]:
        return tuple(self._members)

    def best(self) -> Evaluated | None:
        return self._members[0] if self._members else None

    def elites(self) -> tuple[Evaluated, ...]:
        return tuple(self._members[: self.settings.elite])

    def tournament(self, rng: np.random.Generator) -> Evaluated:
        """The fittest of `tournament` members drawn at random (with replacement)."""
        if not self._members:
            raise ValueError("tournament on an empty population")
        picks = rng.integers(len(self._members), size=self.settings.tournament)
        return self._members[int(picks.min())]  # members are sorted, so the lowest index is fittest

    def select_parents(self, rng: np.random.Generator, n: int) -> list[Evaluated]:
        """`n` parents: the elites first, then tournament winners."""
        chosen = list(self.elites()[:n])
        while len(chosen) < n:
            chosen.append(self.tournament(rng))
        return chosen

    def __len__(self) -> int:
        return len(self._members)
