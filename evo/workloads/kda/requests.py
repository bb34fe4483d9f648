"""The HTTP request schema of a KDA engine and the requests the load generator sends."""
from __future__ import annotations

from evo.workloads.base import CheckCase, Preset
from evo.workloads.kda import inputs as _inputs
from evo.workloads.requests import TensorSpec


def request_specs(preset: Preset) -> tuple[TensorSpec, ...]:
    """q, k, v, g, beta, initial_state for a KDA engine built for `preset`.

    H, K, V are fixed by the preset (the engine is built for them); B and T are free but shared
    (Serve bounds them by the domain, `domain.py`). g is a log decay in [LOG_DECAY_FLOOR, 0], beta a
    gate in [0, 1]; initial_state is optional and always float32.
    """
    s, dt = preset.shape, (preset.dtype,)
    H, K, V = s["H"], s["K"], s["V"]
    bthk = dict(shape=("B", "T", H, K), dim_names=("B", "T", "H", "K"))
    return (
        TensorSpec("q", dtypes=dt, **bthk),  # [B, T, H, K]
        TensorSpec("k", dtypes=dt, **bthk),  # [B, T, H, K]
        TensorSpec("v", ("B", "T", H, V), dt, dim_names=("B", "T", "H", "V")),  # [B, T, H, V]
        TensorSpec("g", dtypes=dt, bounds=(_inputs.LOG_DECAY_FLOOR, 0.0), **bthk),  # [B, T, H, K] log decay
        TensorSpec("beta", ("B", "T", H), dt, bounds=(0.0, 1.0), dim_names=("B", "T", "H")),  # [B, T, H]
        TensorSpec("initial_state", ("B", H, K, V), ("float32",), required=False,
                   dim_names=("B", "H", "K", "V")),  # [B, H, K, V]
    )


def example_request(preset: Preset, seed: int, **axes: int) -> dict:
    """One request's inputs on CPU at the preset's shape (B and T overridable), standard
    distribution, with an initial state."""
    unknown = sorted(set(axes) - {"B", "T"})
    if unknown:
        raise ValueError(f"axes {unknown} are fixed by the KDA preset {preset.name!r}; only B and T are free")
    case = CheckCase("load", {**preset.shape, **axes}, "standard", True)
    return _inputs.make_inputs(case, preset.dtype, "cpu", seed)
