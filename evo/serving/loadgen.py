"""A bounded HTTP load run against a served engine: N clients, M requests in all, latency quantiles.

    .venv/bin/python -m evo.serving.loadgen http://127.0.0.1:8000 --clients 8 --requests 200 --T 1024

Only for servers on this machine's loopback addresses.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LoadReport:
    requests: int
    errors: int
    p50_ms: float
    p99_ms: float
    requests_per_s: float
    first_error: str | None


def post_json(url: str, body: bytes, timeout: float = 60.0) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def load_run(url: str, bodies: list[bytes], clients: int, requests: int) -> LoadReport:
    """`clients` threads share `requests` POSTs to url/v1/infer; client i sends bodies[i % len]."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    per_client = [requests // clients + (1 if i < requests % clients else 0) for i in range(clients)]

    def client(index: int) -> None:
        body = bodies[index % len(bodies)]
        for _ in range(per_client[index]):
            started = time.perf_counter()
            try:
                code, response = post_json(f"{url}/v1/infer", body)
                error = None if code == 200 else f"HTTP {code}: {json.dumps(response)[:300]}"
            except Exception as exc:  # a refused or broken connection is an error too
                error = repr(exc)
            with lock:
                latencies.append(time.perf_counter() - started)
                if error:
                    errors.append(error)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [latencies[0]] * 99
    return LoadReport(len(latencies), len(errors), 1e3 * q[49], 1e3 * q[98], len(latencies) / wall,
                      errors[0] if errors else None)


def kda_bodies(url: str, count: int, T: int | None, encoding: str) -> list[bytes]:
    """Request bodies with fresh random inputs at the served preset's shape (T overridable)."""
    from evo.serving.codec import encode_tensor
    from evo.workloads import get_workload
    from evo.workloads.base import CheckCase

    with urllib.request.urlopen(f"{url}/v1/engine", timeout=30) as response:
        info = json.loads(response.read())
    workload = get_workload(info["workload"])
    preset = workload.presets()[info["preset"]]
    shape = {**preset.shape, **({"T": T} if T else {})}
    bodies = []
    for seed in range(count):
        inputs = workload.make_inputs(CheckCase("load", shape, "standard", True), preset.dtype, "cpu", seed)
        bodies.append(json.dumps({"inputs": {k: encode_tensor(v, encoding) for k, v in inputs.items()},
                                  "encoding": encoding}).encode())
    return bodies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--T", type=int, default=None, help="sequence length (default: the preset's)")
    parser.add_argument("--encoding", choices=("data", "b64"), default="b64")
    args = parser.parse_args()
    report = load_run(args.url.rstrip("/"), kda_bodies(args.url.rstrip("/"), args.clients, args.T, args.encoding),
                      args.clients, args.requests)
    print(json.dumps(asdict(report), indent=2))
    return 0 if report.errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
