"""Baselines that matter on the GPU: flash-linear-attention's Triton KDA kernels (`fla_chunk_kda`,
`fla_fused_recurrent_kda`, when fla-core is importable: the optional `.[fla]` extra, or the wheels of
scripts/fetch_wheels.sh), and head blocking, which lets the pairwise baselines' [.., C, C, K]
temporaries fit at the h200 preset.

fla's kernels autotune on first use of each key (H among them): ~80-90 s for the first shape on an
H200, ~12 s for each new one, and again in every fresh process. `warm_fla` runs them once per shape
in the judge's process and writes the configs it chose as fla's own config cache (`FLA_CONFIG_DIR`,
read with `FLA_CACHE_MODE=fuzzy`, which lets a config tuned at one H serve the others), so the
engine processes that time the baselines pick a config instead of tuning ~100 of them."""
from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

FLA_KERNELS = {"fla_chunk_kda": "chunk_kda", "fla_fused_recurrent_kda": "fused_recurrent_kda"}
PAIRWISE_BUDGET_BYTES = {"cuda": 8 << 30, "cpu": 2 << 30}  # per head block, all temporaries counted
PAIRWISE_TEMPORARIES = 4  # [B, h, N, C, C, K] float32 tensors alive at once in the pairwise intra pass
FLA_CACHE_MODE = "fuzzy"  # exact key, else any key of the same structure; else fla autotunes as usual


def fla_import_error() -> str:
    """"" when fla's KDA kernels (`fla.ops.kda`) import here, else what stopped them, e.g.
    "ModuleNotFoundError: No module named 'einops'" (fla-core installed without its dependencies)."""
    try:
        importlib.import_module("fla.ops.kda")
    except Exception as exc:  # noqa: BLE001 - optional extra; the caller reports the reason
        return f"{type(exc).__name__}: {exc}"
    return ""


def fla_kernels() -> dict[str, Callable]:
    """Baseline name -> fla's KDA kernel, or {} when fla-core (or triton) is not importable
    (`fla_import_error` says why)."""
    if fla_import_error():
        return {}
    ops = importlib.import_module("fla.ops.kda")
    return {name: getattr(ops, fn) for name, fn in FLA_KERNELS.items() if hasattr(ops, fn)}


def missing_baselines(named: list[str], available: list[str]) -> dict[str, str]:
    """Named baselines that cannot be built here -> why (fla's import error for fla's kernels), so a
    check that asked for them fails loudly instead of leaving them out."""
    why_fla = fla_import_error()
    out = {}
    for name in named:
        if name in available:
            continue
        if name in FLA_KERNELS:
            out[name] = f"fla.ops.kda does not import: {why_fla}" if why_fla else "fla's kernels need a CUDA preset"
        else:
            out[name] = f"unknown baseline; available here: {sorted(available)}"
    return out


def fla_engine(kernel: Callable) -> Callable[..., dict]:
    """fla's kernel as an engine: l2norm inside the kernel, scale K**-0.5, final state returned."""
    accepted = set(inspect.signature(kernel).parameters)

    def run(q, k, v, g, beta, initial_state=None) -> dict:
        kw = {"scale": q.shape[-1] ** -0.5, "initial_state": None if initial_state is None else initial_state.float(),
              "output_final_state": True, "use_qk_l2norm_in_kernel": True}
        o, S = kernel(q, k, v, g, beta, **{k_: v_ for k_, v_ in kw.items() if k_ in accepted})
        return {"o": o, "final_state": S}

    return run


def heads_per_block(B: int, T: int, K: int, chunk: int, device: str) -> int:
    """Heads whose pairwise temporaries fit the budget (at least one)."""
    n = -(-T // chunk)
    per_head = PAIRWISE_TEMPORARIES * B * n * chunk * chunk * K * 4
    return max(1, PAIRWISE_BUDGET_BYTES.get(device, PAIRWISE_BUDGET_BYTES["cpu"]) // per_head)


def head_blocked(fn: Callable[..., dict], chunk: int = 64, block: int | None = None) -> Callable[..., dict]:
    """fn over blocks of heads (heads are independent): q, k, v, g, beta split on dim 2, the initial
    state on dim 1; outputs joined the same way. `block` fixes the heads per block (tests)."""

    def run(q, k, v, g, beta, initial_state=None) -> dict:
        B, T, H, K = q.shape
        hb = block or heads_per_block(B, T, K, chunk, q.device.type)
        if hb >= H:
            return fn(q, k, v, g, beta, initial_state)
        outs = []
        for h in range(0, H, hb):
            part = slice(h, h + hb)
            h0 = None if initial_state is None else initial_state[:, part]
            outs.append(fn(q[:, :, part], k[:, :, part], v[:, :, part], g[:, :, part], beta[:, :, part], h0))
        return {"o": torch.cat([o["o"] for o in outs], 2), "final_state": torch.cat([o["final_state"] for o in outs], 1)}

    return run


@dataclass(frozen=True)
class FlaWarmup:
    """One kernel's warm-up at one shape: wall time of its first call (autotuning and compiles) and of
    its second (cached), seconds; `error` when it raised."""

    kernel: str
    shape: tuple[int, ...]  # B, T, H, K, V
    first_s: float
    second_s: float
    initial_state: bool = True
    error: str = ""


def warm_fla(shapes: list[dict[str, int]], dtype: str, device: str, config_dir: str | Path,
             kernels: list[str] | None = None, deadline: float | None = None) -> list[FlaWarmup]:
    """Call each fla kernel twice per shape, with and without an initial state (a tensor argument
    fewer is another autotune key), inputs drawn on `device`, and write every config fla's autotuners
    chose into `config_dir` as fla's config cache. Calls that would start past `deadline`
    (time.monotonic) are skipped. A kernel that raises is recorded with its error, never raised."""
    from evo.workloads.base import CheckCase
    from evo.workloads.kda.inputs import make_inputs

    chosen = fla_kernels()
    records = []
    for shape, with_state in [(shape, state) for shape in shapes for state in (True, False)]:
        for name in [n for n in (kernels or list(chosen)) if n in chosen]:
            if deadline is not None and time.monotonic() > deadline:
                break
            x = make_inputs(CheckCase("warm", shape, "standard", with_state), dtype, device, seed=0)
            records.append(replace(_warm_one(name, fla_engine(chosen[name]), x, shape, device), initial_state=with_state))
            try:  # after each kernel: a warm-up stopped at its budget keeps what it tuned
                write_fla_configs(config_dir)
            except Exception as exc:  # noqa: BLE001 - the warm-up still counts; the engines then autotune
                records[-1] = replace(records[-1], error=f"configs not written: {type(exc).__name__}: {exc}"[:300])
    return records


def _warm_one(name: str, engine: Callable[..., dict], x: dict, shape: dict[str, int], device: str) -> FlaWarmup:
    times, error = [], ""
    for _ in range(2):
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                engine(**x)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - recorded, the check goes on
            text = str(exc).strip().splitlines()
            error = f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
            break
        times.append(time.perf_counter() - start)
    times += [float("nan")] * (2 - len(times))
    return FlaWarmup(name, tuple(shape[a] for a in ("B", "T", "H", "K", "V")), times[0], times[1], error=error)


def write_fla_configs(config_dir: str | Path) -> dict[str, int]:
    """Every config fla's autotuners hold in this process, as fla's config files ({kernel}.json with
    `autotune_entries`, in the format `fla.ops.utils.cache` reads); kernel name -> entries written."""
    from triton.runtime.autotuner import Autotuner

    try:
        from fla.ops.utils.cache import AutotuneKey
    except ImportError:
        return {}
    import triton

    folder = Path(config_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tuners = {id(obj): obj for name, module in list(sys.modules.items()) if name.startswith("fla.")
              for obj in list(vars(module).values()) if isinstance(obj, Autotuner)}
    by_name: dict[str, dict] = {}  # kernels of one name (in several modules) share a file
    for tuner in tuners.values():
        name = getattr(tuner, "kernel_name", None) or getattr(getattr(tuner, "fn", None), "__name__", "kernel")
        entries = by_name.setdefault(name, {})
        for key, config in getattr(tuner, "cache", {}).items():
            entry = {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
                     "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}
            entries[AutotuneKey.key_hash(key)] = {"autotune_key": AutotuneKey.normalize_autotune_key(key),
                                                   "config": entry}
    written = {}
    for name, entries in by_name.items():
        if not entries:
            continue
        data = {"kernel_name": name, "triton_version": triton.__version__, "autotune_entries": entries}
        tmp = folder / f".{name}.json.tmp"
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, folder / f"{name}.json")
        written[name] = len(entries)
    return written


def fla_cache_environment(config_dir: str | Path) -> dict[str, str]:
    """The environment that makes fla (imported after it is set, in any process) read the configs
    `warm_fla` wrote instead of autotuning."""
    return {"FLA_CACHE_MODE": FLA_CACHE_MODE, "FLA_CONFIG_DIR": str(Path(config_dir).resolve())}
