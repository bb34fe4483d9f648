"""A workload's torch-heavy modules, imported on first use.

Agent processes unpickle a gene space, which imports the workload's package (its constraints live
there), and need nothing of torch: with the package's engine, baseline, input and reference modules
behind `lazy(...)`, an agent starts ~2.5 s of CPU sooner (four of them at every run's start-up).
Where a real module is needed (the guard patches attributes on it), call `.load()`. The zygote calls
`load_all()` before it forks an engine's process: engines start with these modules loaded, as the
jail hides some of them (the reference and the baselines) from the engine's own imports.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class lazy:  # noqa: N801 - reads as the import it stands for
    """`_inputs = lazy("evo.workloads.kda.inputs")`: attribute reads import the module the first time."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None
        _ALL.append(self)

    def load(self) -> ModuleType:
        if self._module is None:  # once: attribute reads sit on per-call paths (inputs drawn, engines run)
            self._module = importlib.import_module(self._name)
        return self._module

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(self.load(), attr)

    def __repr__(self) -> str:
        return f"lazy({self._name!r})"


_ALL: list[lazy] = []  # every lazy module declared so far, for load_all


def load_all() -> None:
    """Import every module declared lazy so far (by the modules imported until now)."""
    for module in list(_ALL):
        module.load()
