"""The Python API: run a search, or open a finished one, and get its results as one object.

    import evo
    result = evo.run("configs/<workload>_smoke.yaml", overrides={"search.generations": 2})
    result = evo.load_run("runs/smoke-20261201-120000")
    result.best_hash, result.summary.speedup_vs_best_baseline, result.baselines["eager"].latency_ms
    frame = result.dataframe()  # one row per evaluation (pandas)

Imported lazily by `evo/__init__.py`: `import evo` loads neither torch nor Ray; `evo.run` loads them.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import pandas

    from evo.core.records import EvalResult, Evaluated
    from evo.driver.config import RunConfig
    from evo.evidence.summary import Summary


@dataclass(frozen=True)
class RunResult:
    """A run's results as its run directory holds them: config, summary, baselines, every evaluation."""

    run_dir: Path
    config: RunConfig
    summary: Summary
    baselines: dict[str, EvalResult]  # baseline name -> its timing in this run
    evaluations: tuple[Evaluated, ...]  # every result, in the order it was recorded

    @property
    def best_hash(self) -> str | None:
        """The best engine's genome hash (None: no correct engine was found)."""
        return self.summary.best_hash

    @property
    def best_genome(self) -> dict[str, Any] | None:
        """The best engine's genome ({domain: {gene: value}}), as `evo serve` and `evo bench` take it."""
        return self.summary.best_genome

    @property
    def best_latency_ms(self) -> float:
        return self.summary.best_latency_ms

    def dataframe(self) -> pandas.DataFrame:
        """Every evaluation as one row (the evidence's columns: generation, genome_hash, agent, move, status,
        latency_ms, ...). Needs pandas."""
        if importlib.util.find_spec("pandas") is None:
            raise ImportError("RunResult.dataframe() needs pandas, which is not installed here: "
                              "pip install pandas (the evidence is also in RUN_DIR/generations/*.parquet)")
        import pyarrow as pa

        from evo.evidence.journal import SCHEMA, evidence_row

        return pa.Table.from_pylist([evidence_row(e) for e in self.evaluations], schema=SCHEMA).to_pandas()


def load_run(path: str | Path) -> RunResult:
    """The results in the run directory `path` (finished or stopped); RunDirError names what is missing."""
    from evo.core.records import EvalResult
    from evo.driver.resume import RunDirError, load_run as load_saved
    from evo.evidence.summary import SUMMARY_FILE, Summary

    saved = load_saved(Path(path))
    summary_path = saved.run_dir / SUMMARY_FILE
    if not summary_path.exists():
        raise RunDirError(f"{summary_path} is missing: the run has not ended (continue it with "
                          f"`python -m evo resume {saved.run_dir}`)")
    baselines_path = saved.run_dir / "baselines.json"
    baselines = ({name: EvalResult.from_dict(r) for name, r in json.loads(baselines_path.read_text()).items()}
                 if baselines_path.exists() else {})
    return RunResult(saved.run_dir.resolve(), saved.config, Summary.read(summary_path), baselines, saved.journal)


def run(config: str | Path | RunConfig, overrides: Mapping[str, Any] | None = None, out_dir: str | Path | None = None,
        quiet: bool = False) -> RunResult:
    """Run the search a YAML config (or a `RunConfig`) describes, with `overrides` such as
    {"search.generations": 2} or {"search": {"generations": 2}}, in the new run directory `out_dir`
    (default: <out_dir>/<name>-<timestamp>); `quiet` prints only the final summary."""
    from evo.driver.config import RunConfig, config_from_dict, load_config
    from evo.driver.run import run as run_search

    flat = [f"{key}={json.dumps(value)}" for key, value in _flatten(overrides or {})]
    if isinstance(config, RunConfig):
        config = config_from_dict(_merged(config.to_dict(), dict(_flatten(overrides or {}))))
    else:
        config = load_config(config, flat)
    outcome = run_search(config, Path(out_dir) if out_dir is not None else None, verbosity=-1 if quiet else 0)
    return load_run(outcome.run_dir)


def _flatten(overrides: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """{"search": {"generations": 2}} -> [("search.generations", 2)]: one override per leaf, so the rest of a
    section keeps its configured values (a `genes` restriction stays one mapping)."""
    items = []
    for key, value in overrides.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and name != "genes":
            items.extend(_flatten(value, f"{name}."))
        else:
            items.append((name, value))
    return items


def _merged(data: dict[str, Any], flat: dict[str, Any]) -> dict[str, Any]:
    for key, value in flat.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return data
