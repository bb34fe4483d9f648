"""Workload registry: a new workload is one module here plus a config."""
from __future__ import annotations

import importlib

from evo.workloads.base import Workload

_MODULES = {"kda": "evo.workloads.kda"}


def get_workload(name: str) -> Workload:
    """The workload registered under `name`, or the `WORKLOAD` of module `name` when it is a dotted
    module path (a workload kept outside this package, e.g. a test fixture)."""
    if name in _MODULES:
        return importlib.import_module(_MODULES[name]).WORKLOAD
    if "." in name:
        try:
            return importlib.import_module(name).WORKLOAD
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"workload module {name!r} could not be loaded ({exc}); it must define WORKLOAD") from exc
    raise ValueError(f"unknown workload {name!r}; available: {sorted(_MODULES)} or a dotted module path")


def workload_names() -> list[str]:
    return sorted(_MODULES)
