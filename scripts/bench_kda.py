"""Time KDA baselines and genomes on a preset at given CPU thread counts.

    python scripts/bench_kda.py --threads 1 2 --repeats 15

Per engine: warm-up calls apart, then the median (and IQR) of timed calls over rotated input draws;
max relative error (norm-wise, o and final_state) vs the float64 reference over the standard,
strong_decay and heavy distributions with an initial state.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.getcwd(), ".inductor_cache"))

import torch  # noqa: E402

from evo.workloads.base import CheckCase, DeviceInfo  # noqa: E402
from evo.workloads.kda import WORKLOAD  # noqa: E402

GENOMES: dict[str, dict] = {
    "default": {},
    "c64": {"chunk_size": 64},
    "c32": {"chunk_size": 32},
    "c128_sub32": {"chunk_size": 128, "sub_chunk_size": 32},
    "triangular_solve": {"intra_algorithm": "triangular_solve"},
    "forward_substitution": {"intra_algorithm": "forward_substitution"},
    "factored_chunk": {"exponent_form": "factored_chunk"},
    "time_major": {"layout": "time_major"},
    "state_vk": {"state_layout": "vk"},
    "recompute": {"intermediates": "recompute"},
    "fuse_rec_out": {"fuse_recurrence_output": True},
    "fuse_intra_rec": {"fuse_intra_recurrence": True},
}
_ALL_COMPILE = {f"backend_{s}": "compile" for s in ("gate", "l2norm", "intra", "recurrence", "output")}
COMPILED = {
    "c64_all_compile": {**_ALL_COMPILE, "chunk_size": 64},
    "c64_compile_fused_prologue": {**_ALL_COMPILE, "chunk_size": 64, "fuse_l2norm_intra": True,
                                   "backend_recurrence": "eager", "backend_output": "eager"},
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def max_error(engine, preset, seed: int = 11) -> float:
    worst = 0.0
    for dist in ("standard", "strong_decay", "heavy"):
        x = WORKLOAD.make_inputs(CheckCase(dist, preset.shape, dist, True), preset.dtype, preset.device, seed)
        ref, out = WORKLOAD.reference(x), engine(**x)
        errs = [rel_err(out[n], ref[n]) for n in WORKLOAD.output_names]
        worst = max(worst, *(e if e == e else float("inf") for e in errs))
    return worst


def time_engine(engine, draws: list[dict], warmup: int, repeats: int) -> tuple[float, float]:
    for i in range(warmup):
        engine(**draws[i % len(draws)])
    times = []
    for i in range(repeats):
        x = draws[i % len(draws)]
        t0 = time.perf_counter()
        engine(**x)
        times.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(times, n=4)
    return statistics.median(times), q[2] - q[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time compiled genomes and the compiled baseline")
    ap.add_argument("--skip", nargs="*", default=[], help="engine names to skip")
    args = ap.parse_args()
    preset = WORKLOAD.presets()[args.preset]
    device = DeviceInfo("cpu", platform.processor() or "cpu", max(args.threads))
    space = WORKLOAD.gene_space(preset, device)
    print(f"# torch {torch.__version__}, {platform.platform()}, preset {preset.name} {dict(preset.shape)}")
    draws = [WORKLOAD.make_inputs(CheckCase("bench", preset.shape, "standard", True), preset.dtype, preset.device, s)
             for s in range(3)]
    engines = {}
    for name, builder in WORKLOAD.baselines(preset).items():
        if "compiled" in name and not args.compile:
            continue
        engines[f"baseline:{name}"] = builder(device)
    genomes = {**GENOMES, **(COMPILED if args.compile else {})}
    for name, genes in genomes.items():
        engines[f"genome:{name}"] = WORKLOAD.build(space.make({**genes, "threads": 1}), preset, device)
    rows = []
    for name, engine in engines.items():
        if name.split(":")[1] in args.skip:
            continue
        err = max_error(engine, preset)
        cells = []
        for threads in args.threads:
            torch.set_num_threads(threads)
            cells.append(time_engine(engine, draws, args.warmup, args.repeats))
        rows.append((name, cells, err))
        print(f"{name:40s} " + " ".join(f"{m:9.2f} ±{iqr:6.2f}" for m, iqr in cells) + f"   {err:.2e}", flush=True)
    print("\n| engine | " + " | ".join(f"ms @{t}t (median, IQR)" for t in args.threads) + " | max rel err |")
    print("|---|" + "---|" * len(args.threads) + "---|")
    for name, cells, err in rows:
        print(f"| {name} | " + " | ".join(f"{m:.2f} ({iqr:.2f})" for m, iqr in cells) + f" | {err:.1e} |")


if __name__ == "__main__":
    main()
