"""A bounded HTTP load run against a served engine: N clients, M requests in all, latency quantiles.

    .venv/bin/python -m evo.serving.loadgen http://127.0.0.1:8000 --clients 8 --requests 200 --T 1024

The requests are the served workload's `example_request`s (read from GET /v1/engine), so any
workload that declares a request schema can be driven. Only for servers on this machine's loopback
addresses.
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
from typing import Any, Callable, Mapping


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


def load_run(url: str, bodies: list[bytes], clients: int, requests: int,
             check: Callable[[int, dict], str | None] | None = None) -> LoadReport:
    """`clients` threads share `requests` POSTs to url/v1/infer; client i sends bodies[i % len].

    With `check`, every 200 response is also judged: `check(body index, response)` returns None when
    the response is right, else what is wrong with it, which counts as an error."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    per_client = [requests // clients + (1 if i < requests % clients else 0) for i in range(clients)]

    def client(index: int) -> None:
        which = index % len(bodies)
        for _ in range(per_client[index]):
            started = time.perf_counter()
            try:
                code, response = post_json(f"{url}/v1/infer", bodies[which])
                error = None if code == 200 else f"HTTP {code}: {json.dumps(response)[:300]}"
                elapsed = time.perf_counter() - started
                if error is None and check is not None:
                    error = check(which, response)
            except Exception as exc:  # a refused or broken connection (or a failing check) is an error too
                error, elapsed = repr(exc), time.perf_counter() - started
            with lock:
                latencies.append(elapsed)
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


def request_body(inputs: Mapping[str, Any], encoding: str = "b64") -> bytes:
    """The JSON body of one request: {name: tensor} (None entries left out) in `encoding`."""
    from evo.serving.codec import encode_tensor

    return json.dumps({"inputs": {k: encode_tensor(v, encoding) for k, v in inputs.items() if v is not None},
                       "encoding": encoding}).encode()


def example_bodies(url: str, count: int, encoding: str = "b64", **axes: int) -> list[bytes]:
    """`count` request bodies for the engine served at `url`: its workload's `example_request` at the
    served preset's shape (free `axes` overridable, e.g. T=1024), fresh inputs per seed."""
    from evo.workloads import get_workload

    with urllib.request.urlopen(f"{url}/v1/engine", timeout=30) as response:
        info = json.loads(response.read())
    workload = get_workload(info["workload"])
    preset = workload.presets()[info["preset"]]
    return [request_body(workload.example_request(preset, seed, **axes), encoding) for seed in range(count)]


def _axis(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value.strip().lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=INTEGER, e.g. T=1024; got {text!r}")
    return name, int(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--T", type=int, default=None, help="sequence length, the same as --axis T=... "
                        "(default: the preset's)")
    parser.add_argument("--axis", type=_axis, action="append", default=[], metavar="NAME=VALUE",
                        help="a free axis of the served workload at another size than the preset's (repeatable)")
    parser.add_argument("--encoding", choices=("data", "b64"), default="b64")
    args = parser.parse_args()
    url = args.url.rstrip("/")
    axes = dict(args.axis, **({"T": args.T} if args.T else {}))
    report = load_run(url, example_bodies(url, args.clients, args.encoding, **axes), args.clients, args.requests)
    print(json.dumps(asdict(report), indent=2))
    return 0 if report.errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
