"""Paired re-timing in one evaluator: several engines alive at once, called interleaved.

Every engine is built in its own process and its first call checked, exactly as an evaluation does
(`Evaluator.hold`); then `warmup` untimed calls each, and `calls` rounds in which every engine is
called once, in orders drawn by the explicit RNG and balanced (each engine goes first in as many
rounds as the others: AB BA BA AB ...), each call on freshly drawn inputs and checked against the
float64 reference (on the CPU after the last round, as an evaluation does). Round i gives
engine A's and engine B's i-th samples: a pair that saw the same machine at nearly the same moment.
`evo.core.retiming` turns the pairs into a ratio, its 95% interval and a verdict. The machine's telemetry (`evaluators.machine.telemetry`) is sampled before and after; a GPU
that throttled meanwhile gets the rounds run once more, and the record says so.

Failure is a value: an engine that fails to build or fails a call gives `failed` records naming it.
"""
from __future__ import annotations

import math
import time
from typing import Protocol, Sequence

import numpy as np

from evaluators.machine import telemetry
from evo.core.retiming import MIN_PAIRS, PairedTiming, failed_timing, paired_timing


class Judge(Protocol):
    """What `retime` needs of an evaluator (`evaluators.judge.evaluator.Evaluator`'s held-engine block)."""

    name: str
    device: str
    settings: object
    defer_checks: bool
    sampler: telemetry.Sampler  # reads the machine around the rounds (a test passes one that throttles)

    def resolve(self, engine: str, sources: dict | None = None) -> tuple[str, dict]: ...
    def holding(self): ...
    def engine_process(self): ...
    def hold(self, process, engine: dict, deadline: float) -> tuple[str | None, float]: ...
    def timed_call(self, process, where: str, deadline: float, null_ms: float = 0.0) -> tuple[float, str | None, tuple]: ...
    def verify(self, pending: tuple) -> str | None: ...
    def describe(self) -> dict: ...


def retime(judge: Judge, engines: Sequence[str], rng: np.random.Generator, *, calls: int, warmup: int,
           min_effect: float, sources: dict | None = None, reason: str = "", generation: int = -1
           ) -> list[PairedTiming]:
    """The first engine against each of the others (len(engines) - 1 records), timed interleaved."""
    if len(engines) < 2:
        raise ValueError(f"a paired re-timing needs at least two engines, got {len(engines)}")
    if calls < MIN_PAIRS or warmup < 0:
        raise ValueError(f"calls must be >= {MIN_PAIRS} (paired calls per engine) and warmup >= 0, got calls={calls},"
                         f" warmup={warmup}")
    start = time.perf_counter()
    stamp = {"reason": reason, "generation": generation, "evaluator": judge.name,
             "device": judge.describe()["device"]}
    labels = [str(e)[:80] for e in engines]

    def failed(message: str) -> list[PairedTiming]:
        return [failed_timing(labels[0], other, message, min_effect, wall_s=time.perf_counter() - start, **stamp)
                for other in labels[1:]]

    try:
        resolved = [judge.resolve(e, sources) for e in engines]
    except ValueError as exc:
        return failed(str(exc))
    labels = [label for label, _ in resolved]
    deadline = time.perf_counter() + sum(judge.settings.budgets(baseline=engine.get("baseline") is not None)[1][1]
                                         for _, engine in resolved)  # a baseline's build has its own limit
    with judge.holding() as stack:
        held = []
        for label, engine in resolved:
            process = stack.enter_context(judge.engine_process(guarded=bool(engine.get("guarded"))))
            problem, null_ms = judge.hold(process, engine, deadline)
            if problem:
                return failed(f"{label}: {problem}")
            held.append((label, process, null_ms))
        outcome = _rounds(judge, held, rng, calls, warmup, deadline)
        if isinstance(outcome, str):
            return failed(outcome)
        samples, machine, figures = outcome
        if machine.get("throttled"):  # the GPU held its clocks down meanwhile: once more
            again = _rounds(judge, held, rng, calls, warmup, deadline)
            if isinstance(again, str):
                return failed(again)
            samples, machine, figures = again[0], {**again[1], "retimed_after_throttle": True}, again[2]
    wall_s = time.perf_counter() - start
    return [paired_timing(labels[0], labels[j], samples[0], samples[j], min_effect, wall_s=wall_s,
                          telemetry=machine, figures_a=figures[0], figures_b=figures[j], **stamp)
            for j in range(1, len(labels))]


def _rounds(judge: Judge, held: list[tuple[str, object, float]], rng: np.random.Generator, calls: int,
            warmup: int, deadline: float) -> tuple[list[list[float]], dict, list[dict]] | str:
    """Warm-up and `calls` shuffled rounds: (samples per engine, telemetry, figures per engine: name -> one
    value per timed call, from the judge's `figures` where it has one), or why a call failed."""
    samples: list[list[float]] = [[] for _ in held]
    figures: list[dict[str, list[float]]] = [{} for _ in held]
    read_figures = getattr(judge, "figures", None)
    pending: list[tuple] = []
    before = judge.sampler.sample(judge.device)
    orders = [list(rng.permutation(len(held))) for _ in range(warmup)] + balanced_orders(len(held), calls, rng)
    for round_, order in enumerate(orders):
        for i in order:
            label, process, null_ms = held[int(i)]
            timed = round_ >= warmup
            where = f"{'paired' if timed else 'warm-up'} call {round_ + 1} of {label}"
            ms, failure, check = judge.timed_call(process, where, deadline, null_ms)
            if failure is not None:
                return f"{label}: {failure}"
            if judge.defer_checks:
                pending.append((label, check))
            else:
                problem = judge.verify(check)
                if problem:
                    return f"{label}: {problem}"
            if timed:
                samples[int(i)].append(ms)
                for name, value in (read_figures(check) if read_figures else {}).items():
                    figures[int(i)].setdefault(name, []).append(float(value))
    after = judge.sampler.sample(judge.device)
    for label, check in pending:
        problem = judge.verify(check)
        if problem:
            return f"{label}: {problem}"
    if any(not math.isfinite(s) for row in samples for s in row):
        return "a timed call has no latency"
    return samples, telemetry.around(before, after), [{k: tuple(v) for k, v in f.items()} for f in figures]


def balanced_orders(engines: int, rounds: int, rng: np.random.Generator) -> list[list[int]]:
    """`rounds` call orders in which each engine goes first (second, ...) equally often: blocks of
    `engines` rounds, each block the rotations of a random order, the rounds of each block shuffled
    (for two engines: AB and BA in random order, pair after pair). A call's place in its round then
    cannot favour one engine, whatever the place costs; `rounds` is cut to whole blocks when it
    is not a multiple of `engines`, and at least one block is run."""
    orders: list[list[int]] = []
    for _ in range(max(1, rounds // engines)):
        base = [int(i) for i in rng.permutation(engines)]
        block = [base[k:] + base[:k] for k in range(engines)]
        orders += [block[int(j)] for j in rng.permutation(engines)]
    return orders
