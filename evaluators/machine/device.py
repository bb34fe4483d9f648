"""The device an evaluator owns: which one, its readable name, its cores, and version stamps."""
from __future__ import annotations

import os
import platform
import sys
from typing import Sequence

import numpy as np
import torch

from evo.workloads.base import DeviceInfo, Preset


def select_device(preset: Preset) -> str:
    """'cuda:0' for a cuda preset (Ray's CUDA_VISIBLE_DEVICES leaves the assigned GPU as device 0),
    'cpu' for a cpu preset. A cuda preset without CUDA is a configuration error."""
    if preset.device == "cpu":
        return "cpu"
    if preset.device == "cuda":
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
            raise RuntimeError(
                f"preset {preset.name!r} needs a cuda device, but torch.cuda.is_available() is False here "
                f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES={visible}). Run it on a GPU node with a "
                f"CUDA build of torch and give the evaluator num_gpus=1, or pick a cpu preset."
            )
        return "cuda:0"
    raise ValueError(f"preset {preset.name!r} has device {preset.device!r}; allowed: 'cpu', 'cuda'")


def pin_cores(cores: Sequence[int]) -> None:
    """Pin this process to `cores` and size torch's thread pool to match, so evaluators that own
    disjoint core sets never share cores while timing."""
    cores = tuple(int(c) for c in cores)
    available = sorted(os.sched_getaffinity(0))
    if not cores or not set(cores) <= set(available):
        raise ValueError(f"cannot pin to cores {list(cores)}; this process may use {available}")
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


def device_info(device: str, threads: int) -> DeviceInfo:
    if torch.device(device).type == "cuda":
        return DeviceInfo(kind="cuda", name=torch.cuda.get_device_name(torch.device(device)), threads=threads)
    return DeviceInfo(kind="cpu", name=cpu_name(), threads=threads)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def versions(device: str) -> dict[str, str]:
    """Versions stamped on every result."""
    stamp = {
        "torch": str(torch.__version__),  # a plain str: a TorchVersion imports torch wherever a result is unpickled
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "platform": platform.platform(),
    }
    if torch.device(device).type == "cuda":
        stamp["cuda"] = str(torch.version.cuda)
        stamp["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return stamp


def sync(device: str) -> None:
    """Wait for queued device work, so a timer read covers the work and only the work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
