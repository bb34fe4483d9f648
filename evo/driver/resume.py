"""Resume a search from its run directory, after a crash or a kill -9 at any moment.

What is on disk decides what happens:
  run.json          format marker: a directory without it, or of another format, is refused
  config.yaml       the resolved config the run started with
  state.json        the search after its last complete generation: generation counter, RNG state,
                    agents' statistics and RNG states (absent if no generation completed)
  evidence.jsonl    every result, appended and fsynced as it arrived

The search is restored to the state after the last complete generation; every genome evaluated
since (the interrupted generation) is in the journal, so asking again with the restored RNG and
agents reproduces that generation's proposals, and the recorded results are replayed instead of
being evaluated again. A journal whose last line was cut by the kill is tolerated; any other
damage is an error that names the file and line.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

from evo.driver.config import RunConfig, config_from_dict
from evo.core.jsonl import JsonlError, read_jsonl
from evo.evidence.journal import evaluated_from_row, read_retimings, write_json
from evo.core.records import Evaluated, Proposal
from evo.core.search import Search

RUN_FORMAT = 1
MARKER = "run.json"


class RunDirError(ValueError):
    """A run directory that cannot be resumed; the message says which file is wrong and why."""


def write_marker(run_dir: Path, config: RunConfig) -> None:
    write_json(run_dir / MARKER, {"format": RUN_FORMAT, "workload": config.workload, "preset": config.preset})


@dataclass(frozen=True)
class SavedRun:
    run_dir: Path
    config: RunConfig
    state: dict[str, Any] | None  # None: no generation completed before the interruption
    journal: tuple[Evaluated, ...] = field(default_factory=tuple)


def load_run(run_dir: Path) -> SavedRun:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is not a directory")
    marker = _read_json(run_dir / MARKER, "the run format marker")
    if marker.get("format") != RUN_FORMAT:
        raise RunDirError(f"{run_dir / MARKER}: run format {marker.get('format')!r}, this version resumes format "
                          f"{RUN_FORMAT}; start a new run or use the matching version of engine-factory")
    try:
        config = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    except FileNotFoundError as exc:
        raise RunDirError(f"{run_dir / 'config.yaml'} is missing: cannot know how the run was configured") from exc
    except (yaml.YAMLError, ValueError) as exc:
        raise RunDirError(f"{run_dir / 'config.yaml'} is corrupt: {exc}") from exc
    state = _read_json(run_dir / "state.json", "the search checkpoint") if (run_dir / "state.json").exists() else None
    return SavedRun(run_dir, config, state, tuple(_read_journal(run_dir / "evidence.jsonl")))


def check_device(saved: SavedRun, device_type: str) -> None:
    """A run targets one device type: its timings are never continued on another."""
    timed = sorted({e.result.device for e in saved.journal if e.result.device} - {device_type})
    if timed:
        raise RunDirError(f"{saved.run_dir / 'evidence.jsonl'}: this run was timed on {timed}, but the evaluators "
                          f"here run on {device_type!r}; timings of different devices are never compared. "
                          f"Resume it where it ran, or start a new run")


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise RunDirError(f"{path} ({what}) is missing: not a run directory of this project, or written by an "
                          f"older version") from exc
    except json.JSONDecodeError as exc:
        raise RunDirError(f"{path} ({what}) is corrupt: {exc}") from exc
    if not isinstance(data, dict):
        raise RunDirError(f"{path} ({what}) is corrupt: expected an object")
    return data


def _read_journal(path: Path) -> Iterator[Evaluated]:
    try:
        rows = read_jsonl(path)  # a last line cut short by the kill is skipped: that result was never reported
    except JsonlError as exc:
        raise RunDirError(str(exc)) from exc
    for number, row in enumerate(rows, 1):
        try:
            yield evaluated_from_row(row)
        except (KeyError, TypeError, ValueError) as exc:
            raise RunDirError(f"{path}: record {number} is corrupt ({type(exc).__name__}: {exc})") from exc


def restore(search: Search, saved: SavedRun) -> dict[str, Evaluated]:
    """Put `search` (fresh, same config) in the state after the last complete generation and return
    the results of the interrupted generation, by genome hash, to replay instead of re-evaluating."""
    generation = saved.state["generation"] if saved.state else 0
    complete = [e for e in saved.journal if e.proposal.generation < generation]
    if saved.state:
        search.rng.bit_generator.state = saved.state["rng"]
        search.team.load_state(saved.state["agents"])
        missing = set(saved.state["evaluated"]) - {e.proposal.hash for e in complete}
        if missing:
            raise RunDirError(f"{saved.run_dir / 'evidence.jsonl'} lacks {len(missing)} results that state.json "
                              f"counts as evaluated (e.g. {sorted(missing)[0]}): the run directory is inconsistent")
    search.restore(complete, generation, read_retimings(saved.run_dir, generation))
    return {e.proposal.hash: e for e in saved.journal if e.proposal.generation >= generation}


class ReplayExecutor:
    """Yields recorded results for proposals already evaluated; evaluates the rest with `inner`.

    The restored search asks the interrupted generation again and gets the same proposals, so
    their recorded results are replayed. Any recorded result the generation did not ask for (it
    could only happen if proposing were not deterministic) is adopted into the search after that
    first generation is asked, so it is never evaluated again either."""

    def __init__(self, inner, search: Search, replay: dict[str, Evaluated]) -> None:
        self.inner, self.search, self.replay = inner, search, dict(replay)
        self.replayed = 0

    def run(self, proposals: list[Proposal]):
        fresh = []
        for proposal in proposals:
            if proposal.hash in self.replay:
                self.replayed += 1
                yield proposal, self.replay.pop(proposal.hash).result
            else:
                fresh.append(proposal)
        leftovers, self.replay = list(self.replay.values()), {}
        self.search.adopt(leftovers)
        if fresh:
            yield from self.inner.run(fresh)
