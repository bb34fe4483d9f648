"""A generation engine kept open for Serve, in the confined process the judge evaluates engines in, with
one engine loop that serves every caller (continuous batching across requests).

Like `evaluators.served.ServedEngine` for call engines, the replica is a client of its engine: an
`Evaluator` launches the engine's process (jail, seccomp, cgroups, the allow-list view), builds the
engine there and passes it through the judge's check replay (`GenerationJudge.hold`). Then one thread,
the loop, owns the engine's channel: it hands the engine every request submitted since its last step,
steps while anything is in flight, and routes each token to its request's `Stream` as it arrives. A
request's bounds are the verified domain's (prompt length, new tokens, vocabulary), checked before it
reaches the engine; a full queue refuses a request at once (`Overloaded`) rather than holding it in
memory. A cancelled request (its client went away) is aborted in the engine before its next step: it gets
no more tokens and its slot frees for the next request. A finished request can be re-scored against the
float64 reference later (`rescore`), off the request path.
"""
from __future__ import annotations

import itertools
import queue
import secrets
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import numpy as np

from evaluators.evaluator import Evaluator
from evaluators.replay import ConfinedGenerator, GenerationError, request_problems
from evaluators.sandbox import EngineProcess, EngineProcessError
from evaluators.settings import EvaluatorSettings
from evo.workloads.generation import GenerationRequest

STEP_TIMEOUT_S = 120.0  # one step of the engine; past it the engine process is killed
# the sampling check's requests: (temperature, top_p) each, seeded afresh; an engine that passes serves them
SAMPLING_CHECK = ((1.0, 1.0), (0.7, 0.9), (1.5, 0.5), (0.3, 0.95))
DONE = None  # what a stream yields after its last token


class ServedGeneratorError(RuntimeError):
    """The engine failed its check, a step, or died: it serves nothing more."""


class Overloaded(RuntimeError):
    """The engine's queue is full: try again later (HTTP 429/503 with Retry-After)."""


class RequestError(ValueError):
    """A request outside the verified domain; the message names the field and what is allowed."""


@dataclass(frozen=True)
class Token:
    """One token of a stream, with the time the replica received it (seconds, perf_counter)."""

    token: int
    at_s: float
    finished: bool


class Stream:
    """One request's tokens as the loop receives them: iterate (blocking) until the last, or have each item
    handed to `sink` (a Token, an Exception, then DONE) from the loop's thread; `cancel` when the client goes away."""

    def __init__(self, request: GenerationRequest, sink: Callable[[object], None] | None = None) -> None:
        self.request = request
        self.tokens: queue.Queue[Token | Exception | None] = queue.Queue()
        if sink is not None:
            self.tokens.put = sink  # type: ignore[method-assign] - the loop only ever puts
        self.cancelled = threading.Event()
        self.made = 0  # tokens the loop received for it

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self):
        while True:
            item = self.tokens.get()
            if item is DONE:
                return
            if isinstance(item, Exception):
                raise item
            yield item


class ServedGenerator:
    """One checked generation engine in its own confined process and the loop that serves it."""

    def __init__(self, workload: str, preset: str, genome_json: str, sources: Mapping[str, str] | None = None,
                 settings: EvaluatorSettings | None = None, max_waiting: int = 256) -> None:
        self.judge = Evaluator(workload, preset, settings or EvaluatorSettings(), seed=secrets.randbits(31),
                               name="serve")
        if self.judge.generation is None:
            self.judge.close()
            raise ValueError(f"workload {workload!r} takes calls, not requests: serve it with ServedEngine")
        shape = self.judge.preset.shape
        self.max_prompt, self.max_tokens, self.vocab = int(shape["P"]), int(shape["N"]), int(shape["V"])
        self.max_waiting = max_waiting
        self.label, spec = self.judge.resolve(genome_json, sources)
        self._inbox: queue.Queue[Stream] = queue.Queue()
        self._ids = itertools.count()
        self._open: dict[int, Stream] = {}
        self._unfinished: list[int] = []  # ended here, not marked finished by the engine: to abort there
        self.stats = {"requests": 0, "tokens": 0, "aborted": 0, "refused_busy": 0}
        self.ignored = 0  # tokens the engine sent for no open request (the judge's replays count them as breaches)
        self._stop = threading.Event()
        self._draining = False
        self._lock = threading.Lock()
        self._failure: Exception | None = None
        self._process: EngineProcess | None = self.judge.engine_process(guarded=bool(spec.get("guarded")))
        try:
            self._check(spec)
        except BaseException:
            self.close()
            raise
        self._loop = threading.Thread(target=self._serve, name=f"engine-loop {self.label[:8]}", daemon=True)
        self._loop.start()

    def _check(self, spec: dict) -> None:
        settings = self.judge.settings
        deadline = time.perf_counter() + settings.build_timeout_s + settings.eval_timeout_s
        problem, _ = self.judge.hold(self._process, spec, deadline)
        if problem is not None:
            raise ServedGeneratorError(f"engine {self.label} failed its check replay in the sandbox: {problem}")
        try:
            self.sampling_check = self._check_sampling(time.perf_counter() + settings.eval_timeout_s)
        except (GenerationError, EngineProcessError) as exc:  # incl. a forbidden call: the engine serves nothing
            raise ServedGeneratorError(f"engine {self.label} failed its serving check in the sandbox: {exc}") from exc
        self.sampling = self.sampling_check == ""

    def _check_sampling(self, deadline: float) -> str:
        """Sampled requests (SAMPLING_CHECK) through the engine, scored by the judge's seeded rule, beside a greedy
        one aborted after its first token (every disconnect is an abort): "" when every sampled token is the draw,
        else why (the engine then serves greedy requests only). An abort that fails, a token after the abort or
        a wrong greedy token raise GenerationError: such an engine serves nothing."""
        rng = np.random.default_rng()

        def prompt() -> tuple[int, ...]:
            return tuple(rng.integers(0, self.vocab, int(rng.integers(1, self.max_prompt + 1))).tolist())

        n = min(self.max_tokens, 8)
        requests = [GenerationRequest(-1 - i, prompt(), n, (), t, p, int(rng.integers(0, 2 ** 62)))
                    for i, (t, p) in enumerate(SAMPLING_CHECK)]
        aborted = GenerationRequest(-1 - len(requests), prompt(), self.max_tokens)
        generator = ConfinedGenerator(self._process)
        generator.deadline = deadline
        made: dict[int, list[int]] = {r.id: [] for r in (*requests, aborted)}
        ended: set[int] = set()
        for request in (*requests, aborted):
            generator.add(request)
        while len(ended) < len(made):
            if time.perf_counter() > deadline:
                raise GenerationError("the serving check ran out of time")
            for event in generator.step():
                if event.request_id not in made or event.request_id in ended:
                    raise GenerationError(f"request {event.request_id}: a token it was not owed in the serving check"
                                          f"{' (after its abort)' if event.request_id == aborted.id else ''}")
                made[event.request_id].append(event.token)
                if event.finished:
                    ended.add(event.request_id)
                elif event.request_id == aborted.id:
                    generator.abort(aborted.id)
                    ended.add(aborted.id)
        problem, _ = self.rescore(replace(aborted, max_tokens=len(made[aborted.id])), made[aborted.id])
        if problem:
            raise GenerationError(f"the serving check: {problem}")
        for request in requests:
            problem, _ = self.rescore(request, made[request.id])
            if problem:
                return f"the sampling check (temperature {request.temperature:g}, top_p {request.top_p:g}): {problem}"
        return ""

    # ------------------------------------------------------------------ callers (any thread)
    def submit(self, prompt: Sequence[int], max_tokens: int, stop_ids: Sequence[int] = (),
               sink: Callable[[object], None] | None = None, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0) -> Stream:
        """A request's stream; RequestError naming the field outside the verified domain, Overloaded when
        the queue is full, ServedGeneratorError when the engine serves no more."""
        if self._failure is not None or self._stop.is_set() or self._draining:
            raise ServedGeneratorError(f"engine {self.label} serves no more: {self._failure or 'closed'}")
        prompt, stop_ids = self._checked(prompt, max_tokens, stop_ids)
        if (temperature != 0 or top_p != 1) and not self.sampling:
            raise RequestError(f"temperature: this engine is verified for greedy decoding only (temperature 0, top_p "
                               f"1): {self.sampling_check}")
        if self._inbox.qsize() + len(self._open) >= self.max_waiting:
            self.stats["refused_busy"] += 1
            raise Overloaded(f"{self.max_waiting} requests are queued or running; try again shortly")
        try:
            request = GenerationRequest(next(self._ids), prompt, int(max_tokens), stop_ids, float(temperature),
                                        float(top_p), int(seed))
        except ValueError as exc:
            raise RequestError(f"temperature, top_p: {exc}") from None
        stream = Stream(request, sink)
        with self._lock:  # _fail drains the inbox under the same lock: no stream is left without an answer
            if self._failure is not None or self._stop.is_set():
                raise ServedGeneratorError(f"engine {self.label} serves no more: {self._failure or 'closed'}")
            self._inbox.put(stream)
        return stream

    def _checked(self, prompt: Sequence[int], max_tokens: int,
                 stop_ids: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if not isinstance(prompt, (list, tuple)) or not 1 <= len(prompt) <= self.max_prompt:
            raise RequestError(f"prompt: 1 to {self.max_prompt} token ids (the verified prompt length), got "
                               f"{len(prompt) if isinstance(prompt, (list, tuple)) else type(prompt).__name__}")
        for field, ids in (("prompt", prompt), ("stop", stop_ids)):
            bad = next((t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab)),
                       None)
            if bad is not None:
                raise RequestError(f"{field}: token ids are integers in [0, {self.vocab - 1}], got {bad!r}")
        if not (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and 1 <= max_tokens <= self.max_tokens):
            raise RequestError(f"max_tokens: 1 to {self.max_tokens} (the verified output length), got {max_tokens!r}")
        return tuple(prompt), tuple(stop_ids)

    # ------------------------------------------------------------------ the loop (its own thread)
    def _serve(self) -> None:
        generator = ConfinedGenerator(self._process, timeout_s=STEP_TIMEOUT_S)
        try:
            while not self._stop.is_set():
                if not self._open:  # idle: wait for a request instead of stepping
                    try:
                        self._admit(generator, self._inbox.get(timeout=0.1))
                    except queue.Empty:
                        continue
                while True:  # everything submitted meanwhile joins the next step
                    try:
                        self._admit(generator, self._inbox.get_nowait())
                    except queue.Empty:
                        break
                self._abort_cancelled(generator)
                if not self._open:
                    continue
                generator.deadline = time.perf_counter() + STEP_TIMEOUT_S
                self._route(generator.step())
        except (GenerationError, EngineProcessError) as exc:
            self._fail(ServedGeneratorError(f"engine {self.label}: {exc}"))
        except BaseException as exc:  # noqa: BLE001 - every waiting caller hears why
            self._fail(ServedGeneratorError(f"engine loop of {self.label}: {type(exc).__name__}: {exc}"))

    def _admit(self, generator: ConfinedGenerator, stream: Stream) -> None:
        if stream.cancelled.is_set():  # gone before it reached the engine
            stream.tokens.put(DONE)
            return
        generator.deadline = time.perf_counter() + STEP_TIMEOUT_S
        generator.add(stream.request)
        self._open[stream.request.id] = stream
        self.stats["requests"] += 1

    def _abort_cancelled(self, generator: ConfinedGenerator) -> None:
        """Requests whose clients went away leave the engine (their slots free) before the next step, as do
        requests the engine ran to their end without marking it."""
        while self._unfinished:
            generator.deadline = time.perf_counter() + STEP_TIMEOUT_S
            generator.abort(self._unfinished.pop())
        for rid in [rid for rid, stream in self._open.items() if stream.cancelled.is_set()]:
            generator.deadline = time.perf_counter() + STEP_TIMEOUT_S
            generator.abort(rid)
            self._open.pop(rid).tokens.put(DONE)
            self.stats["aborted"] += 1

    def _route(self, events) -> None:
        now = time.perf_counter()
        for event in events:
            stream = self._open.get(event.request_id)
            if stream is None:  # past a request's end (e.g. a stop id the engine did not mark): no client gets it
                self.ignored += 1
                continue
            if not 0 <= event.token < self.vocab:
                raise GenerationError(f"request {event.request_id}: token {event.token} outside the vocabulary "
                                      f"[0, {self.vocab - 1}]")
            stream.made += 1
            last = event.finished or event.token in stream.request.stop_ids or stream.made >= stream.request.max_tokens
            self.stats["tokens"] += 1
            if not stream.cancelled.is_set():
                stream.tokens.put(Token(int(event.token), now, last))
            if last:
                stream.tokens.put(DONE)
                del self._open[event.request_id]
                if not event.finished:  # the engine would go on: its last token was not marked; it leaves now
                    self._unfinished.append(event.request_id)

    def _fail(self, error: Exception) -> None:
        with self._lock:
            self._failure = error
            waiting = list(self._open.values())
            self._open.clear()
            while True:
                try:
                    waiting.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
        for stream in waiting:
            try:
                stream.tokens.put(error)
            except Exception:  # noqa: BLE001 - a caller's sink that is gone (its event loop closed)
                pass

    def rescore(self, request: GenerationRequest, tokens: Sequence[int]) -> tuple[str, float]:
        """A finished request's tokens against the float64 reference (the judge's rule, near ties allowed):
        (the first problem or "", 0.0)."""
        judge = self.judge.generation
        problems = request_problems(request, tokens, judge.reference, judge.tolerance, self.vocab,
                                    judge.alternatives)
        return (problems[0] if problems else ""), 0.0

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> int:
        """Requests the engine holds now (queued in it or decoding)."""
        return len(self._open)

    def close(self, drain_s: float = 0.0) -> None:
        """Refuse new requests, let those in flight finish (at most `drain_s`: a hot swap's old engine), then stop
        the loop, tell callers still waiting, kill the whole candidate."""
        self._draining = True
        deadline = time.perf_counter() + drain_s
        while (self._open or not self._inbox.empty()) and self._failure is None and time.perf_counter() < deadline:
            time.sleep(0.05)
        self._stop.set()
        loop = getattr(self, "_loop", None)
        if loop is not None and loop is not threading.current_thread():
            loop.join(timeout=STEP_TIMEOUT_S)
        if self._failure is None:
            self._fail(ServedGeneratorError(f"engine {self.label} closed"))
        if self._process is not None:
            self._process.close()
            self._process = None
        self.judge.close()
