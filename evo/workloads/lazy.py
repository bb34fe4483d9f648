"""A workload's torch-heavy modules, imported on first use.

Agent processes unpickle a gene space, which imports the workload's package (its constraints live
there), and need nothing of torch: with the package's engine, baseline, input and reference modules
behind `lazy(...)`, an agent starts ~2.5 s of CPU sooner (four of them at every run's start-up).
Where a real module is needed, call `.load()`. The zygote calls `load_all()` before it forks an engine's
process: engines start with the engine-side modules loaded. Modules declared `judge_only` (a workload's
reference and baselines) are never loaded there: an engine's process does not hold them, and the jail's
view leaves their files out (`evaluators.sandbox.view`), so nothing of them is within an engine's reach.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any


class lazy:  # noqa: N801 - reads as the import it stands for
    """`_inputs = lazy("evo.workloads.kda.inputs")`: attribute reads import the module the first time."""

    def __init__(self, name: str, judge_only: bool = False) -> None:
        self._name = name
        self._module: ModuleType | None = None
        self.judge_only = judge_only  # the reference or the baselines: never preloaded for engines
        _ALL.append(self)

    def load(self) -> ModuleType:
        if self._module is None:  # once: attribute reads sit on per-call paths (inputs drawn, engines run)
            self._module = importlib.import_module(self._name)
        return self._module

    def loaded(self) -> ModuleType | None:
        """The module if this process has imported it already (by this handle or any other way), else None."""
        return self._module or sys.modules.get(self._name)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(self.load(), attr)

    def __repr__(self) -> str:
        return f"lazy({self._name!r})"


_ALL: list[lazy] = []  # every lazy module declared so far, for load_all


def load_all() -> None:
    """Import every engine-side module declared lazy so far (by the modules imported until now)."""
    for module in list(_ALL):
        if not module.judge_only:
            module.load()


def judge_only_files() -> list[str]:
    """The source files of every judge-only module declared so far (found without importing them)."""
    files = []
    for module in list(_ALL):
        if module.judge_only:
            spec = importlib.util.find_spec(module._name)
            if spec is not None and spec.origin:
                files.append(spec.origin)
    return files
