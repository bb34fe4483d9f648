"""Device telemetry: what the machine was doing around a measurement, stamped into the evidence.

On CUDA (through `pynvml`, imported only when a CUDA device is sampled; absent or failing, the stamp
says so): SM and memory clocks, temperature, power and the throttle reasons. On the CPU: the load
average and, where the kernel exposes it, the current frequency of the cores this process may use.
A sample is a flat {name: number or text} map; `throttled` says whether a GPU sample shows a clock
held down by power or heat: an evaluation's timed calls, or a paired re-timing's rounds, taken
while throttled are run once more, and the stamp says so (`retimed_after_throttle`).

Who samples is a `Sampler` (`MachineSampler`: this machine); an evaluator takes one, so a test can
pass a sampler of its own (one that reports a throttle) without touching NVML.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

# Throttle reasons that mean the clocks were held down by the device itself (not idle, not app clocks).
_THROTTLES = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40,
              "hw_power_brake": 0x80}
_NVML: Any = None  # the pynvml module once initialised; False when it cannot be


class Sampler(Protocol):
    """What the evaluator reads the machine with: one flat stamp per call (see `sample`)."""

    def sample(self, device: str) -> dict[str, Any]: ...


class MachineSampler:
    """This machine's telemetry: `sample` below."""

    def sample(self, device: str) -> dict[str, Any]:
        return sample(device)


def sample(device: str) -> dict[str, Any]:
    """One reading of the machine: the CPU's always, the GPU's too for a cuda device."""
    stamp = cpu_sample()
    if device.startswith("cuda"):
        stamp.update(gpu_sample(_gpu_index(device)))
    return stamp


def cpu_sample() -> dict[str, Any]:
    stamp: dict[str, Any] = {}
    try:
        one, five, fifteen = os.getloadavg()
        stamp.update(load_1m=round(one, 2), load_5m=round(five, 2), load_15m=round(fifteen, 2))
    except OSError:
        pass
    stamp["cpus"] = len(os.sched_getaffinity(0))
    mhz = _cpu_mhz(sorted(os.sched_getaffinity(0)))
    if mhz:
        stamp["cpu_mhz"] = round(sum(mhz) / len(mhz), 1)
    return stamp


def _cpu_mhz(cores: list[int]) -> list[float]:
    """Current frequency of `cores` from cpufreq (kHz), else the 'cpu MHz' lines of /proc/cpuinfo."""
    found = []
    for core in cores:
        try:
            found.append(int(Path(f"/sys/devices/system/cpu/cpu{core}/cpufreq/scaling_cur_freq").read_text()) / 1e3)
        except (OSError, ValueError):
            continue
    if found:
        return found
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
    values = [float(line.split(":", 1)[1]) for line in lines if line.startswith("cpu MHz")]
    return [values[c] for c in cores if c < len(values)] or values


def gpu_sample(index: int = 0) -> dict[str, Any]:
    nvml = _nvml()
    if not nvml:
        return {"gpu_telemetry": "unavailable (pynvml missing or NVML failed to initialise)"}
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        reasons = int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
        held = [name for name, bit in _THROTTLES.items() if reasons & bit]
        return {"sm_clock_mhz": nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
                "mem_clock_mhz": nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM),
                "temperature_c": nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
                "power_w": round(nvml.nvmlDeviceGetPowerUsage(handle) / 1e3, 1),
                "throttle": ",".join(held) or "none", "throttled": bool(held)}
    except Exception as exc:  # noqa: BLE001 - a reading that fails is stamped as such, never fatal
        return {"gpu_telemetry": f"failed: {type(exc).__name__}: {exc}"[:200]}


def throttled(stamp: dict[str, Any]) -> bool:
    return bool(stamp.get("throttled"))


def around(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Two samples (before and after the timed calls) as one flat stamp: each value as it was after, and
    `<name>_before` where it changed; `throttled` if either was."""
    stamp: dict[str, Any] = {}
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key), after.get(key)
        if key == "throttled":
            continue
        stamp[key] = b if a is None else a
        if a is not None and b is not None and a != b:
            stamp[f"{key}_before"] = b
    stamp["throttled"] = throttled(before) or throttled(after)
    return stamp


def as_versions(stamp: dict[str, Any]) -> dict[str, str]:
    """The stamp as text under `telemetry.*` keys, for a result's environment stamp (`EvalResult.versions`)."""
    return {f"telemetry.{k}": str(v) for k, v in stamp.items()}


def _gpu_index(device: str) -> int:
    _, _, index = device.partition(":")
    logical = int(index or 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if ids and logical < len(ids) and ids[logical].isdigit():
        return int(ids[logical])  # NVML counts every GPU of the machine, not the visible ones
    return logical


def _nvml():
    global _NVML
    if _NVML is None:
        try:
            import pynvml

            pynvml.nvmlInit()
            _NVML = pynvml
        except Exception:  # noqa: BLE001 - not installed, no driver: no GPU telemetry
            _NVML = False
    return _NVML
