"""Replica memory under maximum-size requests: the figure in docs/serving.md, "Bounded memory".

Starts `python -m evo serve default:kda/cpu_small` (in-process Ray on 127.0.0.1, default limits:
max_request_bytes 64 MiB, max_inflight_bytes 128 MiB), then N clients each send R requests whose JSON
("data" encoding, the costliest to decode) is just under max_request_bytes, while the replica's
resident memory is sampled every 50 ms. Prints the replica's RSS before, its peak, and after.

    .venv/bin/python scripts/serve_memory.py --clients 8 --requests 3
"""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evo.serving.codec import encode_tensor  # noqa: E402
from evo.workloads import get_workload  # noqa: E402
from evo.workloads.base import CheckCase  # noqa: E402

MAX_REQUEST_BYTES = 64 * 1024 * 1024


def body_near_limit(limit: int) -> bytes:
    """A "data" request of cpu_small inputs whose JSON is just under `limit` bytes."""
    workload = get_workload("kda")
    preset = workload.presets()["cpu_small"]

    def body(T: int) -> bytes:
        case = CheckCase("mem", {**preset.shape, "T": T}, "standard", False)
        inputs = workload.make_inputs(case, "float32", "cpu", 0)
        tensors = {k: encode_tensor(v, "data") for k, v in inputs.items() if v is not None}
        return json.dumps({"inputs": tensors}).encode()

    per_token = len(body(200)) / 200
    return body(int(0.97 * limit / per_token))


def log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def post(port: int, body: bytes) -> int:
    """POST /v1/infer, stopping the upload as soon as the server answers (a 413 or 503 comes before the
    body is read, and the server then closes the connection: a client that keeps sending sees a reset)."""
    head = (f"POST /v1/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=600) as sock:
            sock.sendall(head)
            view, sent = memoryview(body), 0
            while sent < len(body):
                readable, writable, _ = select.select([sock], [sock], [], 600)
                if readable:
                    break  # answered early
                sent += sock.send(view[sent:sent + (1 << 20)])
            reply = b""
            while chunk := sock.recv(1 << 16):
                reply += chunk
        return int(reply.split(b" ", 2)[1])
    except (OSError, IndexError, ValueError) as exc:  # e.g. reset by the server's close after an early answer
        log(f"no reply: {type(exc).__name__}: {exc}")
        return -1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=3, help="per client")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "evo", "serve", "default:kda/cpu_small", "--port", str(port)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        body = body_near_limit(MAX_REQUEST_BYTES)
        log(f"body of {len(body) / (1 << 20):.1f} MiB ready")
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(url + "/v1/engine", timeout=5) as response:
                    replica = psutil.Process(json.loads(response.read())["replica"])
                break
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    raise SystemExit("the server did not come up")
                time.sleep(1)
        before = replica.memory_info().rss
        log(f"replica {replica.pid} up, RSS {before >> 20} MiB")
        peak, done = before, threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, replica.memory_info().rss)
                time.sleep(0.05)

        statuses: Counter = Counter()
        lock = threading.Lock()

        def client() -> None:
            for _ in range(args.requests):
                code = post(port, body)
                with lock:
                    statuses[code] += 1
                    log(f"HTTP {code}; peak so far {peak >> 20} MiB")

        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.monotonic()
        clients = [threading.Thread(target=client) for _ in range(args.clients)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        elapsed = time.monotonic() - started
        time.sleep(5)
        done.set()
        sampler.join()
        after = replica.memory_info().rss
        mib = 1 << 20
        print(f"request: {len(body) / mib:.1f} MiB of JSON numbers; {args.clients} clients x {args.requests} requests "
              f"in {elapsed:.0f} s; statuses {dict(statuses)}")
        print(f"replica RSS: before {before / mib:.0f} MiB, peak {peak / mib:.0f} MiB, 5 s after {after / mib:.0f} MiB")
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
