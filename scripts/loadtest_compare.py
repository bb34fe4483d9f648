"""Our server against the servers users would run instead, on the same checkpoint folder and the same load.

    .venv/bin/python scripts/loadtest_compare.py --checkpoint runs/checkpoints/cpu \
        --ours ".venv/bin/python -m evo serve hf-engine-source --port {port}" \
        --concurrency 1,4,16 --num-prompts 32 --input-len 64 --output-len 64

For each server (ours, transformers, vllm, llamacpp; `--servers` picks) it starts the server on
127.0.0.1 at a free port, waits until GET /v1/models answers (polling, `--ready-timeout`), runs
`evo.bench.loadtest` at each concurrency with the same seeded text prompts (the checkpoint's tokenizer)
and with every request held to its output length, stops the server's process group, and writes each
run's JSON and one markdown table (`--out`). A server that is missing, fails to start or fails its
load is a row saying why. Servers run one at a time, never two together.

`--ours` is a command template ({port}, {host}, {checkpoint} are filled in; `--port {port}` is added if
the template has no {port}) or the URL of a server already running (not started or stopped here).
The alternatives live in their own venvs under $ALT_DIR (/work/alt), made by scripts/alternatives/
setup_*.sh; `--server-cmd NAME=TEMPLATE` replaces any one server's command.

How each holds requests to the output length: ours and vLLM take `ignore_eos: true`; `transformers serve`
refuses unknown fields, so it gets `generation_config: {"min_new_tokens": O}`; llama.cpp's server has no
ignore-eos at all, so the checkpoint's special tokens (EOS among them) get `logit_bias` -1e4 instead, and
its row says so. Its stream carries no usage, so its output tokens are counted by re-encoding the text
(as vLLM's benchmark does), which can differ from the true count by a few tokens ("len≠asked").
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evo.bench.loadtest import LoadtestError, LoadtestOptions, loadtest  # noqa: E402
from evo.bench.loadtest_report import write_result  # noqa: E402

ALT_DIR = Path(os.environ.get("ALT_DIR", "/work/alt"))
SERVERS = ("ours", "transformers", "transformers_cb", "vllm", "llamacpp")
HERE = Path(__file__).resolve().parent / "alternatives"


@dataclass(frozen=True)
class Server:
    """How to start one server and load it fairly."""

    name: str
    argv: tuple[str, ...] = ()  # empty with url: already running
    url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    ignore_eos: bool = True
    extra_body: dict[str, Any] | None = None
    model: str | None = None  # None: the first id of /v1/models
    note: str = ""
    missing: str | None = None  # why it cannot run here
    prepare: tuple[str, ...] = ()  # a command to run first (the GGUF conversion)
    prepared: str | None = None  # the file `prepare` makes; skipped when it exists


@dataclass(frozen=True)
class Row:
    server: str
    concurrency: int | None
    metrics: dict[str, Any] | None = None
    note: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def special_ids(checkpoint: Path) -> list[int]:
    """Ids of the tokenizer's special tokens (EOS among them), for a server without ignore-eos."""
    try:
        data = json.loads((checkpoint / "tokenizer.json").read_text())
        return sorted(t["id"] for t in data.get("added_tokens", []) if t.get("special"))
    except (OSError, ValueError, KeyError):
        return []


def _fill(template: str, **values: Any) -> tuple[str, ...]:
    return tuple(shlex.split(template.format(**values)))


def build_servers(args: argparse.Namespace, port: int, max_len: int) -> dict[str, Server]:
    ckpt = args.checkpoint
    model = str(ckpt)
    threads = str(args.threads)
    omp = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    overrides = dict(item.split("=", 1) for item in args.server_cmd)
    fill = dict(port=port, host="127.0.0.1", checkpoint=ckpt, max_len=max_len, threads=threads)
    servers: dict[str, Server] = {}

    if args.ours.startswith(("http://", "https://")):
        servers["ours"] = Server("ours", url=args.ours.rstrip("/"), note="already running (not started here)")
    else:
        template = overrides.get("ours", args.ours)
        if "{port}" not in template:
            template += " --port {port}"
        servers["ours"] = Server("ours", _fill(template, **fill), env=omp)

    venv = ALT_DIR / "transformers" / "bin" / "transformers"
    servers["transformers"] = Server(
        "transformers", _fill(overrides.get("transformers", f"{venv} serve {{checkpoint}} --host 127.0.0.1 "
                                                            "--port {port} --device cpu --dtype float32"), **fill),
        env=omp, ignore_eos=False, model=model,
        extra_body={"generation_config": json.dumps({"min_new_tokens": args.output_len,
                                                     "max_new_tokens": args.output_len})},
        note="output length held by generation_config min_new_tokens (no ignore_eos field)",
        missing=None if "transformers" in overrides or venv.exists()
        else f"{venv} missing: run scripts/alternatives/setup_transformers.sh")

    # the same server with its continuous batching (paged attention) on: what a user would turn on for concurrency
    servers["transformers_cb"] = dataclasses.replace(
        servers["transformers"], name="transformers_cb",
        argv=_fill(overrides.get("transformers_cb", f"{venv} serve {{checkpoint}} --host 127.0.0.1 --port {{port}} "
                                                       "--device cpu --dtype float32 --continuous-batching"), **fill),
        missing=None if "transformers_cb" in overrides or venv.exists()
        else f"{venv} missing: run scripts/alternatives/setup_transformers.sh")

    vllm = ALT_DIR / "vllm" / "bin" / "vllm"
    bind = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    servers["vllm"] = Server(
        "vllm", _fill(overrides.get("vllm", f"{vllm} serve {{checkpoint}} --host 127.0.0.1 --port {{port}} "
                                            "--dtype float32 --max-model-len {max_len}"), **fill),
        env={**omp, "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)},
        model=model, missing=None if "vllm" in overrides or vllm.exists()
        else f"{vllm} missing: run scripts/alternatives/setup_vllm.sh")

    python = ALT_DIR / "llamacpp" / "bin" / "python"
    gguf = Path(args.out) / f"{ckpt.name}-f32.gguf"
    banned = special_ids(ckpt)
    ready = python.exists() and subprocess.run([str(python), "-c", "import llama_cpp.server"],
                                               capture_output=True).returncode == 0
    servers["llamacpp"] = Server(
        "llamacpp", _fill(overrides.get("llamacpp", f"{python} -m llama_cpp.server --model {gguf} --host 127.0.0.1 "
                                                    "--port {port} --n_ctx {max_len} --n_threads {threads} "
                                                    f"--n_threads_batch {{threads}} --interrupt_requests False "
                                                    f"--model_alias {model}"), **fill),
        env=omp, ignore_eos=False, model=model,
        extra_body={"logit_bias": {str(i): -1e4 for i in banned}} if banned else None,
        note="its server has no ignore-eos: " + (f"special tokens {banned} banned by logit_bias instead" if banned
                                                 else "outputs may stop early at EOS"),
        prepare=(str(python), str(HERE / "to_gguf.py"), str(ckpt), "--out", str(gguf), "--outtype", "f32"),
        prepared=str(gguf),
        missing=None if "llamacpp" in overrides or ready
        else f"llama-cpp-python not importable in {python.parent.parent}: run scripts/alternatives/setup_llamacpp.sh")
    return servers


def wait_ready(url: str, process: subprocess.Popen | None, timeout_s: float) -> str | None:
    """Poll GET url/v1/models until it answers 200; None when ready, else why not."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            return f"exited with status {process.returncode} before it was ready"
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
                if response.status == 200:
                    return None
                last = f"HTTP {response.status}"
        except Exception as exc:  # not listening yet, or still loading
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(1.0)
    return f"not ready after {timeout_s:.0f} s (last: {last})"


def stop(process: subprocess.Popen) -> None:
    """End the server's whole process group (it was started in a session of its own): INT (Ctrl-C, the
    clean stop of `evo serve`, vLLM and uvicorn), then TERM, then KILL, 20 s apart."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:  # the group is gone
            return
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone: give its children a moment, then end any left in the group
            time.sleep(1)
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])[-400:]
    except OSError:
        return ""


def run_server(server: Server, args: argparse.Namespace, port: int, out: Path) -> list[Row]:
    """Start (unless already running), load at each concurrency, stop. Never raises for the server's faults."""
    if server.missing:
        return [Row(server.name, None, note=f"not run: {server.missing}")]
    log_path = out / f"{server.name}.log"
    if server.prepare and not Path(server.prepared or "").exists():
        print(f"[{server.name}] preparing: {shlex.join(server.prepare)}", flush=True)
        with open(log_path, "w") as log:
            done = subprocess.run(server.prepare, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            return [Row(server.name, None, note=f"not run: preparing failed ({_tail(log_path)}); see {log_path}")]
    process = None
    url = server.url or f"http://127.0.0.1:{port}"
    try:
        if server.argv:
            print(f"[{server.name}] starting: {shlex.join(server.argv)}  (log {log_path})", flush=True)
            log = open(log_path, "a")
            try:
                process = subprocess.Popen(server.argv, env={**os.environ, **server.env}, stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as exc:
                return [Row(server.name, None, note=f"not run: cannot start ({exc})")]
            finally:
                log.close()
        started = time.monotonic()
        why = wait_ready(url, process, args.ready_timeout)
        if why:
            return [Row(server.name, None, note=f"not run: {why}; {_tail(log_path)}")]
        print(f"[{server.name}] ready in {time.monotonic() - started:.0f} s", flush=True)
        rows = []
        for concurrency in args.concurrency:
            rows.append(load_once(server, url, concurrency, args, out))
        return rows
    finally:
        if process is not None:
            stop(process)


def load_once(server: Server, url: str, concurrency: int, args: argparse.Namespace, out: Path) -> Row:
    options = LoadtestOptions(
        url=url, model=server.model, endpoint=args.endpoint, random_input_len=args.input_len,
        random_output_len=args.output_len, num_prompts=args.num_prompts, max_concurrency=concurrency,
        seed=args.seed, tokenizer=str(args.checkpoint), ignore_eos=server.ignore_eos,
        extra_body=json.dumps(server.extra_body) if server.extra_body else None, metric_percentiles="50,99",
        label=f"{server.name}-c{concurrency}", request_timeout=args.request_timeout)
    try:
        result = loadtest(options, log=lambda line: None)
    except LoadtestError as exc:
        return Row(server.name, concurrency, note=f"failed: {exc}")
    print(result.table(), flush=True)
    write_result(str(out / f"{server.name}-c{concurrency}.json"), result.as_json())
    return Row(server.name, concurrency, result.metrics, server.note)


def _ms(value: Any) -> str:
    return "" if value is None else f"{value:.1f}"


def markdown(rows: list[Row], header: str) -> str:
    lines = [header, "",
             "| server | concurrency | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ITL p50 ms "
             "| E2EL p50 ms | failed | len≠asked | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        m = r.metrics
        if m is None:
            lines.append(f"| {r.server} | {r.concurrency or ''} | | | | | | | | | | {r.note} |")
            continue
        counted = (f"{m['usage_missing']} without usage in the stream: output tokens counted from the text"
                   if m.get("usage_missing") else "")
        note = "; ".join(x for x in (r.note, counted, m.get("first_error") or "") if x)
        lines.append(f"| {r.server} | {r.concurrency} | {m['output_throughput']:.1f} | {_ms(m['median_ttft_ms'])} | "
                     f"{_ms(m.get('p99_ttft_ms'))} | {_ms(m['median_tpot_ms'])} | {_ms(m.get('p99_tpot_ms'))} | "
                     f"{_ms(m['median_itl_ms'])} | {_ms(m['median_e2el_ms'])} | {m['failed']} | "
                     f"{m['output_len_mismatch']} | {note.replace('|', '/')} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path,
                        help="a save_pretrained folder with a tokenizer (scripts/make_checkpoint.py --preset cpu --out DIR)")
    parser.add_argument("--ours", required=True,
                        help="our server: a command template with {port} (and {checkpoint}, {host}), or its URL")
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"which to run, in order: {', '.join(SERVERS)}")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated --max-concurrency values")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per concurrency")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    parser.add_argument("--seed", type=int, default=0, help="the dataset's seed (the same for every server)")
    parser.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    parser.add_argument("--threads", type=int, default=1,
                        help="compute threads of each server (1: on a shared 2-core box, 2 threads ran 10x slower)")
    parser.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE for vLLM's CPU build")
    parser.add_argument("--ready-timeout", type=float, default=900.0,
                        help="seconds a server may take to answer GET /v1/models (vLLM CPU: ~2-4 min)")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--server-cmd", action="append", default=[], metavar="NAME=TEMPLATE",
                        help="replace one server's command ({port}, {checkpoint}, {max_len}, {threads} filled in)")
    parser.add_argument("--out", default=None, help="folder for the JSONs, logs and compare.md "
                                                    "(default: runs/loadtest-compare-<timestamp>)")
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--concurrency: got {args.concurrency!r}; allowed: comma-separated integers >= 1, e.g. 1,4,16")
    if not args.concurrency or min(args.concurrency) < 1:
        parser.error(f"--concurrency: got {args.concurrency}; allowed: comma-separated integers >= 1")
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in args.servers if s not in SERVERS]
    if unknown or not args.servers:
        parser.error(f"--servers: got {unknown or args.servers}; allowed: a comma-separated subset of {','.join(SERVERS)}")
    bad = [item for item in args.server_cmd if item.split("=", 1)[0] not in SERVERS or "=" not in item]
    if bad:
        parser.error(f"--server-cmd: got {bad}; allowed: NAME=TEMPLATE with NAME one of {', '.join(SERVERS)}")
    if not (args.checkpoint / "config.json").exists() or not (args.checkpoint / "tokenizer.json").exists():
        parser.error(f"--checkpoint: {args.checkpoint} needs config.json and tokenizer.json "
                     "(scripts/make_checkpoint.py --preset cpu --out DIR writes both)")
    for name in ("num_prompts", "input_len", "output_len", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: got {getattr(args, name)}; allowed: an integer >= 1")
    args.checkpoint = args.checkpoint.resolve()
    args.out = Path(args.out or ROOT / "runs" / f"loadtest-compare-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    max_len = max(2048, args.input_len + args.output_len + 64)
    rows: list[Row] = []
    for name in args.servers:
        port = free_port()
        server = build_servers(args, port, max_len)[name]
        rows.extend(run_server(server, args, port, args.out))
    load = os.getloadavg()
    header = (f"One sequential run on {os.uname().nodename} ({os.cpu_count()} CPUs, load {load[0]:.1f} at the end), "
              f"{datetime.now():%Y-%m-%d %H:%M}: checkpoint {args.checkpoint.name}, {args.num_prompts} requests per "
              f"concurrency, {args.input_len}-token text prompts, {args.output_len} output tokens, seed {args.seed}, "
              f"{args.threads} compute thread(s) per server, {args.endpoint}. Single timings: compare within this "
              "table, not across runs. 'len≠asked': requests whose output length, as counted, is not the one asked "
              "(without usage in a server's stream the text is re-encoded, which can differ by a few tokens).")
    table = markdown(rows, header)
    (args.out / "compare.md").write_text(table + "\n")
    (args.out / "compare.json").write_text(json.dumps(
        [{"server": r.server, "concurrency": r.concurrency, "note": r.note, "metrics": r.metrics} for r in rows],
        indent=1, default=str) + "\n")
    print(table)
    print(f"written: {args.out}/compare.md, compare.json, <server>-c<N>.json, <server>.log")
    return 0 if any(r.metrics for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
