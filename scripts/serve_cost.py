"""What serving an engine in the judge's jail costs per request: the README's load figure, per sandbox.

    .venv/bin/python scripts/serve_cost.py [--engine default:kda/cpu] [--modes strict,none] [--rounds 1]
        [--clients 8] [--requests 200] [--checkout DIR]

For each mode (round-robin over `--rounds`): `python -m evo serve ENGINE --sandbox MODE` in a process
group of its own, wait until it is ready, `evo.serving.loadgen` against it (the workload's example
requests at the preset's shape), stop the group. `--checkout DIR` adds a mode "checkout" that serves
from another checkout of this project (e.g. the commit before Serve ran engines in the jail, where the
replica called the engine in its own process): its code first on PYTHONPATH, same venv.
Prints one JSON line per run and a Markdown table of the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from evo.serving.loadgen import example_bodies, load_run

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="default:kda/cpu")
    parser.add_argument("--modes", default="strict,none")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--checkout", default=None, help="another checkout to serve from (mode 'checkout')")
    args = parser.parse_args()
    modes = args.modes.split(",") + (["checkout"] if args.checkout else [])
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            report = _serve_and_load(args, mode)
            print(json.dumps({"mode": mode, **report}), flush=True)
            runs[mode].append(report)
    print("\n| mode | p50 ms | p99 ms | requests/s | errors |\n| --- | ---: | ---: | ---: | ---: |")
    for mode, reports in runs.items():
        med = {k: statistics.median(r[k] for r in reports) for k in ("p50_ms", "p99_ms", "requests_per_s", "errors")}
        print(f"| {mode} | {med['p50_ms']:.1f} | {med['p99_ms']:.1f} | {med['requests_per_s']:.1f} | {med['errors']:g} |")


def _serve_and_load(args: argparse.Namespace, mode: str) -> dict:
    port = _free_port()
    env = dict(os.environ)
    command = [sys.executable, "-m", "evo", "serve", args.engine, "--port", str(port)]
    if mode == "checkout":
        env["PYTHONPATH"] = str(Path(args.checkout).resolve())
    else:
        command += ["--sandbox", mode]
    server = subprocess.Popen(command, env=env, cwd=args.checkout if mode == "checkout" else ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, server, 300)
        report = load_run(url, example_bodies(url, args.clients), args.clients, args.requests)
        return {"p50_ms": report.p50_ms, "p99_ms": report.p99_ms, "requests_per_s": report.requests_per_s,
                "errors": report.errors}
    finally:
        os.killpg(server.pid, signal.SIGINT)  # evo serve shuts Serve and Ray down on Ctrl-C
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _wait_ready(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"evo serve exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} was not ready within {timeout_s:g} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
