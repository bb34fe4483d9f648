"""Workload registry: a new workload is one module (here, or anywhere importable) plus a config.

A config names a workload by its registered name (every package `evo/workloads/<name>/` but the shared
generation core is registered under `<name>`: adding a workload is adding its folder) or by the dotted path of any module whose
`WORKLOAD` is an instance of `evo.workloads.base.Workload` (e.g. a workload kept outside this
package, or a test fixture); nothing here has to change for a new one.
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from evo.workloads.base import Workload

DEFAULT_WORKLOAD = "kda"  # what a config without a `workload` key runs
SAMPLE_CONFIG = "configs/kda_smoke.yaml"  # a small, complete config: named where a config is missing or empty
SHARED_PACKAGES = ("generation_core",)  # packages here that workloads build on, not workloads themselves
# name -> module: the packages in this folder (a workload is a package; base, domain, requests are modules)
_MODULES = {info.name: f"{__name__}.{info.name}"
            for info in pkgutil.iter_modules([str(Path(__file__).parent)])
            if info.ispkg and info.name not in SHARED_PACKAGES}


def get_workload(name: str) -> Workload:
    """The workload registered under `name`, or the `WORKLOAD` of the module at the dotted path `name`."""
    module_name = _MODULES.get(name, name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if name not in _MODULES and getattr(exc, "name", None) in _prefixes(module_name):
            raise ValueError(f"unknown workload {name!r}; available: {workload_names()}, or the dotted path "
                             f"of an importable module that defines WORKLOAD") from None
        raise ValueError(f"workload module {module_name!r} could not be loaded ({type(exc).__name__}: {exc})") from exc
    except ValueError as exc:  # e.g. a relative or empty module name
        raise ValueError(f"unknown workload {name!r}; available: {workload_names()}, or the dotted path "
                         f"of an importable module that defines WORKLOAD ({exc})") from None
    workload = getattr(module, "WORKLOAD", None)
    if not isinstance(workload, Workload):
        raise ValueError(f"workload module {module_name!r} must define WORKLOAD, an instance of a "
                         f"evo.workloads.base.Workload subclass; found {type(workload).__name__}")
    return workload


def workload_names() -> list[str]:
    """The registered names (any dotted module path is accepted too)."""
    return sorted(_MODULES)


def _prefixes(dotted: str) -> set[str]:
    """"a.b.c" -> {"a", "a.b", "a.b.c"}: the modules whose absence means `dotted` does not exist."""
    parts = dotted.split(".")
    return {".".join(parts[: i + 1]) for i in range(len(parts))}
