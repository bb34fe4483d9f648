"""The judge of a generation workload (`Workload.contract == "generation"`): an engine that takes
requests and returns tokens, judged as a client sees it.

One evaluation (the engine built in its own sandboxed process, as for a call engine):
1. a **check replay**: every edge of the verified domain in one burst, more requests than may be in
   flight (R + 2, so the engine queues): prompts of one token and of the longest length P, outputs of
   one token and of the most N, token ids 0 and V-1 and a repeated token; fresh ids every evaluation;
2. `replays` **timed replays** of the run's trace (its shape fixed by the trace's seed, its prompts
   fresh each time), each stamped on the judge's clock (`evaluators.replay`);
3. every request of every replay scored against the float64 reference on its own tokens (on the CPU
   after the last timed replay, so the reference never evicts the engine's caches between them).
The result's latency is the run's objective (by default milliseconds per output token: the inverse
of output tokens/s) as the median over the timed replays; `serving` keeps the median replay's
metrics under `vllm bench serve`'s names. A median below the roofline floor is re-timed and, still
below, `suspect`.

Paired re-timing (`evaluators.paired`) uses the same pieces through `hold`, `timed_call` and `verify`:
one "call" is one whole replay of the trace.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
import numpy as np

from evaluators.replay import ConfinedGenerator, ForbiddenCallError, GenerationError, Replay, replay, score
from evaluators.sandbox import EngineProcess, EngineProcessError
from evo.core.records import INCORRECT, OK, RUNTIME_ERROR, SUSPECT, TIMEOUT, EvalResult
from evo.core.stream_metrics import ServingMetrics, Slo, serving_metrics
from evo.core.trace import TraceRequest, TraceSpec, draw

OBJECTIVES = {
    "ms_per_output_token": "replay duration / output tokens, ms (1000 / output tokens/s)",
    "tpot_p99_ms": "p99 time per output token, ms",
    "tpot_median_ms": "median time per output token, ms",
    "ttft_p99_ms": "p99 time to first token, ms",
    "e2el_median_ms": "median end-to-end latency of a request, ms",
}


PAIRED_FIGURES = ("output_throughput", "ttft_median_ms", "ttft_p99_ms", "tpot_median_ms", "tpot_p99_ms",
                  "e2el_median_ms")


def _figure(metrics: ServingMetrics, name: str) -> float:
    if name == "output_throughput":
        return metrics.output_throughput
    return objective_of(metrics, name)


def objective_of(metrics: ServingMetrics, objective: str) -> float:
    """The number the search minimises, read off a replay's metrics."""
    if objective == "ms_per_output_token":
        return 1e3 * metrics.duration_s / metrics.total_output_tokens if metrics.total_output_tokens else math.nan
    name, stat = objective.removesuffix("_ms").rsplit("_", 1)
    return getattr(metrics, f"{name}_ms")[stat]


def _first(what: str, problems) -> str:
    """The first of a replay's problems, and how many more there were."""
    return f"{what}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")


@dataclass(frozen=True)
class _Timed:
    """One timed replay awaiting its score: what the judge saw and the metrics it gives."""

    result: Replay
    metrics: ServingMetrics


class GenerationJudge:
    """The generation contract's evaluation and held-engine pieces, for one `Evaluator` (its settings,
    sandbox, seeds, roofline and result records)."""

    def __init__(self, evaluator) -> None:  # an evaluators.evaluator.Evaluator (which imports this module)
        self.ev = evaluator
        self.workload, self.preset, settings = evaluator.workload, evaluator.preset, evaluator.settings
        self.trace: TraceSpec = self.workload.trace(self.preset)
        self.requests: tuple[TraceRequest, ...] = draw(self.trace, np.random.default_rng(self.trace.seed))
        self.objective = settings.objective
        if self.objective.startswith("tpot") and self.trace.output_len[1] < 2:
            raise ValueError(f"evaluator.objective {self.objective!r} needs requests of 2 or more tokens (a TPOT); the "
                             f"trace's outputs are {list(self.trace.output_len)} tokens")
        self.replays = settings.replays
        self.vocab = int(self.preset.shape["V"])
        self.tolerance = self.workload.tie_tolerance(self.preset)
        self.slo = Slo(**settings.slo) if settings.slo else None  # goodput's bounds, if the config sets any

    # ----------------------------------------------------------------- one evaluation
    def judge(self, process: EngineProcess, genome_hash: str, start: float, engine: dict) -> EvalResult:
        ev = self.ev
        built, failed = ev.built(process, genome_hash, start, engine, contract="generation")
        if failed is not None:
            return failed
        stamp, deadline = built.stamp, built.deadline
        generator = ConfinedGenerator(process)  # each replay bounds it by the evaluation's deadline
        problem = self.check(generator, deadline)
        if problem:
            return ev.result(genome_hash, problem[0], start, message=problem[1], **stamp)
        timed, problem = self._timed(generator, deadline, self.replays)
        if problem:
            return ev.result(genome_hash, problem[0], start, message=problem[1], **stamp)
        median = self._median(timed)
        note = (f"{sum(len(t.result.requests) for t in timed)} requests of {len(timed)} timed replays and "
                f"{self.ev.preset.shape['R'] + 2} of a check replay, each scored on its own tokens")
        if ev.below_floor(median):
            first = median
            again, problem = self._timed(generator, deadline, self.replays)
            if problem:
                return ev.result(genome_hash, problem[0], start, message=f"re-verification: {problem[1]}", **stamp)
            timed, median = again, self._median(again)
            if ev.below_floor(median):
                return ev.result(genome_hash, SUSPECT, start, latency_ms=median, serving=self._serving(timed),
                                 message=f"{self.objective} {median:.4g} (first {first:.4g}, re-timed on fresh prompts)"
                                         f" is below the roofline floor {ev.roofline_floor_ms():.4g}: never ranked",
                                 **stamp)
            note += f"; re-timed after a first {first:.4g} below the floor"
        values = sorted(objective_of(t.metrics, self.objective) for t in timed)
        return ev.result(genome_hash, OK, start, latency_ms=median, latency_spread_ms=values[-1] - values[0],
                         serving=self._serving(timed), message=note, **stamp)

    def check(self, generator: ConfinedGenerator, deadline: float) -> tuple[str, str] | None:
        """The check replay (see the module): (status, message) of its first problem, or None."""
        rng = np.random.default_rng(self.ev.next_seed())
        trace, prompts = self._edges(rng)
        timed, problem = self._replay(generator, trace, prompts, deadline, "the check replay",
                                      concurrency=int(self.preset.shape["R"]))
        return problem or self._score([timed], "the check replay")

    def _edges(self, rng: np.random.Generator) -> tuple[list[TraceRequest], list[list[int]]]:
        """R + 2 requests at once: every prompt band and output band of the domain, both vocabulary edges."""
        shape = self.preset.shape
        R, P, N, V = int(shape["R"]), int(shape["P"]), int(shape["N"]), self.vocab
        count = R + 2
        # one token and the longest prompt, one and the most new tokens, and both longest: every position held
        prompt_lens = [1, P, P, *rng.integers(1, P + 1, max(0, count - 3))][:count]
        output_lens = [N, 1, N, *rng.integers(1, N + 1, max(0, count - 3))][:count]
        prompts = [rng.integers(0, V, n).tolist() for n in prompt_lens]
        prompts[0][-1:] = [V - 1]  # both ends of the vocabulary, whatever P is
        prompts[1][:1] = [0]
        if count > 3:
            prompts[3] = [int(rng.integers(0, V))] * len(prompts[3])  # one token repeated
        trace = [TraceRequest(i, 0.0, len(p), int(n)) for i, (p, n) in enumerate(zip(prompts, output_lens))]
        return trace, prompts

    def _prompts(self, rng: np.random.Generator) -> list[list[int]]:
        return [rng.integers(0, self.vocab, t.prompt_len).tolist() for t in self.requests]

    def _timed(self, generator: ConfinedGenerator, deadline: float, replays: int
               ) -> tuple[list[_Timed], tuple[str, str] | None]:
        """`replays` replays of the run's trace on fresh prompts, then every request scored."""
        timed = []
        for i in range(replays):
            prompts = self._prompts(np.random.default_rng(self.ev.next_seed()))
            one, problem = self._replay(generator, self.requests, prompts, deadline, f"timed replay {i + 1}")
            if problem:
                return timed, problem
            timed.append(one)
        return timed, self._score(timed, "a timed replay")

    def _replay(self, generator: ConfinedGenerator, trace, prompts, deadline: float, what: str,
                concurrency: int | None = None) -> tuple[_Timed | None, tuple[str, str] | None]:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return None, (TIMEOUT, f"the evaluation ran out of time before {what}")
        generator.deadline = deadline
        try:
            result = replay(generator, trace, prompts, deadline_s=remaining,
                            concurrency=self.trace.concurrency if concurrency is None else concurrency)
        except ForbiddenCallError as exc:
            return None, (INCORRECT, f"{what}: {exc}"[:500])
        except GenerationError as exc:
            return None, (RUNTIME_ERROR, f"{what}: {exc}"[:500])
        except EngineProcessError as exc:
            kind = {"timeout": TIMEOUT, "protocol": INCORRECT}.get(exc.kind, RUNTIME_ERROR)
            return None, (kind, f"{what}: {exc}"[:500])
        if result.late:
            return None, (TIMEOUT, _first(what, result.late))
        if result.violations:
            return None, (INCORRECT, _first(what, result.violations))
        return _Timed(result, serving_metrics(result.timelines, result.duration_s, self.slo)), None

    def _score(self, timed: list[_Timed], what: str) -> tuple[str, str] | None:
        for one in timed:
            problems = score(one.result, self.reference, self.tolerance, self.vocab, self.alternatives)
            if problems:
                return INCORRECT, _first(what, problems)
        return None

    def reference(self, prompt, tokens) -> np.ndarray:
        return self.workload.reference_logits(self.preset, prompt, tokens)

    def alternatives(self, prompt, tokens):
        """The reference's other readings of the same tokens (near-tied routings), asked when the first fails."""
        return self.workload.reference_alternatives(self.preset, prompt, tokens)

    def _median(self, timed: list[_Timed]) -> float:
        return float(np.median([objective_of(t.metrics, self.objective) for t in timed]))

    def _serving(self, timed: list[_Timed]) -> dict:
        """The metrics of the replay whose objective is the median one (one real replay, not a blend; of an even
        number, the slower of the middle two)."""
        ordered = sorted(timed, key=lambda t: objective_of(t.metrics, self.objective))
        middle = ordered[len(ordered) // 2]
        return {"objective": self.objective, "concurrency": self.trace.concurrency, "arrival": self.trace.arrival,
                "requests": len(self.requests), **middle.metrics.to_dict()}

    # ----------------------------------------------------------------- held engines (paired re-timing)
    def hold(self, process: EngineProcess, engine: dict, deadline: float) -> tuple[str | None, float]:
        """Launch, build and pass the check replay: (why it failed, or None; 0.0 — nothing to subtract)."""
        try:
            process.launch(preload=self.ev.preload)
        except EngineProcessError as exc:
            return f"{exc.kind}: {exc}", 0.0
        built, failed = self.ev.built(process, "held", time.perf_counter(), engine, contract="generation")
        if failed is not None:
            return f"{failed.status}: {failed.message}", 0.0
        problem = self.check(ConfinedGenerator(process), deadline)
        return (None if problem is None else f"{problem[0]}: {problem[1]}"), 0.0

    def timed_call(self, process: EngineProcess, where: str, deadline: float, null_ms: float = 0.0
                   ) -> tuple[float, str | None, tuple]:
        """One replay of the run's trace on fresh prompts: (the objective, a failure seen without the
        reference or None, what `verify` scores)."""
        prompts = self._prompts(np.random.default_rng(self.ev.next_seed()))
        one, problem = self._replay(ConfinedGenerator(process), self.requests, prompts, deadline, where)
        if problem:
            return math.nan, f"{problem[0]}: {problem[1]}", ()
        return objective_of(one.metrics, self.objective), None, (one, where)

    def figures(self, pending: tuple) -> dict[str, float]:
        """The replay's headline figures (`PAIRED_FIGURES`), paired in the final re-timing's records."""
        metrics = pending[0].metrics
        return {name: _figure(metrics, name) for name in PAIRED_FIGURES}

    def verify(self, pending: tuple) -> str | None:
        one, where = pending
        problem = self._score([one], where)
        return None if problem is None else f"{problem[0]}: {problem[1]}"
