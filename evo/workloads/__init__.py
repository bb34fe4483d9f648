"""Workload registry: a new workload is one module here plus a config."""
from __future__ import annotations

import importlib

from evo.workloads.base import Workload

_MODULES = {"kda": "evo.workloads.kda"}


def get_workload(name: str) -> Workload:
    """The workload object registered under `name` (each module exposes `WORKLOAD`)."""
    if name not in _MODULES:
        raise ValueError(f"unknown workload {name!r}; available: {sorted(_MODULES)}")
    return importlib.import_module(_MODULES[name]).WORKLOAD


def workload_names() -> list[str]:
    return sorted(_MODULES)
