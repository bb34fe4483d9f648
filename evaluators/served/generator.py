"""A generation engine kept open for Serve, in the confined process the judge evaluates engines in, with
one engine loop that serves every caller (continuous batching across requests), and every token it hands
out accounted for.

Like `evaluators.served.engine.ServedEngine` for call engines, the replica is a client of its engine: an
`Evaluator` launches the engine's process (jail, seccomp, cgroups, the allow-list view), builds the
engine there and passes it through the judge's check replay (`GenerationJudge.hold`: the whole contract,
seeded sampling and aborts included), whose figures (`held_metrics`: its E2E p99 and ITL median) scale the
guards below. Then one thread, the loop, owns the engine's channel: it hands the engine every request
submitted since its last step, steps while anything is in flight, and routes each token to its request's
`Stream`. A request's bounds are the verified domain's,
checked before it reaches the engine; a full queue refuses a request at once (`Overloaded`). A cancelled
request (its client went away) is aborted in the engine before its next step. Every id, a user's or the
replica's own, continues the sequence the judge's check drew from (`evaluators.judge.request_ids`).

What the replica holds the engine to while it serves (`evaluators.served.guards.ServePolicy`, docs/serving.md):
- **guards**, on every token before it is released: it belongs to a request the engine holds, lies in the
  vocabulary, ends its request exactly at max_tokens or a stop id and is marked finished then; and every
  held request progresses within the stall bound (the watch thread, which also catches a loop blocked in a
  step or an engine that answers empty steps forever). A breach fails the engine at once: every waiting
  caller gets `ServedGeneratorError`, and `on_failure` tells the replica (which takes it out of service);
- **speed**: served token gaps against the judged ITL (reported, or with `slow_action: remove` a failure);
- **canaries**: requests of the replica's own, drawn like users' (`evaluators.served.canaries`), verified whole;
- **`verify: all`**: each request's tokens released only in chunks the verifier (`evaluators.served.verifier`)
  has checked against the float64 reference; under `sampled`, the replica re-scores a sample after the answer;
- **the accuracy contract** its run declared (`evaluators.served.estimate`): in exact mode each checked token obeys
  the rule; in budget mode every check above marks a running estimate, and a budget it breaks fails the engine as
  a failed check does.
"""
from __future__ import annotations

import logging
import os
import queue
import secrets
import signal
import threading
import time
from dataclasses import asdict
from typing import Any, Callable, Mapping, Sequence

from evaluators.judge.evaluator import Evaluator
from evaluators.judge.replay import ConfinedGenerator, GenerationError, prefix_problem, request_problems
from evaluators.sandbox.process import EngineProcess, EngineProcessError
from evaluators.served.canaries import Canaries
from evaluators.served.estimate import RunningEstimate
from evaluators.served.guards import Judged, ServePolicy, SpeedWatch, breach, stall_deadline
from evaluators.served.stream import DONE, Stream, Token
from evaluators.served.verifier import Verifier
from evaluators.settings import EvaluatorSettings
from evo.workloads.generation import GenerationRequest

__all__ = ["DONE", "Overloaded", "RequestError", "ServedGenerator", "ServedGeneratorError", "Stream", "Token"]

logger = logging.getLogger("ray.serve")

STEP_TIMEOUT_S = 120.0  # one step of the engine; past it the engine process is killed
WATCH_TICK_S = 0.1  # how often the watch thread looks for stalls and slowness


class ServedGeneratorError(RuntimeError):
    """The engine failed its check, a guard, a verification, a step, or died: it serves nothing more."""


class Overloaded(RuntimeError):
    """The engine's queue is full: try again later (HTTP 429/503 with Retry-After)."""


class RequestError(ValueError):
    """A request outside the verified domain; the message names the field and what is allowed."""


class GuardBreach(GenerationError):
    """A token or a request's progress broke the serving contract (`evaluators.served.guards`)."""


def _nowhere(item: object) -> None:
    """A canary's client: nobody."""


class ServedGenerator:
    """One checked generation engine in its own confined process and the loop that serves it."""

    def __init__(self, workload: str, preset: str, genome_json: str, sources: Mapping[str, str] | None = None,
                 settings: EvaluatorSettings | None = None, max_waiting: int = 256,
                 policy: ServePolicy | None = None) -> None:
        self.judge = Evaluator(workload, preset, settings or EvaluatorSettings(), seed=secrets.randbits(31),
                               name="serve")
        if self.judge.generation is None:
            self.judge.close()
            raise ValueError(f"workload {workload!r} takes calls, not requests: serve it with ServedEngine")
        shape = self.judge.preset.shape
        self.max_prompt, self.max_tokens, self.vocab = int(shape["P"]), int(shape["N"]), int(shape["V"])
        self.max_waiting = max_waiting
        self.label, spec = self.judge.resolve(genome_json, sources)
        self.on_failure: Callable[[str], None] | None = None  # the replica, told once when the engine fails
        self.canaries = Canaries(self.vocab, self.max_prompt, self.max_tokens)
        self.speed = SpeedWatch()
        self.stats = {"requests": 0, "tokens": 0, "aborted": 0, "refused_busy": 0, "canaries": 0}
        self._policy = policy or ServePolicy()
        self._inbox: queue.Queue[Stream] = queue.Queue()
        self._open: dict[int, Stream] = {}  # requests the engine holds
        self._verifying: dict[int, Stream] = {}  # `verify: all` requests the engine ended, not all released yet
        self._held_users = 0  # user requests queued here or held by the engine: what max_waiting bounds
        self._stop = threading.Event()
        self._draining = False
        self._lock = threading.RLock()
        self._failure: Exception | None = None
        self._verifier: Verifier | None = None
        self._process: EngineProcess | None = self.judge.engine_process(guarded=bool(spec.get("guarded")))
        try:
            self._check(spec)
        except BaseException:
            self.close()
            raise
        self._verifier = Verifier(self._prefix_problem, lambda r, t: self.rescore(r, t)[0], self._verify_failed,
                                  self._retire, name=f"verifier {self.label[:8]}")
        self._verifier.chunk = self._policy.verify_chunk
        self._loop = threading.Thread(target=self._serve, name=f"engine-loop {self.label[:8]}", daemon=True)
        self._watch = threading.Thread(target=self._watching, name=f"engine-watch {self.label[:8]}", daemon=True)
        self._loop.start()
        self._watch.start()

    def _check(self, spec: dict) -> None:
        settings = self.judge.settings
        deadline = time.perf_counter() + settings.build_timeout_s + settings.eval_timeout_s
        problem, _ = self.judge.hold(self._process, spec, deadline)
        if problem is not None:
            raise ServedGeneratorError(f"engine {self.label} failed its check replay in the sandbox: {problem}")
        judge = self.judge.generation
        if judge.held_metrics is None:
            raise ServedGeneratorError(f"engine {self.label}: the judge's check replay handed back no figures to "
                                       f"scale the serving guards by")
        self.judged = Judged.of(judge.held_metrics, int(self.judge.preset.shape["R"]), "the judge's check replay")
        self.ids = judge.request_ids(self._process)  # users' and canaries' ids continue the check's sequence
        self.exchange_steps = judge.exchange_steps(self._process)  # as the judge checked it
        self.estimate = RunningEstimate(judge)  # the accuracy contract over what the replica checks while it serves
        # the check replay covers seeded sampling, except for a baseline its workload declares greedy-only
        greedy = judge.greedy_only(spec)
        self.sampling_check = "a baseline that decodes greedily only (checked on greedy requests)" if greedy else ""
        self.sampling = not greedy

    # ------------------------------------------------------------------ the policy (live: a reconfigure sets it)
    @property
    def policy(self) -> ServePolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: ServePolicy) -> None:
        self._policy = policy  # a request keeps the verify mode it was submitted under
        if self._verifier is not None:
            self._verifier.chunk = policy.verify_chunk

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
        if self._held_users >= self.max_waiting:
            self.stats["refused_busy"] += 1
            raise Overloaded(f"{self.max_waiting} requests are queued or running; try again shortly")
        policy = self._policy
        ids = [self.ids.next()]
        canary = self.canaries.due(policy.canary_every)
        if canary:
            ids.append(self.ids.next())
            secrets.SystemRandom().shuffle(ids)  # the canary's id is not always the later one
        try:
            request = GenerationRequest(ids[0], prompt, int(max_tokens), stop_ids, float(temperature), float(top_p),
                                        int(seed))
        except ValueError as exc:
            raise RequestError(f"temperature, top_p: {exc}") from None
        stream = Stream(request, sink, verified=policy.verify == "all")
        self.canaries.remember(request)
        streams = [stream]
        if canary:
            streams.append(Stream(self.canaries.draw(ids[1]), _nowhere, canary=True))
        streams.sort(key=lambda s: s.request.id)
        with self._lock:  # _fail drains the inbox under the same lock: no stream is left without an answer
            if self._failure is not None or self._stop.is_set():
                raise ServedGeneratorError(f"engine {self.label} serves no more: {self._failure or 'closed'}")
            self._held_users += 1
            for one in streams:
                self._inbox.put(one)
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
        generator = ConfinedGenerator(self._process, timeout_s=STEP_TIMEOUT_S, steps_per_exchange=self.exchange_steps)
        try:
            while not self._stop.is_set() and self._failure is None:
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
        except GuardBreach as exc:
            self._fail(ServedGeneratorError(f"engine {self.label} broke the serving contract: {exc}"))
        except (GenerationError, EngineProcessError) as exc:
            self._fail(ServedGeneratorError(f"engine {self.label}: {exc}"))
        except BaseException as exc:  # noqa: BLE001 - every waiting caller hears why
            self._fail(ServedGeneratorError(f"engine loop of {self.label}: {type(exc).__name__}: {exc}"))

    def _admit(self, generator: ConfinedGenerator, stream: Stream) -> None:
        if stream.cancelled.is_set():  # gone before it reached the engine
            self._leave(stream)
            stream.hand(DONE)
            return
        generator.deadline = time.perf_counter() + STEP_TIMEOUT_S
        generator.add(stream.request)
        with self._lock:
            if self._failure is not None:  # failed meanwhile (the watch, the verifier): it hears why
                stream.hand(self._failure)
                return
            stream.progress_s = time.perf_counter()
            self._open[stream.request.id] = stream
            self.stats["canaries" if stream.canary else "requests"] += 1

    def _abort_cancelled(self, generator: ConfinedGenerator) -> None:
        """Requests whose clients went away leave the engine (their slots free) before the next step."""
        with self._lock:
            gone = [rid for rid, stream in self._open.items() if stream.cancelled.is_set()]
        for rid in gone:
            generator.deadline = time.perf_counter() + STEP_TIMEOUT_S
            generator.abort(rid)
            with self._lock:
                stream = self._open.pop(rid, None)
            if stream is not None:
                self._leave(stream)
                stream.hand(DONE)
                self.stats["aborted"] += 1

    def _leave(self, stream: Stream) -> None:
        """A request leaves the engine: a user's no longer counts against max_waiting."""
        if not stream.canary:
            with self._lock:
                self._held_users -= 1

    def _route(self, events) -> None:
        """Each token through the guards, then to its stream: released at once, held for the verifier
        (`verify: all`), or kept for the canary's check."""
        now = time.perf_counter()
        with self._lock:
            if self._failure is not None:
                return
            for event in events:
                stream = self._open.get(event.request_id)
                if stream is None:
                    raise GuardBreach(f"request {event.request_id}: a token ({event.token}) for a request the engine "
                                      f"does not hold (never added, finished or aborted)")
                problem = breach(stream.request, len(stream.made) + 1, event.token, event.finished, self.vocab)
                if problem:
                    raise GuardBreach(problem)
                if stream.last_token_s is not None:
                    self.speed.record(now, now - stream.last_token_s)
                stream.last_token_s = stream.progress_s = now
                self.stats["tokens"] += 1
                with stream.lock:
                    stream.made.append(int(event.token))
                    stream.engine_done = event.finished
                if event.finished:
                    del self._open[event.request_id]
                self._deliver(stream, Token(int(event.token), now, event.finished))

    def _deliver(self, stream: Stream, token: Token) -> None:
        if stream.canary:
            if token.finished:
                self._verifier.offer_canary(stream)
        elif stream.verified:
            if token.finished:
                self._verifying[stream.request.id] = stream
                self._leave(stream)
            self._verifier.offer(stream)
        else:
            if not stream.cancelled.is_set():
                stream.hand(token)
            if token.finished:
                self._leave(stream)
                stream.hand(DONE)

    # ------------------------------------------------------------------ the watch (its own thread)
    def _watching(self) -> None:
        """Stalls (a held request without a token past the bound) and slowness, every WATCH_TICK_S."""
        while not self._stop.wait(WATCH_TICK_S) and self._failure is None:
            policy, now = self._policy, time.perf_counter()
            with self._lock:
                held = len(self._open)
                stuck = min(self._open.values(), key=lambda s: s.progress_s, default=None)
                slow = self.speed.judge(policy, self.judged, now)
            if stuck is not None:
                bound = stall_deadline(policy, self.judged, held)
                if now - stuck.progress_s > bound:
                    what = "its first token" if not stuck.made else f"its token {len(stuck.made) + 1}"
                    self._fail(ServedGeneratorError(
                        f"engine {self.label} broke the serving contract: request {stuck.request.id}: no progress "
                        f"for {now - stuck.progress_s:.1f} s waiting for {what}, past the stall bound {bound:.1f} s "
                        f"(max(stall_floor_s {policy.stall_floor_s:g}, stall_factor {policy.stall_factor:g} x the "
                        f"check's E2E p99 {1e3 * self.judged.e2e_p99_s:.0f} ms x ceil({held} held / R "
                        f"{self.judged.concurrency})))"))
                    return
            if slow:
                logger.warning("engine %s: %s", self.label, slow)
            if self.speed.slow_now and policy.slow_action == "remove":
                self._fail(ServedGeneratorError(f"engine {self.label} {self.speed.report['message']} "
                                                f"(slow_action: remove)"))
                return

    # ------------------------------------------------------------------ the verifier's hooks (its thread)
    def _prefix_problem(self, request: GenerationRequest, tokens: list[int]) -> str:
        """Why the tokens so far break the judge's rule (exact mode) or, marked on the running estimate, the
        accuracy budget (budget mode), or "" (a prefix may end anywhere)."""
        judge = self.judge.generation
        checked = judge.tally()
        problem = prefix_problem(request, tokens, judge.reference, judge.rule_tolerance, judge.alternatives,
                                 self.vocab, checked)
        why = self.estimate.add(checked)
        return problem or why

    def _verify_failed(self, why: str) -> None:
        self._fail(ServedGeneratorError(f"engine {self.label} answered wrongly ({why})"))

    def _retire(self, stream: Stream) -> None:
        with self._lock:
            self._verifying.pop(stream.request.id, None)

    # ------------------------------------------------------------------ failure
    def _fail(self, error: Exception, notify: bool = True) -> None:
        """Every waiting caller gets `error`, once; then (a failure, not a close) the replica is told."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = error
            waiting = [*self._open.values(), *self._verifying.values()]
            self._open.clear()
            self._verifying.clear()
            while True:
                try:
                    waiting.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
        for stream in waiting:
            stream.hand(error)
        if notify:
            logger.error("%s", error)
            if self.on_failure is not None:
                try:
                    self.on_failure(str(error))
                except Exception:  # noqa: BLE001 - the replica's hook must not stop this thread's exit
                    logger.exception("telling the replica about a failed engine")

    @property
    def failure(self) -> Exception | None:
        """Why the engine serves no more (a failure or a close), or None."""
        return self._failure

    def rescore(self, request: GenerationRequest, tokens: Sequence[int]) -> tuple[str, float]:
        """A finished request's tokens against the float64 reference under the run's accuracy contract (exact:
        the judge's rule, near ties allowed; budget: marked on the running estimate, which the budget judges):
        (the first problem or "", 0.0)."""
        judge = self.judge.generation
        checked = judge.tally()
        problems = request_problems(request, tokens, judge.reference, judge.rule_tolerance, self.vocab,
                                    judge.alternatives, checked)
        why = self.estimate.add(checked)
        return (problems[0] if problems else why), 0.0

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> int:
        """Requests the engine holds now (queued in it or decoding)."""
        return len(self._open)

    @property
    def idle(self) -> bool:
        """Nothing queued, held by the engine or waiting for the verifier (canaries included)."""
        verifier = self._verifier
        return (self._inbox.empty() and not self._open and not self._verifying
                and (verifier is None or verifier.idle()))

    def guard_info(self) -> dict[str, Any]:
        """What /v1/engine says of the checks on this engine while it serves."""
        policy = self._policy
        verifier = dict(self._verifier.stats) if self._verifier is not None else {}
        return {"policy": asdict(policy), "judged": self.judged.to_dict(),
                "stall_bound_s_now": stall_deadline(policy, self.judged, len(self._open)),
                "slow": self.speed.report, "verifier": verifier,
                "failure": None if self._failure is None else str(self._failure)}

    def close(self, drain_s: float = 0.0) -> None:
        """Refuse new requests, let those in flight finish (at most `drain_s`: a hot swap's old engine), then stop
        the loop, tell callers still waiting, kill the whole candidate."""
        self._draining = True
        deadline = time.perf_counter() + drain_s
        while ((self._open or self._verifying or not self._inbox.empty()) and self._failure is None
               and time.perf_counter() < deadline):
            time.sleep(0.05)
        self._stop.set()
        process = self._process
        if self._failure is not None and process is not None and process.pid:
            try:  # a failed engine may sit in a step: end it now, not at the step's timeout
                os.kill(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for thread in (getattr(self, "_loop", None), getattr(self, "_watch", None)):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=STEP_TIMEOUT_S)
        if self._verifier is not None:
            self._verifier.close()
        if self._failure is None:
            self._fail(ServedGeneratorError(f"engine {self.label} closed"), notify=False)
        if process is not None:
            self._process = None
            process.close()
        self.judge.close()
