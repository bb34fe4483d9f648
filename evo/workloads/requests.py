"""The request schema a workload declares for serving: what each named input tensor must look like.

A workload returns these from `Workload.request_specs(preset)`; the HTTP codec (`evo.serving.codec`)
validates every request against them. They live here, not in serving, so that a workload declares
its schema without importing the serving layer.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    """What one named input must look like.

    `shape` holds symbols ("B", "T": free, but equal across every tensor of a request) or ints (fixed);
    `dim_names` optionally names each dim for error messages (e.g. "H" for a fixed 4). The first dim
    of every tensor is the batch axis, along which the server merges requests into one engine call.
    """

    name: str
    shape: tuple[str | int, ...]
    dtypes: tuple[str, ...]
    required: bool = True
    allow_nonfinite: bool = False
    bounds: tuple[float | None, float | None] = (None, None)  # inclusive (lo, hi); None: unbounded
    dim_names: tuple[str, ...] = ()

    def describe(self) -> str:
        """The shape for messages, e.g. "[B, T, H=2, K=32]"."""
        parts = []
        for i, d in enumerate(self.shape):
            name = self.dim_names[i] if i < len(self.dim_names) else None
            parts.append(str(d) if isinstance(d, str) or name is None or name == str(d) else f"{name}={d}")
        return "[" + ", ".join(parts) + "]"
