"""How a room of evaluators/ offers its names: its face (`__init__.py`) maps each name to the module that
holds it and imports that module on first use, so importing a room runs nothing of it (a room's module run
with `python -m`, the sandbox's zygote, is not imported twice)."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def offers(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that resolves each of `names` (name -> module in the package)."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} offers {sorted(names)}, not {name!r}")
        return getattr(importlib.import_module(f"{package}.{names[name]}"), name)

    return __getattr__
