"""The GPU check's driver (`scripts/gpu_check.sh` calls it): one time budget divided among its parts,
each part a child process it stops at its share, and a table that is always written.

Parts, in order (BUDGET_S seconds in all, default 420, so the whole script fits 8 minutes):
  preflight  CUDA device and compute mode, a trivial Triton kernel compiled and run (TRITON_CACHE_DIR
             inside the output folder; a C compiler), free memory, the sandbox, and from jailed engine
             processes the isolation probes (arena bounds, candidate files; a FAIL there fails the
             check); each failure one line naming the cause and what it skips
  tests      the gpu-marked tests (dry run: the interpreter tests); failures go into the table's header
  warm-up    fla's kernels autotuned once at the preset shape, their configs cached in the output folder
  engines    the reference baseline, the genomes, the other baselines: one row printed and appended to
             table.md as each finishes; whatever the budget does not reach is listed as "not reached"
  model      the generation workload kimi_linear, its share kept from the end of the budget: hf_static (the
             reference), our default genome, one_at_a_time, rows numbered on from the engines'. On the GPU
             configs/kimi_linear_h200.yaml at h200 on a small trace (16 requests, 16 in flight, prompts 128-512,
             outputs 16-64, one timed replay), on the dry run configs/kimi_linear_smoke.yaml at cpu_small
A part that overruns is stopped and the next one starts; nothing ends the check before the table.
Neither Ray nor MLflow is needed (the H200 machine has neither). The parts live in
scripts/gpu_preflight.py and scripts/gpu_engines.py; this file runs them and writes the table.

    python scripts/gpu_check.py [--dry-run] [--budget-s S] [--out DIR] [--tests ARGS|none] ...
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_engines import engines, markdown_row, model, model_plan, warmup  # torch: in the parts only
from gpu_preflight import ISOLATION_ITEMS, PREFLIGHT_ITEMS, preflight

ROOT = Path(__file__).resolve().parent.parent
# of the budget; the model part's is kept from its end, the engines get the rest
SHARES = {"preflight": 0.10, "tests": 0.18, "warm-up": 0.22, "model": 0.20}
FLOORS = {"preflight": 20.0}  # seconds a part gets even from a tiny budget (imports alone take seconds)
RESERVE_S = 10.0  # kept for the table at the end
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this
ENGINES_SLACK_S = 15.0  # the engines and model parts' own deadlines come this long before they are stopped: an
# evaluation's launch, calibration, rate measurement and close lie outside its eval_timeout_s
MODEL_MIN_S = 30.0  # the model part starts only with this long left: its imports and evaluator take ~10 s,
# its deadline comes ENGINES_SLACK_S before its stop, and a candidate needs MIN_CANDIDATE_S
# The gpu-marked tests; on the dry run they skip (the plumbing is what is rehearsed): the interpreter
# tests of the kernels run in the ordinary suite (TESTS="tests/test_kda_triton.py" runs them here).
GPU_TESTS = ("-m gpu tests/test_kda_triton.py tests/test_kda_triton_code.py tests/test_kda_reference.py"
             " tests/test_arena.py tests/test_cuda_memory.py tests/test_gpu_check.py")
GPU = {"config": "configs/kda_h200.yaml", "preset": "h200", "genomes": "configs/bench_h200_genomes.json",
       "tests": GPU_TESTS,
       "settings": ["evaluator.warmup=3", "evaluator.repeats=15"],
       # the h200 model (4.3 G parameters) on a trace small enough for the model part's share
       "model": {"config": "configs/kimi_linear_h200.yaml", "preset": "h200",
                 "settings": ["evaluator.trace.count=16", "evaluator.trace.concurrency=16",
                              "evaluator.trace.prompt_len=[128,512]", "evaluator.trace.output_len=[16,64]",
                              "evaluator.replays=1"]}}
DRY = {"config": "configs/kda_cpu.yaml", "preset": "cpu_small", "genomes": "configs/bench_cpu_triton_genomes.json",
       "tests": GPU_TESTS, "baselines": "chunk_pairwise_c64,eager_recurrent",
       # the interpreter runs each Triton program in numpy: minutes per genome (the budget still bounds them)
       "settings": ["evaluator.warmup=0", "evaluator.repeats=3", "evaluator.eval_timeout_s=600",
                    "evaluator.build_timeout_s=600"],
       # hf_static's torch fallbacks take ~40 s even on 4 short requests here
       "model": {"config": "configs/kimi_linear_smoke.yaml", "preset": "cpu_small",
                 "settings": ["evaluator.trace.count=4", "evaluator.trace.output_len=[1,8]", "evaluator.replays=1"]}}
# fla's two kernels are named even where they do not import (the check then says why, loudly);
# eager_recurrent (~1.3 s a call at h200) and the compiled pairwise baseline (minutes of compile) only when named.
DEFAULT_BASELINES = "fla_chunk_kda,fla_fused_recurrent_kda,chunk_pairwise_c64"
COLUMNS = ("#", "engine", "source", "status", "median ms", "IQR ms", "max rel err", "speedup", "build s", "eval s",
           "message")


@dataclass(frozen=True)
class Part:
    """How one child process ended: its exit code (None: stopped at its deadline) and wall seconds."""

    name: str
    rc: int | None
    seconds: float
    allowed_s: float
    tail: str

    @property
    def stopped(self) -> bool:
        return self.rc is None


# ====================================================================== the orchestrator (no torch here)
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.part:
        return PARTS[args.part](args)
    return orchestrate(args)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU: cpu_small preset, Triton's interpreter")
    p.add_argument("--budget-s", type=float, default=float(os.environ.get("BUDGET_S", 420)),
                   help="seconds for the whole check (env BUDGET_S; default 420)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="output folder (env OUT)")
    p.add_argument("--config", default=None)
    p.add_argument("--preset", default=None)
    p.add_argument("--genomes", default=os.environ.get("GENOMES"), help="genome file (env GENOMES)")
    p.add_argument("--baselines", default=os.environ.get("BASELINES"),
                   help="comma-separated (env BASELINES; default on GPU: fla's two kernels and chunk_pairwise_c64)")
    p.add_argument("--tests", default=os.environ.get("TESTS"), help="pytest arguments, or 'none' (env TESTS)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config overrides for the engines part (after the check's own)")
    p.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)  # a child process's part
    p.add_argument("--deadline", type=float, default=math.inf, help=argparse.SUPPRESS)  # time.time() seconds
    p.add_argument("--first-index", type=int, default=1, help=argparse.SUPPRESS)  # the model part's first row
    return p


def orchestrate(args: argparse.Namespace) -> int:
    start = time.time()
    mode = DRY if args.dry_run else GPU
    out = Path(args.out or ROOT / "runs" / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("rows.jsonl", "plan.json", "model_plan.json", "preflight.json", "warmup.json", "judge.json",
                  "table.md"):
        (out / stale).unlink(missing_ok=True)
    end = start + args.budget_s
    env = _child_env(out, args.dry_run)
    common = ["--out", str(out), "--config", args.config or mode["config"], "--preset", args.preset or mode["preset"]]
    print(f"== gpu check ({'dry run on CPU, Triton interpreter' if args.dry_run else 'GPU'}): budget "
          f"{args.budget_s:.0f} s, output {out} ==", flush=True)

    pre = _run("preflight", [*_me(), "--part", "preflight", *common], _share(start, end, "preflight", args), env, out)
    preflight = _read_json(out / "preflight.json", [])
    exclusive = any(item.get("skips_engines") for item in preflight)

    tests = _tests(args, mode, _share(time.time(), end, "tests", args), env, out)

    baselines = args.baselines or mode.get("baselines") or DEFAULT_BASELINES
    warm = None
    seen = {item["item"]: item["status"] for item in preflight}
    no_fla = seen.get("fla", "ok") != "ok" or seen.get("device", "ok").startswith("skipped")
    if no_fla:
        print("-- warm-up: skipped (fla's kernels do not load here; see preflight)", flush=True)
    elif any(name.startswith("fla_") for name in baselines.split(",")):
        allowed = _share(time.time(), end, "warm-up", args)
        warm = _run("warm-up", [*_me(), "--part", "warmup", *common, "--baselines", baselines,
                                "--deadline", str(time.time() + allowed - STOP_GRACE_S)], allowed, env, out)
    warmup = _read_json(out / "warmup.json", {})
    cached = sorted(Path(warmup["config_dir"]).glob("*.json")) if warmup.get("config_dir") else []
    if cached:  # what the warm-up tuned, even if it was stopped before its last kernel
        env.update(warmup.get("environment", {}))

    _write_header(out, args, start, pre, preflight, tests, warm, warmup, baselines)
    overrides = [*mode["settings"], *_sandbox_override(preflight), *args.overrides]
    engines = model = None
    if exclusive:
        print("engines, model: skipped: the GPU is in EXCLUSIVE_PROCESS compute mode (see preflight)", flush=True)
    else:
        engines_end = end - RESERVE_S - SHARES["model"] * args.budget_s  # the model part's share kept
        cmd = [*_me(), "--part", "engines", *common, "--genomes", args.genomes or mode["genomes"],
               "--baselines", baselines, "--deadline", str(engines_end - ENGINES_SLACK_S),
               *[f"--set={o}" for o in overrides]]
        engines = _run("engines", cmd, max(engines_end - time.time(), 1.0), env, out)
        model = _model_part(args, mode, preflight, end, env, out)
    ran = [part for part in (pre, tests.get("part"), warm, engines, model) if part is not None]
    failures = _finish(out, start, args, tests, {"engines": engines, "model": model}, exclusive, ran, preflight)
    return 1 if failures else 0


def _model_part(args: argparse.Namespace, mode: dict, preflight: list[dict], end: float, env: dict[str, str],
                out: Path) -> Part | None:
    """The model part in what is left before the table's reserve (its share, more if the engines ended
    early); None when less than MODEL_MIN_S is left (its rows are then "not reached")."""
    left = end - RESERVE_S - time.time()
    if left < MODEL_MIN_S:
        print(f"-- model: skipped: {left:.0f} s left, it needs >= {MODEL_MIN_S:.0f} s", flush=True)
        return None
    spec = mode["model"]
    settings = [*spec["settings"], *_sandbox_override(preflight)]
    cmd = [*_me(), "--part", "model", "--out", str(out), "--config", spec["config"], "--preset", spec["preset"],
           "--first-index", str(len(_engines_plan(out, args)) + 1),
           "--deadline", str(end - RESERVE_S - ENGINES_SLACK_S), *[f"--set={o}" for o in settings]]
    return _run("model", cmd, left, env, out)


def _me() -> list[str]:
    return [sys.executable, str(Path(__file__).resolve())]


def _child_env(out: Path, dry: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["TRITON_CACHE_DIR"] = str(out / "triton-cache")  # writable, kept with the results
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(out / "inductor-cache"))
    env["PYTHONUNBUFFERED"] = "1"
    if dry:
        env["TRITON_INTERPRET"] = "1"  # before any kernel is decorated: Triton runs on the CPU
    return env


def _share(now: float, end: float, part: str, args: argparse.Namespace) -> float:
    """A part's seconds: its share of the budget, never past the end less the table's reserve."""
    return max(min(max(SHARES[part] * args.budget_s, FLOORS.get(part, 0.0)), end - RESERVE_S - now), 1.0)


def _run(name: str, cmd: list[str], allowed_s: float, env: dict[str, str], out: Path) -> Part:
    """Run one part in a process group of its own, its output passed through (and kept in
    OUT/<name>.log); at `allowed_s` it gets SIGTERM, STOP_GRACE_S later SIGKILL."""
    print(f"-- {name}: up to {allowed_s:.0f} s", flush=True)
    start = time.monotonic()
    lines: list[str] = []
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, errors="replace")

        def pump() -> None:
            for line in proc.stdout:
                print(line, end="", flush=True)
                log.write(line)
                lines.append(line)
                del lines[:-60]

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc: int | None = proc.wait(timeout=allowed_s)
        except subprocess.TimeoutExpired:
            rc = None
            _stop(proc)
        reader.join(timeout=10)
    seconds = time.monotonic() - start
    if rc is None:
        print(f"-- {name}: stopped at its budget ({allowed_s:.0f} s)", flush=True)
    return Part(name, rc, seconds, allowed_s, "".join(lines[-20:]))


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the part's own process (its finally blocks kill the candidates it started), then,
    STOP_GRACE_S later, SIGKILL to its whole process group (whatever is left of it)."""
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=STOP_GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        print(f"warning: process {proc.pid} did not end after SIGKILL", flush=True)


def _tests(args: argparse.Namespace, mode: dict, allowed_s: float, env: dict[str, str], out: Path) -> dict:
    """Run pytest as a part; what it reported (counts, or why there are none)."""
    spec = args.tests if args.tests is not None else mode["tests"]
    if spec.strip().lower() == "none":
        print("-- tests: skipped (--tests none)", flush=True)
        return {"summary": "skipped (--tests none)", "failed": False}
    part = _run("tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *shlex.split(spec)],
                allowed_s, env, out)
    counts = _pytest_counts((out / "tests.log").read_text(errors="replace"))
    said = ", ".join(f"{n} {word}" for word, n in counts.items() if n) or "no test ran"
    if part.stopped:
        return {"summary": f"INCOMPLETE: stopped at its budget ({part.allowed_s:.0f} s); so far {said}",
                "failed": bool(counts.get("failed") or counts.get("error")), "part": part}
    failed = part.rc not in (0, 5)  # 5: nothing collected (e.g. no gpu test selected)
    word = "FAILED" if failed else "passed"
    return {"summary": f"{word} (pytest exit {part.rc}, {part.seconds:.0f} s): {said}", "failed": failed, "part": part}


def _pytest_counts(text: str) -> dict[str, int]:
    """Counts from pytest's summary line, else from its progress characters (a run stopped early)."""
    last = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", line)]
    words = ("passed", "failed", "error", "skipped", "xfailed", "deselected")
    if last:
        found = dict((w, int(n)) for n, w in re.findall(r"(\d+) (\w+)", last[-1].replace("errors", "error")))
        return {w: found.get(w, 0) for w in words}
    progress = "".join(line.split(" ")[0] for line in text.splitlines() if re.fullmatch(r"[.FEsxX]+( +\[ *\d+%\])?", line))
    return {"passed": progress.count("."), "failed": progress.count("F"), "error": progress.count("E"),
            "skipped": progress.count("s"), "xfailed": progress.count("x"), "deselected": 0}


def _sandbox_override(preflight: list[dict]) -> list[str]:
    item = next((i for i in preflight if i.get("item") == "sandbox"), None)
    return ["evaluator.sandbox=none"] if item is not None and item.get("status") != "ok" else []


def _read_json(path: Path, default):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def _read_rows(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a row cut mid-write when the part was stopped
                pass
    return rows


def _write_header(out: Path, args: argparse.Namespace, start: float, pre: Part, preflight: list[dict], tests: dict,
                  warm: Part | None, warmup: dict, baselines: str) -> None:
    shares = ", ".join(f"{k} {v:.0%}" + (f" (>= {FLOORS[k]:.0f} s)" if k in FLOORS else "") for k, v in SHARES.items())
    lines = [f"### GPU check {time.strftime('%Y-%m-%d %H:%M', time.localtime(start))}"
             f"{' (dry run: CPU, Triton interpreter)' if args.dry_run else ''}", "",
             f"- budget: {args.budget_s:.0f} s ({shares}, the engines the rest; the model's share kept from the end,"
             f" {RESERVE_S:.0f} s for the table; a part's unused time goes to the next)"]
    for item in preflight:
        lines.append(f"- preflight {item['item']}: {item['status']}: {item['detail']}")
    if pre.stopped:
        left = [i for i in PREFLIGHT_ITEMS if i not in {item["item"] for item in preflight}]
        lines.append(f"- preflight: INCOMPLETE: stopped at its budget ({pre.allowed_s:.0f} s); not finished:"
                     f" {', '.join(left)}" + (" (the engines part checks the jail itself)" if "sandbox" in left else ""))
    elif pre.rc:
        lines.append(f"- preflight: FAILED (exit {pre.rc}): {pre.tail.strip().splitlines()[-1] if pre.tail.strip() else ''}")
    lines.append(f"- tests: {tests['summary']}")
    fla = next((i for i in preflight if i.get("item") == "fla"), None)
    lines.append(f"- fla: {fla['detail'] if fla else 'not checked'}")
    if warm is not None:
        state = f"stopped at its budget ({warm.allowed_s:.0f} s)" if warm.stopped else f"{warm.seconds:.0f} s"
        lines.append(f"- fla warm-up: {state}; {warmup.get('summary', 'no record')}")
    else:
        lines.append("- fla warm-up: skipped (no fla baseline named, or fla's kernels do not load here)")
    lines.append(f"- baselines: {baselines}")
    spec = (DRY if args.dry_run else GPU)["model"]
    lines.append(f"- model: kimi_linear at {spec['preset']} ({spec['config']}; {' '.join(spec['settings'])})")
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    (out / "table.md").write_text("\n".join(lines) + "\n")


def _finish(out: Path, start: float, args: argparse.Namespace, tests: dict, parts: dict[str, Part | None],
            exclusive: bool, ran: list[Part], preflight: list[dict]) -> list[str]:
    """Rows for what the engines and model parts did not reach, the notes, table.json; the table printed.
    Returns the failures that make the check's exit code 1."""
    rows = _read_rows(out / "rows.jsonl")
    done = {row["index"] for row in rows}
    planned = _engines_plan(out, args)
    model_plan = _read_json(out / "model_plan.json", None) or _fallback_model_plan(args, len(planned) + 1)
    planned = [(i, p, "engines") for i, p in enumerate(planned, 1)] + [(p["index"], p, "model") for p in model_plan]
    missing = [{"index": i, "engine": p["engine"], "source": p["source"], "status": "not reached",
                "message": _not_reached_why(name, parts[name], exclusive)} for i, p, name in planned if i not in done]
    crashed = {name: part for name, part in parts.items() if part is not None and part.rc not in (0, None)}
    all_rows = sorted(rows + missing, key=lambda r: r.get("index", 0))
    _rewrite_rows(out / "table.md", all_rows)
    with open(out / "table.md", "a") as table:
        judge = _read_json(out / "judge.json", {})
        table.write("\n")
        if judge:
            table.write(f"- judge's cost per candidate: {judge['summary']}\n")
        for name, part in crashed.items():
            table.write(f"- {name} part FAILED (exit {part.rc}): {part.tail.strip()[-600:]}\n")
        used = ", ".join(f"{p.name} {p.seconds:.0f} of {p.allowed_s:.0f} s{' (stopped)' if p.stopped else ''}" for p in ran)
        table.write(f"- wall time: {time.time() - start:.0f} s of a {args.budget_s:.0f} s budget ({used})\n")
    failures = [f"tests: {tests['summary']}"] if tests.get("failed") else []
    failures += [f"preflight {i['item']}: {i['detail']}" for i in preflight
                 if i.get("item") in ISOLATION_ITEMS and i.get("status") == "FAIL"]
    failures += [f"{r['engine']}: {r['message']}" for r in rows if r.get("status") == "missing"]
    failures += [f"{name} part exit {part.rc}" for name, part in crashed.items()]
    (out / "table.json").write_text(json.dumps({"rows": all_rows, "failures": failures, "wall_s": time.time() - start,
                                                "budget_s": args.budget_s}, indent=1, default=str))
    print(f"\n== table ({out / 'table.md'}) ==")
    print((out / "table.md").read_text(), flush=True)
    if failures:
        print("gpu check: FAILED: " + "; ".join(failures), flush=True)
    return failures


def _rewrite_rows(table: Path, rows: list[dict]) -> None:
    """The table's rows in the plan's order (the parts appended each as it finished; rows.jsonl is whole
    where a stopped part cut a line of table.md)."""
    lines = table.read_text().splitlines()
    head = lines[:lines.index("|" + " --- |" * len(COLUMNS)) + 1]
    table.write_text("\n".join([*head, *(markdown_row(r) for r in rows)]) + "\n")


def _not_reached_why(name: str, part: Part | None, exclusive: bool) -> str:
    if exclusive:
        return "EXCLUSIVE_PROCESS compute mode"
    if part is None:
        return f"the budget ended before the {name} part"
    return f"the {name} part stopped at its budget" if part.stopped else "the budget ended"


def _engines_plan(out: Path, args: argparse.Namespace) -> list[dict]:
    """The engines part's plan: as it wrote it, else as it would have."""
    return _read_json(out / "plan.json", None) or _fallback_plan(args)


def _fallback_plan(args: argparse.Namespace) -> list[dict]:
    """What the engines part would have planned, read from its inputs without torch (it ended before
    writing plan.json, or never started): the genome file's entries, then the baselines."""
    mode = DRY if args.dry_run else GPU
    path = ROOT / (args.genomes or mode["genomes"])
    try:
        text = path.read_text()
        count = len(json.loads(text)) if text.lstrip().startswith("[") else sum(1 for ln in text.splitlines() if ln.strip())
    except (OSError, ValueError):
        count = 0
    names = [n for n in (args.baselines or mode.get("baselines") or DEFAULT_BASELINES).split(",") if n]
    return ([{"engine": f"genome {i} of {path.name}", "source": "genome"} for i in range(1, count + 1)]
            + [{"engine": f"baseline:{n}", "source": "baseline"} for n in names])


def _fallback_model_plan(args: argparse.Namespace, first: int) -> list[dict]:
    """What the model part would have planned (it ended before writing model_plan.json, or never started):
    the reference baseline, the default genome, the other baseline, numbered from `first`."""
    preset = (DRY if args.dry_run else GPU)["model"]["preset"]
    return [{"index": i, "engine": label, "source": kind}
            for i, (kind, _, label) in enumerate(model_plan(preset, None, "genome"), first)]


# each run as `--part NAME` in a child
PARTS = {"preflight": preflight, "warmup": warmup, "engines": engines, "model": model}

if __name__ == "__main__":
    sys.exit(main())
