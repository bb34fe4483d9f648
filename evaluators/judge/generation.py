"""The judge of a generation workload (`Workload.contract == "generation"`): an engine that takes
requests and returns tokens, judged as a client sees it.

One evaluation (the engine built in its own sandboxed process, as for a call engine):
1. a **check replay** that exercises the whole contract (`evaluators.judge.traffic.check_sends`): a burst of
   at least 2R + 2 requests with no cap, so the engine queues; the domain's edges; stop ids the reference
   hits and ids it need not; seeded sampled requests; 2R + 1 aborts mid-decode, each followed by a request
   that may take the freed row; requests arriving while others decode;
2. `replays` **timed replays** of the run's trace, drawn afresh for this evaluation (its lengths and arrival
   times; prompts fresh for each replay), a stop-id request, a sampled one and an aborted one mixed in at
   random places, each stamped on the judge's clock (`evaluators.judge.replay`);
3. every request of every replay scored against the float64 reference on its own tokens (on the CPU
   after the last timed replay, so the reference never evicts the engine's caches between them).
4. for a checkpoint with a tokenizer, a **real-text replay** (`_real_text`): every prefix of the Zen of Python a
   one-token request, its tokens scored like the others, giving next-token accuracy on real text.
Every token is judged under the run's accuracy contract (`evaluators.judge.accuracy`): held to the near-tie
rule (exact mode) or tallied and judged by the budget (budget mode); the result records the loss.
Everything the judge sends is drawn from the OS's randomness, and the engine sees request ids from its own
`evaluators.judge.request_ids.RequestIds` sequence: nothing marks the judge's traffic. A request the engine holds
that gets no token in (requests held when it was sent + 1) x (P + N) steps is a violation (the stall rule).
The result's latency is the run's objective (by default milliseconds per output token: the inverse
of output tokens/s) as the median over the timed replays; `serving` keeps the median replay's
metrics under `vllm bench serve`'s names. A TPOT objective is scored under the config's TTFT bound and
TTFT's under its TPOT bound (`evaluators.settings.OBJECTIVE_BOUNDS`): a timed replay past it is not
ranked. A median below the roofline floor is re-timed and, still below, `suspect`.

Paired re-timing (`evaluators.judge.paired`) uses the same pieces through `hold`, `timed_call` and `verify`:
one "call" is one whole replay; the k-th call of every held engine replays the k-th shape drawn since the
last `hold` (A and B of one round see the same trace and the same stop-id request, drawn with the reference
before the round's first call, which balanced orders give A and B alike; their other prompts and their ids
are their own).
"""
from __future__ import annotations

import math
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from evaluators.judge import accuracy
from evaluators.judge.replay import (ConfinedGenerator, ForbiddenCallError, GenerationError, Replay, Send, replay,
                                     score)
from evaluators.judge.request_ids import RequestIds
from evaluators.judge.traffic import TimedShape, check_sends, draw_timed, stop_case, timed_sends
from evaluators.sandbox.process import EngineProcess, EngineProcessError
from evaluators.settings import OBJECTIVE_BOUNDS
from evo.core.fidelity import FULL, SCREEN
from evo.core.genome import Genome
from evo.core.records import INCORRECT, OK, RUNTIME_ERROR, SUSPECT, TIMEOUT, EvalResult
from evo.core.stream_metrics import ServingMetrics, Slo, serving_metrics
from evo.core.trace import TraceSpec
from evo.workloads import sampling
from evo.workloads.generation import GenerationRequest
from evo.workloads.real_text import NAME as REAL_TEXT

OBJECTIVES = {
    "ms_per_output_token": "replay duration / output tokens, ms (1000 / output tokens/s)",
    "tpot_p99_ms": "p99 time per output token, ms (scored under slo.ttft_ms)",
    "tpot_median_ms": "median time per output token, ms (scored under slo.ttft_ms)",
    "ttft_p99_ms": "p99 time to first token, ms (scored under slo.tpot_ms)",
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
    """One replay awaiting its score: what the judge saw and the metrics it gives (its requests not aborted)."""

    result: Replay
    metrics: ServingMetrics


@dataclass
class _Held:
    """What the judge keeps per engine process: its request ids, whether it decodes greedily only (a baseline
    declared so), and how many timed calls it has had since its `hold`."""

    ids: RequestIds = field(default_factory=RequestIds)
    greedy_only: bool = False
    calls: int = 0
    steps_per_exchange: int = 1  # the genome's (`GenerationWorkload.exchange_steps`); a baseline's: 1

    def generator(self, process: EngineProcess) -> ConfinedGenerator:
        """The engine's process as the judge steps it: its genome's steps per exchange each time."""
        return ConfinedGenerator(process, steps_per_exchange=self.steps_per_exchange)


class GenerationJudge:
    """The generation contract's evaluation and held-engine pieces, for one `Evaluator` (its settings,
    sandbox, seeds, roofline and result records)."""

    def __init__(self, evaluator) -> None:  # an evaluators.judge.evaluator.Evaluator (which imports this module)
        self.ev = evaluator
        self.workload, self.preset, settings = evaluator.workload, evaluator.preset, evaluator.settings
        self.trace: TraceSpec = self.workload.trace(self.preset)
        self.objective = settings.objective
        if self.objective.startswith("tpot") and self.trace.output_len[1] < 2:
            raise ValueError(f"evaluator.objective {self.objective!r} needs requests of 2 or more tokens (a TPOT); the "
                             f"trace's outputs are {list(self.trace.output_len)} tokens")
        self.replays = settings.replays
        self.vocab = int(self.preset.shape["V"])
        self.tolerance = self.workload.tie_tolerance(self.preset)
        self.accuracy = accuracy.resolve(settings.accuracy, self.workload, self.preset)  # the accuracy contract
        self.slo = Slo(**settings.slo) if settings.slo else None  # goodput's bounds, if the config sets any
        self.stall_steps = int(self.preset.shape["P"]) + int(self.preset.shape["N"])  # the stall rule's unit
        self.held_metrics: ServingMetrics | None = None  # the check replay of the engine `hold` passed last
        self.checked_requests = 0  # requests of the last check replay
        self._checked_metrics: ServingMetrics | None = None
        self._held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # EngineProcess -> _Held
        # paired re-timing: each round's shape and stop-id request, since the last hold
        self._rounds: list[tuple[TimedShape, GenerationRequest | None]] = []

    # ----------------------------------------------------------------- one evaluation
    def judge(self, process: EngineProcess, genome_hash: str, start: float, engine: dict,
              screen: Mapping[str, int] | None = None) -> EvalResult:
        """One evaluation (see the module); with `screen` ({count, replays}) its timed replays are `replays` of a
        trace of `count` requests (at most the run's), the check replay whole: the result's fidelity "screen"."""
        ev = self.ev
        trace, replays, fidelity = self.trace, self.replays, FULL
        if screen is not None:
            trace = replace(self.trace, count=max(1, min(int(screen["count"]), self.trace.count)))
            replays, fidelity = int(screen["replays"]), SCREEN
        built, failed = ev.built(process, genome_hash, start, engine, contract="generation")
        if failed is not None:
            return replace(failed, fidelity=fidelity)
        stamp, deadline = {**built.stamp, "fidelity": fidelity}, built.deadline
        held = self._held_for(engine)
        generator = held.generator(process)  # each replay bounds it by the evaluation's deadline
        tally = self.tally()
        problem = self.check(generator, deadline, held.greedy_only, held.ids, tally)
        if problem:
            return ev.result(genome_hash, problem[0], start, message=problem[1], **stamp)
        shape = draw_timed(trace, self._rng())  # this evaluation's trace
        timed, problem = self._timed(generator, deadline, replays, shape, held, tally)
        if problem:
            return ev.result(genome_hash, problem[0], start, message=problem[1], **stamp)
        median = self._median(timed)
        note = (f"{sum(len(t.result.requests) for t in timed)} requests of {len(timed)} timed"
                f"{' screening' if fidelity == SCREEN else ''} replays and "
                f"{self.checked_requests} of a check replay, each scored on its own tokens")
        if ev.below_floor(median):
            first = median
            again, problem = self._timed(generator, deadline, replays, shape, held, tally)
            if problem:
                return ev.result(genome_hash, problem[0], start, message=f"re-verification: {problem[1]}", **stamp)
            timed, median = again, self._median(again)
            if ev.below_floor(median):
                return ev.result(genome_hash, SUSPECT, start, latency_ms=median, serving=self._serving(timed),
                                 accuracy=self.loss(tally),
                                 message=f"{self.objective} {median:.4g} (first {first:.4g}, re-timed on fresh prompts)"
                                         f" is below the roofline floor {ev.roofline_floor_ms():.4g}: never ranked",
                                 **stamp)
            note += f"; re-timed after a first {first:.4g} below the floor"
        quality, problem = self._real_text(generator, deadline, held, tally)
        if problem:
            return ev.result(genome_hash, problem[0], start, message=problem[1], **stamp)
        breach = self.breach(tally)
        if breach:
            return ev.result(genome_hash, INCORRECT, start, message=breach, accuracy=self.loss(tally, quality), **stamp)
        values = sorted(objective_of(t.metrics, self.objective) for t in timed)
        return ev.result(genome_hash, OK, start, latency_ms=median, latency_spread_ms=values[-1] - values[0],
                         serving=self._serving(timed), accuracy=self.loss(tally, quality), message=note, **stamp)

    def check(self, generator: ConfinedGenerator, deadline: float, greedy_only: bool = False,
              ids: RequestIds | None = None, tally: accuracy.Tally | None = None) -> tuple[str, str] | None:
        """The check replay (see the module): (status, message) of its first problem, or None. `greedy_only`: a
        baseline that decodes greedily only, sent greedy requests in place of sampled ones; `ids`: the engine's
        request ids (a fresh sequence if not given); `tally`: where its tokens' loss is marked (in budget mode
        the caller judges it; without one, the check replay's own tally is judged here)."""
        sends = check_sends(self.preset.shape, self._rng(), self.continuation, greedy_only)
        self.checked_requests, self._checked_metrics = len(sends), None
        timed, problem = self._replay(generator, sends, deadline, "the check replay", 0, ids or RequestIds())
        own = tally is None
        tally = self.tally() if own else tally
        problem = problem or self._score([timed], "the check replay", tally)
        breach = self.breach(tally) if problem is None and own else ""
        if breach:
            problem = INCORRECT, f"the check replay: {breach}"
        if problem is None:
            self._checked_metrics = timed.metrics
        return problem

    def continuation(self, request: GenerationRequest, k: int) -> list[int]:
        """The reference's first `k` tokens for `request` by its rule (greedy, or its seeded draw): where the
        check replay's stop ids come from."""
        made: list[int] = []
        for index in range(k):
            row = self.reference(request.prompt, [*made, 0])[-1]  # the last row predicts the next token
            made.append(sampling.choose(row, request.temperature, request.top_p, request.seed, index))
        return made

    def _timed(self, generator: ConfinedGenerator, deadline: float, replays: int, shape: TimedShape, held: _Held,
               tally: accuracy.Tally) -> tuple[list[_Timed], tuple[str, str] | None]:
        """`replays` replays of `shape` on fresh prompts, then every request scored. Their stop-id requests are
        drawn first: the reference never runs between timed replays."""
        stops = [stop_case(shape, self._rng(), self.vocab, self.continuation) for _ in range(replays)]
        timed = []
        for i, stop in enumerate(stops):
            one, problem = self._timed_replay(generator, shape, stop, held, deadline, f"timed replay {i + 1}")
            if problem:
                return timed, problem
            timed.append(one)
        return timed, self._score(timed, "a timed replay", tally)

    def _timed_replay(self, generator: ConfinedGenerator, shape: TimedShape, stop: GenerationRequest | None,
                      held: _Held, deadline: float, what: str) -> tuple[_Timed | None, tuple[str, str] | None]:
        """One replay of `shape` on fresh prompts (`stop` in its place); a failure seen without the reference (a
        breach, a stall, a timeout, the objective's bound broken)."""
        sends = timed_sends(shape, self._rng(), self.vocab, stop, held.greedy_only)
        one, problem = self._replay(generator, sends, deadline, what, self.trace.concurrency, held.ids)
        return one, problem or self._bound(one.metrics, what)  # one is None only with a problem

    def _replay(self, generator: ConfinedGenerator, sends: list[Send], deadline: float, what: str, concurrency: int,
                ids: RequestIds) -> tuple[_Timed | None, tuple[str, str] | None]:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return None, (TIMEOUT, f"the evaluation ran out of time before {what}")
        generator.deadline = deadline
        try:
            result = replay(generator, sends, deadline_s=remaining, concurrency=concurrency,
                            stall_steps=self.stall_steps, ids=ids)
        except ForbiddenCallError as exc:
            return None, (INCORRECT, f"{what}: {exc}"[:500])
        except GenerationError as exc:
            return None, (RUNTIME_ERROR, f"{what}: {exc}"[:500])
        except EngineProcessError as exc:
            kind = {"timeout": TIMEOUT, "protocol": INCORRECT}.get(exc.kind, RUNTIME_ERROR)
            return None, (kind, f"{what}: {exc}"[:500])
        if result.violations:  # a breach or a stall stops the replay: it outranks lateness
            return None, (INCORRECT, _first(what, result.violations))
        if result.late:
            return None, (TIMEOUT, _first(what, result.late))
        return _Timed(result, serving_metrics(result.served(), result.duration_s, self.slo)), None

    def _bound(self, metrics: ServingMetrics, what: str) -> tuple[str, str] | None:
        """A TPOT objective is scored under the TTFT bound (an engine that held its first token until its last
        would have no TPOT) and TTFT under the TPOT bound: a replay past it is not ranked (see the module)."""
        bound = OBJECTIVE_BOUNDS.get(self.objective)
        if bound is None:
            return None
        seen, limit = getattr(metrics, bound)["p99"], float(getattr(self.slo, bound))  # the SLO key names the figure
        if seen > limit:  # a TPOT of nan (only one-token requests) holds nothing back
            return INCORRECT, (f"{what}: objective {self.objective} is scored under slo.{bound}: {bound[:4].upper()} "
                               f"p99 {seen:.4g} ms over {limit:g}: not ranked")
        return None

    def _score(self, timed: list[_Timed], what: str, tally: accuracy.Tally) -> tuple[str, str] | None:
        for one in timed:
            problems = score(one.result, self.reference, self.rule_tolerance, self.vocab, self.alternatives, tally)
            if problems:
                return INCORRECT, _first(what, problems)
        return None

    # ----------------------------------------------------------------- the accuracy contract
    @property
    def rule_tolerance(self) -> float | None:
        """The near-tie tolerance every token is held to (exact mode), None in budget mode (the budget judges)."""
        return None if self.accuracy.budget is not None else self.tolerance

    def tally(self) -> accuracy.Tally:
        """An empty tally of tokens' loss, in the contract's near-tie window."""
        return accuracy.Tally(self.accuracy.window(self.tolerance))

    def breach(self, tally: accuracy.Tally) -> str:
        """Why the tallied tokens break the budget ("" in exact mode: there every token was held to the rule)."""
        budget = self.accuracy.budget
        if budget is not None and budget.recheck:  # a calibrated max_gap: its steps past it rechecked first
            self._recheck(tally, budget)
        why = budget.breach(tally) if budget is not None else ""
        return f"the accuracy budget: {why}" if why else ""

    def _recheck(self, tally: accuracy.Tally, budget: accuracy.Budget) -> None:
        """The steps past the calibrated largest gap, each held to what an honest execution of its own context
        allows (`accuracy.recheck`): the reference's row and the workload's honest execution of that context (a
        budget rechecks only where its calibration ran that honest execution)."""
        accuracy.recheck(tally, budget, lambda prompt, context: self.reference(prompt, context)[-1],
                         lambda prompt, context: self.workload.honest_logits(self.preset, prompt, context,
                                                                             budget.recheck)[-1])

    def loss(self, tally: accuracy.Tally, real_text: dict | None = None) -> dict:
        """What a result records of its accuracy: the contract (mode, budget), the tally's figures and, for a
        checkpoint with a tokenizer, its quality on real text (`_real_text`)."""
        return {**self.accuracy.to_dict(), **tally.figures().to_dict(), **({"real_text": real_text} if real_text else {})}

    def _real_text(self, generator: ConfinedGenerator, deadline: float, held: _Held, tally: accuracy.Tally
                   ) -> tuple[dict, tuple[str, str] | None]:
        """Quality on real text (a checkpoint with a tokenizer; {} otherwise): for every prefix of the Zen of Python
        up to P tokens, a greedy one-token request, in a closed loop of R clients. Its tokens are scored like
        any other (and tallied); against the text's own next token they give the engine's next-token accuracy,
        beside the float64 reference's and its perplexity of the text, from one teacher-forced pass."""
        ids = self.workload.real_text(self.preset)
        n = min(len(ids or ()) - 1, int(self.preset.shape["P"]))
        if n < 1 or max(ids[:n + 1]) >= self.vocab:
            return {}, None
        sends = [Send(GenerationRequest(i, tuple(ids[:i]), 1), None) for i in range(1, n + 1)]
        one, problem = self._replay(generator, sends, deadline, "the real-text replay", self.trace.concurrency,
                                    held.ids)
        if problem:
            return {}, problem
        rows = self.reference(ids[:1], ids[1:n + 1])  # row i - 1 predicts ids[i] from ids[:i]: every request's row
        problems = score(one.result, lambda prompt, tokens: rows[len(prompt) - 1:len(prompt)], self.rule_tolerance,
                         self.vocab, self.alternatives, tally)
        if problems:
            return {}, (INCORRECT, _first("the real-text replay", problems))
        truth, picks = np.array(ids[1:n + 1]), rows.argmax(axis=1)
        made = np.array([tokens[0] for tokens in one.result.tokens])
        top = rows.max(axis=1, keepdims=True)
        logp = rows[np.arange(n), truth] - (top[:, 0] + np.log(np.exp(rows - top).sum(axis=1)))
        return {"text": REAL_TEXT, "positions": n, "engine_top1": float((made == truth).mean()),
                "reference_top1": float((picks == truth).mean()), "agreement": float((made == picks).mean()),
                "reference_perplexity": float(np.exp(-logp.mean()))}, None

    def reference(self, prompt, tokens) -> np.ndarray:
        return self.workload.reference_logits(self.preset, prompt, tokens)

    def alternatives(self, prompt, tokens):
        """The reference's other readings of the same tokens (near-tied routings), asked when the first fails."""
        return self.workload.reference_alternatives(self.preset, prompt, tokens)

    def _rng(self) -> np.random.Generator:
        """A generator seeded from the OS's randomness (never the run's seed nor the trace's)."""
        return np.random.default_rng(self.ev.next_seed())

    def _held_for(self, engine: dict) -> _Held:
        """A fresh `_Held` for `engine`: greedy-only if a baseline declared so; a genome's steps per exchange."""
        steps, exchange = 1, getattr(self.workload, "exchange_steps", None)
        if "genome_json" in engine and exchange is not None:
            steps = exchange(Genome.from_json(engine["genome_json"]))
        return _Held(greedy_only=self.greedy_only(engine), steps_per_exchange=steps)

    def greedy_only(self, engine: dict) -> bool:
        """Whether `engine` is a baseline its workload declares greedy-only (candidates never are)."""
        name = engine.get("baseline")
        return name is not None and name in self.workload.greedy_baselines(self.preset)

    def _median(self, timed: list[_Timed]) -> float:
        return float(np.median([objective_of(t.metrics, self.objective) for t in timed]))

    def _serving(self, timed: list[_Timed]) -> dict:
        """The metrics of the replay whose objective is the median one (one real replay, not a blend; of an even
        number, the slower of the middle two)."""
        ordered = sorted(timed, key=lambda t: objective_of(t.metrics, self.objective))
        middle = ordered[len(ordered) // 2]
        return {"objective": self.objective, "concurrency": self.trace.concurrency, "arrival": self.trace.arrival,
                "requests": len(middle.result.served()), **middle.metrics.to_dict()}

    # ----------------------------------------------------------------- held engines (paired re-timing)
    def hold(self, process: EngineProcess, engine: dict, deadline: float) -> tuple[str | None, float]:
        """Launch, build and pass the check replay: (why it failed, or None; 0.0 — nothing to subtract). After a
        pass, `held_metrics` are the check replay's figures. A hold starts a new set of paired rounds."""
        try:
            process.launch(preload=self.ev.preload)
        except EngineProcessError as exc:
            return f"{exc.kind}: {exc}", 0.0
        built, failed = self.ev.built(process, "held", time.perf_counter(), engine, contract="generation")
        if failed is not None:
            return f"{failed.status}: {failed.message}", 0.0
        held = self._held[process] = self._held_for(engine)
        self._rounds = []
        problem = self.check(held.generator(process), deadline, held.greedy_only, held.ids)  # its own budget
        if problem is not None:
            return f"{problem[0]}: {problem[1]}", 0.0
        self.held_metrics = self._checked_metrics
        return None, 0.0

    def exchange_steps(self, process: EngineProcess) -> int:
        """The steps per exchange of a held engine's genome (1 for a baseline): whoever steps it next asks that many."""
        return self._held.setdefault(process, _Held()).steps_per_exchange

    def request_ids(self, process: EngineProcess) -> RequestIds:
        """The request ids of a held engine's process: whoever sends it requests next continues its sequence."""
        return self._held.setdefault(process, _Held()).ids

    def timed_call(self, process: EngineProcess, where: str, deadline: float, null_ms: float = 0.0
                   ) -> tuple[float, str | None, tuple]:
        """One replay on fresh prompts: (the objective, a failure seen without the reference or None, what
        `verify` scores). The k-th call of each held engine replays the k-th shape since the last `hold`."""
        held = self._held.setdefault(process, _Held())
        while len(self._rounds) <= held.calls:  # a round's first call draws it (its stop-id request too)
            shape = draw_timed(self.trace, self._rng())
            self._rounds.append((shape, stop_case(shape, self._rng(), self.vocab, self.continuation)))
        (shape, stop), held.calls = self._rounds[held.calls], held.calls + 1
        one, problem = self._timed_replay(held.generator(process), shape, stop, held, deadline, where)
        if problem:
            return math.nan, f"{problem[0]}: {problem[1]}", ()
        return objective_of(one.metrics, self.objective), None, (one, where)

    def figures(self, pending: tuple) -> dict[str, float]:
        """The replay's headline figures (`PAIRED_FIGURES`), paired in the final re-timing's records."""
        metrics = pending[0].metrics
        return {name: _figure(metrics, name) for name in PAIRED_FIGURES}

    def verify(self, pending: tuple) -> str | None:
        one, where = pending
        tally = self.tally()
        problem = self._score([one], where, tally)
        breach = self.breach(tally) if problem is None else ""
        if breach:
            problem = INCORRECT, f"{where}: {breach}"
        return None if problem is None else f"{problem[0]}: {problem[1]}"
