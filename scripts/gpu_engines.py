"""The GPU check's warm-up, engines and model parts (run by scripts/gpu_check.py in child processes), and
the table rows they write. Torch, the evaluator and the workload are imported inside the parts only, so
the orchestrator that imports the row helpers stays light.

warm-up: fla's kernels once at the preset shape, their configs written as fla's config cache
(OUT/fla-configs) for the engine processes. engines: the reference baseline, the genomes, the other
baselines, each evaluated with its timeout lowered to the time left, one row appended as each finishes;
named baselines that cannot load are rows "missing" at once; whatever the deadline does not reach is
left for the orchestrator to list as "not reached". model: the same for the generation workload
kimi_linear (hf_static, the reference, then our default genome, then one_at_a_time), its rows numbered on
from the KDA plan's; on the GPU at the h200 preset on a small trace (16 requests, 16 in flight, prompts
128-512, outputs 16-64, one timed replay), on the dry run at cpu_small (4 requests, outputs 1-8). A
generation row's "median ms" is ms per output token; its message starts with output tok/s, TTFT, TPOT."""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

MIN_CANDIDATE_S = 5.0  # an engine is started only with at least this long left (plus the judge's cost)
MODEL_BASELINES = ("hf_static", "one_at_a_time")  # the model part's; the first is its speedups' reference


def warmup(args: argparse.Namespace) -> int:
    """fla's kernels once at the preset shape (the timing case), their configs written to OUT/fla-configs."""
    out = Path(args.out)
    from evo.workloads.kda import gpu_baselines as fla
    from evo.workloads.kda.inputs import presets

    preset = presets()[args.preset]
    named = [n for n in args.baselines.split(",") if n in fla.FLA_KERNELS]
    if fla.fla_import_error() or preset.device != "cuda":
        why = fla.fla_import_error() or "fla's kernels need a CUDA preset"
        _write_json(out / "warmup.json", {"summary": f"skipped: {why}"})
        print(f"warm-up: skipped: {why}", flush=True)
        return 0
    config_dir = out / "fla-configs"
    start = time.perf_counter()
    records: list = []
    for name in [None, *named]:  # None: the record before any kernel ran; then one update per kernel
        if name is not None:
            records += fla.warm_fla([dict(preset.shape)], preset.dtype, "cuda", config_dir, kernels=[name],
                                    deadline=time.monotonic() + max(args.deadline - time.time(), 0))
        written = sorted(p.stem for p in config_dir.glob("*.json"))
        parts = [f"{r.kernel}{'' if r.initial_state else ' (no h0)'} {r.first_s:.1f} s first call,"
                 f" {r.second_s * 1e3:.1f} ms second"
                 + (f" ({r.error})" if r.error else "") for r in records]
        summary = (f"{time.perf_counter() - start:.0f} s at {dict(preset.shape)}: {'; '.join(parts) or 'nothing ran yet'};"
                   f" configs of {len(written)} kernels cached in {config_dir} (FLA_CACHE_MODE={fla.FLA_CACHE_MODE})")
        _write_json(out / "warmup.json", {"summary": summary, "records": [asdict(r) for r in records],
                                          "config_dir": str(config_dir),
                                          "environment": fla.fla_cache_environment(config_dir)})
    print(f"warm-up: {summary}", flush=True)
    return 0


def _write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def engines(args: argparse.Namespace) -> int:
    """Evaluate the plan in order within the deadline; a row per engine as it finishes."""
    signal.signal(signal.SIGTERM, _stopped)  # at the budget: the finally blocks still kill the candidate
    out = Path(args.out)
    from evo.bench.bench import genomes_from_file
    from evo.workloads.kda.gpu_baselines import missing_baselines

    config, ev = _evaluator(args)
    try:
        space = ev.workload.gene_space(ev.preset, ev.device_info())
        genomes = genomes_from_file(args.genomes, space) if args.genomes else [space.default()]
        named = [n for n in args.baselines.split(",") if n]
        missing = missing_baselines(named, sorted(ev.workload.baselines(ev.preset)))
        usable = [n for n in named if n not in missing]  # the reference: the workload's, else the first named
        reference = next((n for n in [ev.workload.reference_baseline, *usable] if n in usable), "")
        plan = [("baseline", n) for n in named if n == reference]
        plan += [("genome", g) for g in genomes]
        plan += [("baseline", n) for n in named if n != reference]
        entries = [(index, kind, x, f"baseline:{x}" if kind == "baseline" else ev.workload.label(x))
                   for index, (kind, x) in enumerate(plan, 1)]
        _write_json(out / "plan.json", [{"engine": label, "source": kind} for _, kind, _, label in entries])
        for index, kind, item, label in entries:  # loud, whatever the budget
            if kind == "baseline" and item in missing:
                _append_row(out, {"index": index, "engine": label, "source": kind, "status": "missing",
                                  "message": f"named baseline not available: {missing[item]}"})
        judge_s = _judge_cost(ev, out)
        found = [e for e in entries if not (e[1] == "baseline" and e[2] in missing)]
        _evaluate_plan(ev, config.evaluator, out, found, reference, args.deadline, MIN_CANDIDATE_S + judge_s,
                       "engines")
    finally:
        ev.close()
    return 0


def model(args: argparse.Namespace) -> int:
    """The kimi_linear part: hf_static (the reference), our default genome, one_at_a_time at `args.preset`,
    numbered on from `args.first_index`; its plan in OUT/model_plan.json, a row per engine as it finishes."""
    signal.signal(signal.SIGTERM, _stopped)
    out = Path(args.out)
    config, ev = _evaluator(args)
    try:
        genome = ev.workload.gene_space(ev.preset, ev.device_info()).default()
        reference = MODEL_BASELINES[0]
        entries = [(index, kind, item, label) for index, (kind, item, label)
                   in enumerate(model_plan(args.preset, genome, ev.workload.label(genome)), args.first_index)]
        _write_json(out / "model_plan.json", [{"index": i, "engine": label, "source": kind}
                                              for i, kind, _, label in entries])
        available = sorted(ev.workload.baselines(ev.preset))
        for index, kind, item, label in entries:  # loud, whatever the budget
            if kind == "baseline" and item not in available:
                # "unavailable", not "missing": reported, but the check does not fail on the model's baselines
                _append_row(out, {"index": index, "engine": label, "source": kind, "status": "unavailable",
                                  "message": f"{item} is not offered here (available: {available}); hf_static"
                                             " needs transformers >= 5.24, which ships Kimi Linear"})
        found = [e for e in entries if e[1] == "genome" or e[2] in available]
        _evaluate_plan(ev, config.evaluator, out, found, reference, args.deadline, MIN_CANDIDATE_S, "model")
    finally:
        ev.close()
    return 0


def model_plan(preset: str, genome, genome_label: str) -> list[tuple[str, object, str]]:
    """The model part's plan [(kind, baseline name or genome, row label)]: the reference baseline, our default
    genome (`genome_label` its workload label, or 'genome' where the part never ran), the other baseline;
    labels as 'kimi_linear h200 baseline:hf_static', 'kimi_linear h200: default 1a2b3c4d (x64, ...)'."""
    reference, other = MODEL_BASELINES
    return [("baseline", reference, f"kimi_linear {preset} baseline:{reference}"),
            ("genome", genome, f"kimi_linear {preset}: default {genome_label.removeprefix('kimi_linear ')}"),
            ("baseline", other, f"kimi_linear {preset} baseline:{other}")]


def _evaluator(args: argparse.Namespace):
    """(the config, an Evaluator) of `args.config` at `args.preset` with `args.overrides`; unconfined where
    the strict sandbox cannot run here."""
    from dataclasses import replace

    from evaluators.judge.evaluator import Evaluator
    from evo.core.seeds import derive_seed
    from evo.driver.config import load_config

    config = load_config(args.config, [f"preset={args.preset}", *args.overrides])
    if config.evaluator.sandbox == "strict":
        from evaluators.sandbox import jail

        if jail.unavailable():
            config = replace(config, evaluator=replace(config.evaluator, sandbox="none"))
    ev = Evaluator(config.workload, config.preset, config.evaluator, derive_seed(config.search.seed, "gpu-check"),
                   name="gpu-check")
    return config, ev


def _evaluate_plan(ev, settings, out: Path, entries: list[tuple], reference: str, deadline: float, needs_s: float,
                   part: str) -> None:
    """Evaluate `entries` [(index, kind, baseline name or genome, label)] in order, each with its timeouts
    lowered to the time left before `deadline`, a row appended as each finishes; the rest is not reached
    once less than `needs_s` is left. Speedups are against `reference`, a baseline evaluated first."""
    from dataclasses import replace

    ref_ms = math.nan
    for index, kind, item, label in entries:
        left = deadline - time.time()
        if left < needs_s:
            print(f"{part}: {left:.0f} s left, a candidate needs >= {needs_s:.0f} s: the rest is not reached",
                  flush=True)
            return
        limit = min(settings.eval_timeout_s, left - MIN_CANDIDATE_S / 2)
        build_s = min(settings.build_timeout_s, limit)  # baselines too: the device's budget is firm
        ev.settings = replace(settings, eval_timeout_s=limit, build_timeout_s=build_s, baseline_build_timeout_s=build_s)
        result = ev.evaluate_baseline(item) if kind == "baseline" else ev.evaluate(item.to_json())
        if kind == "baseline" and item == reference and result.ok:
            ref_ms = result.latency_ms
        row = {"index": index, "engine": label, "source": kind, **_result_row(result, ref_ms, reference)}
        if result.status == "timeout" and limit < settings.eval_timeout_s:
            row["message"] = f"cut by the budget (eval_timeout_s lowered to {limit:.0f} s): {row['message']}"
        _append_row(out, row)


def _stopped(*_: object) -> None:
    print("stopped at the budget (SIGTERM); the candidate in flight is killed", flush=True)
    raise SystemExit(143)


def _judge_cost(ev, out: Path) -> float:
    """The judge's own work per candidate (draws and float64 references of every call), estimated from
    the timing case timed here and scaled by each case's size; printed and kept in OUT/judge.json."""
    import numpy as np

    from evaluators.judge.timing import num_threads, sync
    from evaluators.sandbox.zygote import Zygote

    Zygote.shared(ev._preload).wait_ready()  # it starts beside this process and would slow what is timed here
    case = ev._timing_case
    samples = []
    with num_threads(1) if ev.device == "cpu" else nullcontext():  # as the judge works during an evaluation
        for _ in range(3):  # the first warms up (lazy library loads): the least of three counts
            t0 = time.perf_counter()
            x = ev._draw(case)
            sync(ev.device)
            t1 = time.perf_counter()
            ev.workload.reference(x)
            sync(ev.device)
            samples.append((t1 - t0, time.perf_counter() - t1))
    draw_s, ref_s = min(s[0] for s in samples), min(s[1] for s in samples)
    size = lambda c: math.prod(c.shape.get(a, 1) for a in ("B", "T", "H"))  # noqa: E731
    checks = [c for stage in ev.workload.check_cases(ev.preset) for c in stage]
    checks += list(ev.workload.draw_cases(ev.preset, np.random.default_rng(0)))
    timed = 1 + ev.settings.warmup + ev.settings.repeats
    scale = sum(size(c) for c in checks) / size(case) + timed
    total = scale * (draw_s + ref_s)
    summary = (f"{len(checks) + timed} checked calls at {ev.preset.name}: one draw {draw_s * 1e3:.1f} ms + one"
               f" float64 reference {ref_s * 1e3:.1f} ms at the timing shape, x{scale:.1f} by size = ~{total:.1f} s"
               " (plus the engine's build and calls)")
    print(f"judge cost: {summary}", flush=True)
    _write_json(out / "judge.json", {"summary": summary, "draw_s": draw_s, "reference_s": ref_s, "total_s": total})
    return total


def _result_row(r, ref_ms: float, reference: str) -> dict:
    median = r.latency_ms if r.ok else math.nan
    return {"status": r.status, "median_ms": median, "iqr_ms": r.latency_spread_ms if r.ok else math.nan,
            "max_rel_error": r.max_rel_error, "speedup": ref_ms / median if r.ok else math.nan,
            "reference": reference if math.isfinite(ref_ms) else "", "build_s": r.build_s, "eval_s": r.eval_s,
            "message": (_serving_text(r.serving) + r.message)[:300]}


def _serving_text(serving: dict) -> str:
    """A generation result's replay in brief (its medians; vllm bench serve's names), '' for a call engine."""
    if not serving:
        return ""
    median = lambda name: serving.get(name, {}).get("median", math.nan)  # noqa: E731
    return (f"{_fmt(serving.get('output_throughput'), '.4g')} output tok/s, TTFT {_fmt(median('ttft_ms'), '.4g')} ms,"
            f" TPOT {_fmt(median('tpot_ms'), '.4g')} ms (medians); ")


def _append_row(out: Path, row: dict) -> None:
    """The row printed, appended to rows.jsonl (fsynced) and to table.md."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    with open(out / "rows.jsonl", "a") as f:
        f.write(json.dumps(clean, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
    line = markdown_row(row)
    with open(out / "table.md", "a") as f:
        f.write(line + "\n")
    print(f"row {line}", flush=True)


def _fmt(x, spec: str) -> str:
    return "—" if not isinstance(x, (int, float)) or not math.isfinite(x) else format(x, spec)


def markdown_row(r: dict) -> str:
    speedup = _fmt(r.get("speedup"), ".2f")
    cells = [str(r.get("index", "")), r["engine"], r["source"], r["status"], _fmt(r.get("median_ms"), ".4g"),
             _fmt(r.get("iqr_ms"), ".3g"), _fmt(r.get("max_rel_error"), ".2e"),
             speedup if speedup == "—" else f"{speedup}x vs {r.get('reference')}",
             _fmt(r.get("build_s"), ".1f"), _fmt(r.get("eval_s"), ".1f"),
             str(r.get("message", ""))[:160].replace("|", "/").replace("\n", " ")]
    return "| " + " | ".join(cells) + " |"


