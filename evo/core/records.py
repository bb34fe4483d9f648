"""Immutable records that flow between search, agents and evaluators.

Data flows one way: agents make `Proposal`s, evaluators turn each into exactly one `EvalResult`,
the search pairs them into `Evaluated` entries. No Ray, no MLflow, no torch here.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from evo.core.genome import Genome

# Result statuses. Only OK results may become parents or the best.
OK = "ok"
SUSPECT = "suspect"  # passed the check but timed below the roofline floor: a timing cheat or a broken timer
INCORRECT = "incorrect"
BUILD_ERROR = "build_error"
RUNTIME_ERROR = "runtime_error"
TIMEOUT = "timeout"
STATUSES: tuple[str, ...] = (OK, INCORRECT, BUILD_ERROR, RUNTIME_ERROR, TIMEOUT, SUSPECT)


@dataclass(frozen=True)
class Proposal:
    """A candidate genome, where it came from and why."""

    genome: Genome
    parents: tuple[str, ...]  # parent genome hashes; empty for seeds
    agent: str  # "seed", "fusion", "scheduling", "memory", "integration"
    move: str  # one line describing the change
    generation: int
    move_kind: str = ""  # the agent's statistic this move counts towards (e.g. "chunk_size")
    index: int = 0  # position within the generation, so arrival order does not matter
    sources: tuple[tuple[str, str], ...] = ()  # (code hash, source) of new code the genome's code genes name
    # What the proposing agent reports about it: numbers (a code agent: tokens, cost, calls, repairs) and
    # names (its model, the prompt record's path in the run directory, the stage, the code hashes).
    metrics: dict[str, float] = field(default_factory=dict, hash=False)
    artifacts: dict[str, str] = field(default_factory=dict, hash=False)

    @property
    def hash(self) -> str:
        return self.genome.hash

    def notes_json(self) -> str:
        """`metrics` and `artifacts` as the one JSON object the evidence stores in its `notes` column
        ('' when both are empty, as evidence without agent notes always had)."""
        merged = {**self.metrics, **self.artifacts}
        return json.dumps(merged, sort_keys=True) if merged else ""


def nan_for_null(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """`data` with JSON null back to NaN in the float fields of the dataclass `cls` (JSON has no NaN: the
    evidence writes it as null)."""
    floats = {f.name for f in fields(cls) if isinstance(f.default, float)}
    return {k: (math.nan if v is None and k in floats else v) for k, v in data.items()}


def null_for_nan(value: Any) -> Any:
    """`value` (dicts, lists, scalars) with non-finite floats as None: strict JSON has no NaN or infinity (the
    inverse of `nan_for_null`, which reads them back)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: null_for_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [null_for_nan(v) for v in value]
    return value


def split_notes(notes: str | dict[str, Any] | None) -> tuple[dict[str, float], dict[str, str]]:
    """(metrics, artifacts) from evidence's `notes` (a JSON object, or '' / None when there are none):
    numbers become metrics, everything else an artifact. Unreadable notes count as none."""
    if isinstance(notes, str):
        try:
            notes = json.loads(notes) if notes else {}
        except json.JSONDecodeError:
            notes = {}
    if not isinstance(notes, dict):
        return {}, {}
    metrics = {k: v for k, v in notes.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    artifacts = {k: v if isinstance(v, str) else json.dumps(v) for k, v in notes.items() if k not in metrics}
    return metrics, artifacts


@dataclass(frozen=True)
class EvalResult:
    """What one evaluation of one genome found. Failure is a status with a message, not an exception.

    The field order is the order of the evidence's result columns (evo.evidence.journal derives them)."""

    genome_hash: str
    status: str
    message: str = ""
    error: str = ""  # traceback or error text for failures
    latency_ms: float = math.nan  # median of timed repeats
    latency_spread_ms: float = math.nan  # interquartile range of timed repeats
    max_rel_error: float = math.nan  # worst relative error over the correctness cases
    build_s: float = math.nan
    eval_s: float = math.nan  # wall time of the whole evaluation
    device: str = ""
    threads: int = 0
    evaluator: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    roofline_floor_ms: float = math.nan  # the preset's roofline floor on this evaluator's machine
    # a generation engine's replay metrics under `vllm bench serve`'s names (the objective, output tokens/s,
    # TTFT, TPOT, ITL, E2E in ms); empty for a call engine
    serving: dict[str, Any] = field(default_factory=dict)
    # a generation engine's accuracy contract and what it lost against the float64 reference
    # (`evaluators.judge.accuracy`: mode, top-1 agreement, gaps, near ties, the budget); empty for a call engine
    accuracy: dict[str, Any] = field(default_factory=dict)
    # how it was timed: "full" (the run's whole trace or timing case) or "screen" (a generation workload's
    # shorter screening replays, `evo.core.fidelity`): single timings of different fidelities never compare
    fidelity: str = "full"

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} not in {STATUSES}")

    @property
    def ok(self) -> bool:
        return self.status == OK and math.isfinite(self.latency_ms)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalResult:
        """From `to_dict` output, also after a JSON round trip (which writes NaN as null)."""
        return cls(**nan_for_null(cls, data))

    def with_evaluator(self, evaluator: str) -> EvalResult:
        return replace(self, evaluator=evaluator)


@dataclass(frozen=True)
class Evaluated:
    """A proposal with its result: one row of evidence."""

    proposal: Proposal
    result: EvalResult

    @property
    def fitness(self) -> float:
        """Lower is better; failures are +inf so they never win or become parents."""
        return self.result.latency_ms if self.result.ok else math.inf


@dataclass(frozen=True)
class Parent:
    """A parent as an agent sees it: its genome and fitness (latency in ms, inf when it failed)."""

    genome: Genome
    fitness: float


@dataclass(frozen=True)
class Outcome:
    """Feedback on one proposal: which move kind it used and whether it beat its parent."""

    move_kind: str
    improved: bool
