"""Engine factory: evolutionary search for inference engines.

    import evo
    result = evo.run("configs/<workload>_smoke.yaml", overrides={"search.generations": 2})
    evo.load_run(result.run_dir).dataframe()

Importing `evo` is cheap: torch, Ray and MLflow load only when a function needs them (see evo.api).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from evo.api import RunResult

__all__ = ["RunResult", "load_run", "run"]


def run(config, overrides=None, out_dir=None, quiet: bool = False) -> RunResult:
    """Run a search from a YAML config (or a RunConfig) with `overrides`; see `evo.api.run`."""
    from evo.api import run as _run

    return _run(config, overrides, out_dir, quiet)


def load_run(path) -> RunResult:
    """The results of the run directory `path`; see `evo.api.load_run`."""
    from evo.api import load_run as _load_run

    return _load_run(path)


def __getattr__(name: str) -> Any:
    if name == "RunResult":
        from evo.api import RunResult

        return RunResult
    raise AttributeError(f"module 'evo' has no attribute {name!r}")
