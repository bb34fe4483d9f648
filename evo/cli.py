"""Command line: `python -m evo run CONFIG [--out DIR] [--set key=value ...]`."""
from __future__ import annotations

import argparse
import os
import sys

from evo.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evo", description="Evolve inference engines on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)
    run_cmd = commands.add_parser("run", help="run a search from a YAML config")
    run_cmd.add_argument("config", help="YAML experiment config, e.g. configs/kda_cpu.yaml")
    run_cmd.add_argument("--out", help="run directory (default: <out_dir>/<name>-<timestamp>)")
    run_cmd.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="override a config value, e.g. --set search.generations=3 (repeatable)")
    resume_cmd = commands.add_parser("resume", help="continue a search from its run directory")
    resume_cmd.add_argument("run_dir", help="the run directory of an interrupted search")
    serve_cmd = commands.add_parser("serve", help="serve a run's best engine over HTTP with Ray Serve")
    serve_cmd.add_argument("engine", metavar="RUN",
                           help="run directory, models:/NAME/VERSION, runs:/RUN_ID, an MLflow run id or default:WORKLOAD/PRESET")
    serve_cmd.add_argument("--host", default="127.0.0.1")
    serve_cmd.add_argument("--port", type=int, default=8000)
    serve_cmd.add_argument("--name", default="engine", help="Serve application name")
    serve_cmd.add_argument("--max-batch-size", type=int, default=8)
    serve_cmd.add_argument("--tracking-uri", default=None, help="MLflow store for models:/ and runs:/ sources")
    genes_cmd = commands.add_parser("genes", help="print a workload preset's gene space")
    genes_cmd.add_argument("config")
    sync_cmd = commands.add_parser("mlflow-sync", help="replay the MLflow writes a run left pending (store was down)")
    sync_cmd.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding mlflow_outbox.jsonl")
    sync_cmd.add_argument("--tracking-uri", default=None, help="MLflow store (default: the one the run used)")
    sync_cmd.add_argument("--wait", type=float, default=30.0, help="seconds to keep retrying an unreachable store")
    args = parser.parse_args(argv)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(".inductor_cache"))
    if args.command == "serve":
        from evo.serving.serve_cli import serve_forever

        return serve_forever(args.engine, host=args.host, port=args.port, name=args.name,
                             max_batch_size=args.max_batch_size, tracking_uri=args.tracking_uri)
    if args.command == "resume":
        from evo.resume import RunDirError, load_run

        try:
            saved = load_run(args.run_dir)
        except RunDirError as exc:
            print(f"error: cannot resume: {exc}", file=sys.stderr)
            return 2
        from evo.run import run

        outcome = run(saved.config, resume=saved, handle_signals=True)
        return 0 if outcome.summary.get("best_hash") else 1
    if args.command == "mlflow-sync":
        from evo.mlflow_sink import sync

        left = sync(args.run_dir, args.tracking_uri, args.wait)
        print(f"MLflow operations still pending: {left}" if left else "MLflow has every operation of this run")
        return 1 if left else 0
    try:
        config = load_config(args.config, getattr(args, "overrides", []))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "genes":
        return _print_genes(config)
    from evo.run import run  # Ray and torch load only when needed

    outcome = run(config, args.out, handle_signals=True)
    return 0 if outcome.summary.get("best_hash") else 1


def _print_genes(config) -> int:
    from evo.workloads import get_workload
    from evo.workloads.base import DeviceInfo

    workload = get_workload(config.workload)
    preset = workload.presets()[config.preset]
    device = DeviceInfo(preset.device, preset.device, config.evaluators.threads)
    for row in workload.gene_space(preset, device).describe():
        print(f"{row['domain']:10s} {row['gene']:24s} default={row['default']!s:22s} {row['values']}  {row['doc']}")
    return 0
