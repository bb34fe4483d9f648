"""The machine's ceilings for the roofline floor, remembered per machine.

A ceiling measured while other processes load the machine reads low, and a low ceiling makes the
floor too high: an honest engine then "beats" the physical limit. So the evaluator never trusts one
probe: it keeps the best rates this machine ever showed in a small JSON file per machine (key: device
kind and name, threads, preset dtype), raises the file whenever a probe beats it, and uses the higher
of the probe and the file for each rate. The floor can only get lower (sounder) over time.

The file lives in `$EVO_RATES_CACHE` if set, else `~/.cache/evo/rates`; delete it to recalibrate a
machine whose hardware changed under the same name.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from evo.workloads.base import DeviceInfo, MachineRates

ENV = "EVO_RATES_CACHE"
MEASURED = "measured"  # a probe of this run set the rates (and raised the cache, or there was none)
CACHED = "cache"  # the machine's cached calibration beat this run's probes
RUN = "run"  # the driver handed these rates to every evaluator: one floor for the run


@dataclass(frozen=True)
class Calibration:
    """Rates for the floor and where they came from (MEASURED, CACHED or RUN)."""

    rates: MachineRates
    source: str
    key: str = ""


def machine_key(info: DeviceInfo, dtype: str) -> str:
    """A readable file name per (device kind, device name, threads, preset dtype); threads only on CPU."""
    threads = info.threads if info.kind == "cpu" else 0
    digest = hashlib.sha256(f"{info.kind}|{info.name}|{threads}|{dtype}".encode()).hexdigest()[:10]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{info.kind}-{info.name}").strip("-")[:48]
    return f"{slug}-{threads}t-{dtype}-{digest}"


def cache_dir() -> Path:
    return Path(os.environ.get(ENV) or Path.home() / ".cache" / "evo" / "rates")


def cached(key: str) -> MachineRates | None:
    """The best rates remembered for `key` (None: none, or an unreadable file)."""
    try:
        data = json.loads((cache_dir() / f"{key}.json").read_text())
        return MachineRates(float(data["flops_per_s"]), float(data["bytes_per_s"]),
                            {str(k): float(v) for k, v in data.get("matmul_flops", {}).items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def remember(key: str, measured: MachineRates) -> Calibration:
    """max(cache, `measured`) for each rate; the cache is raised when `measured` beats it (a cache that
    cannot be written only costs the memory)."""
    old = cached(key)
    best = measured if old is None else measured.merged_max(old)
    if best != old:
        path = cache_dir() / f"{key}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"flops_per_s": best.flops_per_s, "bytes_per_s": best.bytes_per_s,
                                       "matmul_flops": dict(best.matmul_flops)}, indent=1))
            os.replace(tmp, path)  # atomic: evaluators of one machine share the file
        except OSError:
            pass
    return Calibration(best, MEASURED if best == measured else CACHED, key)
