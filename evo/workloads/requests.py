"""The request schema a workload declares for serving: what each named input tensor must look like.

A workload returns these from `Workload.request_specs(preset)`; the HTTP codec (`evo.serving.codec`)
validates every request against them, by the rules below (`check_tensors` and the checks it shares with
the codec), which the registered pyfunc (`evo.evidence.mlflow.pyfunc_engine`) applies too. They live
here, not in serving, so that a workload declares its schema, and the evidence layer checks inputs by
Serve's rules, without importing the serving layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

if TYPE_CHECKING:  # torch is imported where a tensor is checked: declaring a schema needs none
    import torch


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


class RequestError(ValueError):
    """A bad request: `field` names the offending field; message says what was received and what is allowed."""

    def __init__(self, field: str, message: str, status: int = 422) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status

    def to_dict(self) -> dict:
        return {"error": {"field": self.field, "message": self.message, "status": self.status}}


def request_schema(workload: Any, preset: Any) -> tuple[tuple[TensorSpec, ...], dict[str, tuple[int, int]]]:
    """What a request for `workload`'s engines at `preset` (a `Workload` and one of its `Preset`s: not imported
    here, base imports this module) must hold: the workload's `request_specs` with value bounds narrowed to its
    verified domain (e.g. a log decay's floor), and the verified (lo, hi) of each free dim. Serve and
    the registered pyfunc accept exactly the domain the evaluator verified engines over (`Workload.domain`)."""
    domain = workload.domain(preset)
    return domain.bound_specs(workload.request_specs(preset)), domain.axis_bounds()


def check_tensors(inputs: Mapping[str, torch.Tensor | None], specs: Iterable[TensorSpec],
                  axes: Mapping[str, tuple[int, int]] | None = None, prefix: str = "inputs."
                  ) -> dict[str, torch.Tensor]:
    """Tensors already in memory (the registered pyfunc's arrays) checked by the rules `decode_request`
    applies to a request: names, dtype, rank, fixed and free dims against the verified `axes`, values
    against each spec's bounds. -> {name: tensor}, absent optional ones left out; RequestError naming
    the field (`prefix` + name, e.g. "prompt" with prefix "") and what is allowed."""
    specs = tuple(specs)
    _check_names(dict(inputs), specs, prefix)
    bindings: dict[str, tuple[int, str]] = {}
    out = {}
    for spec in specs:
        t = inputs.get(spec.name)
        if t is None:
            continue
        field = f"{prefix}{spec.name}"
        if _dtype_name(t.dtype) not in spec.dtypes:
            raise RequestError(f"{field}.dtype", f"received {_dtype_name(t.dtype)}; allowed: {list(spec.dtypes)}")
        _check_shape(tuple(t.shape), spec, field, bindings, axes or {})
        _check_values(t, spec, field)
        out[spec.name] = t
    return out


def _check_names(inputs: dict, specs: tuple[TensorSpec, ...], prefix: str = "inputs.") -> None:
    names = [s.name for s in specs]
    for key in inputs:
        if key not in names:
            raise RequestError(f"{prefix}{key}", f"unknown tensor {key!r}; allowed: {names}")
    missing = [s.name for s in specs if s.required and inputs.get(s.name) is None]
    if missing:
        raise RequestError(f"{prefix}{missing[0]}", f"required tensor(s) {missing} missing or null; received "
                                                   f"{list(inputs)}; required: {[s.name for s in specs if s.required]}")


def _check_shape(shape: tuple[int, ...], spec: TensorSpec, field: str,
                 bindings: dict[str, tuple[int, str]], axes: Mapping[str, tuple[int, int]]) -> None:
    f = f"{field}.shape"
    if len(shape) != len(spec.shape):
        raise RequestError(f, f"received {list(shape)} (rank {len(shape)}); expected rank {len(spec.shape)} "
                              f"{spec.describe()}")
    for i, (got, want) in enumerate(zip(shape, spec.shape)):
        label = spec.dim_names[i] if i < len(spec.dim_names) else str(want)
        if isinstance(want, int):
            if got != want:
                raise RequestError(f, f"received {list(shape)}; dim {i} ({label}) must be {want} (fixed: the "
                                      f"engine is built for it); expected {spec.describe()}")
        elif want in bindings and bindings[want][0] != got:
            value, where = bindings[want]
            raise RequestError(f, f"received {list(shape)}; dim {i} ({want}) is {got} but {want} = {value} in "
                                  f"{where}; every tensor must agree on {want}")
        else:
            if got == 0 and not (want in axes and axes[want][0] == 0):
                raise RequestError(f, f"received {list(shape)}; dim {i} ({want}) is 0: an empty dim is allowed only "
                                      f"where the verified domain of {want} starts at 0 (e.g. no decode steps)")
            if want in axes and not axes[want][0] <= got <= axes[want][1]:
                lo, hi = axes[want]
                side = f"above the largest {want} ({hi})" if got > hi else f"below the smallest {want} ({lo})"
                raise RequestError(f, f"received {list(shape)}; dim {i} ({want}) is {got}, {side} engines of this "
                                      f"workload are verified for: {want} must lie in [{lo}, {hi}]; split the "
                                      f"request along {want}")
            bindings.setdefault(want, (got, f))


def _check_values(t: torch.Tensor, spec: TensorSpec, field: str) -> None:
    import torch

    if not spec.allow_nonfinite:
        bad = ~torch.isfinite(t)
        if bad.any():
            idx = _first(bad)
            raise RequestError(field, f"non-finite value {t[idx].item()} at index {list(idx)} (NaN, Infinity or "
                                      f"overflow of {_dtype_name(t.dtype)}); only finite values are allowed")
    lo, hi = spec.bounds
    for limit, mask, word in ((lo, lambda: t < lo, "below the minimum"), (hi, lambda: t > hi, "above the maximum")):
        if limit is not None and (bad := mask()).any():
            idx = _first(bad)
            raise RequestError(field, f"value {t[idx].item()} at index {list(idx)} is {word} {limit:g}; "
                                      f"{spec.name} must lie in [{_fmt(lo, '-inf')}, {_fmt(hi, 'inf')}]")


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def _fmt(x: float | None, unbounded: str) -> str:
    return unbounded if x is None else f"{x:g}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
