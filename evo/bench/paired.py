"""Paired claims for `evo bench` and `evo compare`: every speedup they state comes from a paired re-timing
taken in the same run (`evaluators.judge.paired`, through the evaluator's `retime`), as a ratio with its 95%
interval and a verdict, never from two single timings taken at different moments.

`LocalRetimer` is the search's `evo.core.retiming.Retimer` in this process (intensification in the
bench's short search and in `compare`'s agents runs): each challenge re-timed in the one evaluator,
charged to the run's meter when it has one (`evo.bench.strategies.Meter`: none starts once its wall
budget is spent). `retime_against_default` re-times genomes against the gene space's default genome,
for `compare`'s speedups over the default.
An evaluator without `retime` (the deterministic synthetic one: its timings are exact) re-times nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence, runtime_checkable

from evo.core.genome import Genome
from evo.core.retiming import (EQUAL, FAILED, FASTER, NOT_TIMED, SLOWER, Challenge, IntensifySettings, PairedTiming,
                               failed_timing)

_FLIPPED = {FASTER: SLOWER, SLOWER: FASTER, EQUAL: EQUAL, FAILED: FAILED}


@runtime_checkable
class PairedJudge(Protocol):
    """An evaluator that can time engines interleaved (`evaluators.judge.evaluator.Evaluator`)."""

    def retime(self, engines: Sequence[str], *, calls: int, warmup: int, min_effect: float,
               sources: Mapping[str, str] | None = None, reason: str = "ab", generation: int = -1
               ) -> list[PairedTiming]: ...


def can_retime(evaluator: object) -> bool:
    return isinstance(evaluator, PairedJudge)


@dataclass(frozen=True)
class Speedup:
    """How many times faster `engine` is than `other` (other's latency / engine's) with its 95% interval,
    and the verdict on `engine` (faster, slower, equal within noise, failed)."""

    estimate: float
    low: float
    high: float
    verdict: str

    def text(self) -> str:
        """e.g. '4.97x [4.81, 5.12] faster'."""
        if self.verdict == FAILED or not math.isfinite(self.estimate):
            return "failed"
        word = "equal within noise" if self.verdict == EQUAL else self.verdict
        return f"{self.estimate:.2f}x [{self.low:.2f}, {self.high:.2f}] {word}"


def speedup(timings: Sequence[PairedTiming], engine: str, other: str) -> Speedup | None:
    """`engine` against `other` from whichever record timed the two (in either order); None if none did."""
    for t in timings:
        if (t.a, t.b) == (engine, other):
            estimate, low, high = t.speedup
            return Speedup(estimate, low, high, t.verdict)
        if (t.a, t.b) == (other, engine):  # ratio = other / engine: already engine's speedup
            return Speedup(t.ratio, t.low, t.high, _FLIPPED[t.verdict])
    return None


def retime_against(judge: PairedJudge, engines: Sequence[str], baselines: Sequence[str],
                   settings: IntensifySettings, say=print, reason: str = "bench") -> list[PairedTiming]:
    """Each engine against every baseline, one interleaved run per engine (the engine first); records with
    a = the engine's label (its genome hash, or baseline:NAME), b = each baseline's."""
    timings: list[PairedTiming] = []
    for engine in engines:
        others = [b for b in baselines if b != engine]
        if not others:
            continue
        run = judge.retime([engine, *others], calls=settings.calls, warmup=settings.warmup,
                           min_effect=settings.min_effect, reason=reason)
        for t in run:
            say(f"  paired        {t.describe()}")
        timings += run
    return timings


@dataclass(frozen=True)
class AgainstDefault:
    """Genomes re-timed paired against the gene space's default genome (a = the genome, b = the default)."""

    default: str  # the default genome's hash
    timings: tuple[PairedTiming, ...]

    def speedup(self, genome_hash: str) -> Speedup | None:
        """How many times faster than the default, with its 95% interval; the default itself is 1.0 with no
        interval (nan) and verdict equal; None when not re-timed."""
        if genome_hash == self.default:
            return Speedup(1.0, math.nan, math.nan, EQUAL)
        return speedup(self.timings, genome_hash, self.default)

    def to_dict(self) -> dict:
        return {"default": self.default, "timings": [t.to_dict() for t in self.timings]}


def retime_against_default(judge: PairedJudge, genomes: Sequence[str], default_json: str,
                           settings: IntensifySettings, say=print) -> AgainstDefault:
    """Each genome (JSON; the default itself skipped) re-timed paired against the default genome, at the
    intensify settings' calls, warm-up and minimum effect."""
    default = [default_json]
    engines = [g for g in genomes if g != default_json]
    return AgainstDefault(Genome.from_json(default_json).hash,
                          tuple(retime_against(judge, engines, default, settings, say, "default")))


class LocalRetimer:
    """The search's challenges re-timed one by one in this process's evaluator; keeps every record. With a
    `meter` (`evo.bench.strategies.Meter`), each re-timing is charged to it and none starts once its budget
    is spent (answered as not timed, as a stopped run's)."""

    def __init__(self, judge: PairedJudge, meter=None) -> None:
        self.judge = judge
        self.meter = meter
        self.timings: list[PairedTiming] = []

    def retime(self, challenges: list[Challenge], settings: IntensifySettings) -> list[PairedTiming]:
        out = []
        for c in challenges:
            if self.meter is not None and not self.meter.begin():
                out.append(failed_timing(c.challenger.proposal.hash, c.holder.proposal.hash, NOT_TIMED,
                                         settings.min_effect, reason=c.reason, generation=c.generation))
                continue
            sources = {**dict(c.holder.proposal.sources), **dict(c.challenger.proposal.sources)}
            timed = self.judge.retime([c.challenger.proposal.genome.to_json(), c.holder.proposal.genome.to_json()],
                                      calls=settings.calls, warmup=settings.warmup, min_effect=settings.min_effect,
                                      sources=sources, reason=c.reason, generation=c.generation)
            if self.meter is not None:
                self.meter.end()  # charged its wall time here
            self.timings += timed
            out += timed
        return out

    @property
    def wall_s(self) -> float:
        return sum(t.wall_s for t in self.timings if math.isfinite(t.wall_s))
