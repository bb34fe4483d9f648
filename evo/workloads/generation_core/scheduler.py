"""The scheduler every generation engine here shares; like vLLM's, it never sees a model.

A step decodes every decoding request by one token (one batched forward of the pool's first rows), then
admits waiting requests (continuous batching: whenever a row is free; static: a new batch only once the
running one has finished; at most `max_running`) and runs prefill forwards for the oldest admitted ones (the
whole prompt, or its next chunk: one forward each, or with `prefill_together` one forward for them all, through
`ModelRunner.prefill_rows`); a prompt's last forward picks the request's first token. Its events: the
decode step's tokens, then the prefills'. A request ends at `max_tokens` or a stop id, or when aborted
(waiting, prefilling or decoding); its row is freed. The decoding requests hold the pool's first rows: one
that starts decoding takes the row after them (swapping with a prefilling request there), and when some end
the last ones move into the holes.

With `spec_tokens` > 0 a decode step speculates (vLLM's prompt lookup): each decoding request drafts up to
`spec_tokens` tokens from its own prompt and tokens (`drafting.prompt_lookup`), and one batched forward
(`ModelRunner.verify`) feeds every row its last token and its draft and picks the token after each. A row
keeps the picked tokens for as long as its draft agreed with them, and the first pick that disagreed: exactly
the tokens one-at-a-time decoding picks (a sampled token is the same seeded draw, keyed on its index), up to
d + 1 of them for a draft of d. A step without any draft is the plain decode forward.

With `prefill_with_decode` a step that has prompts to prefill runs its decode rows in the same forward
(`ModelRunner.mixed`; vLLM's unified batch: a decode row is one more token beside the prompts', whose products
read every weight anyway): waiting requests are admitted before that forward, so a row freed by a request ending
in it is taken at the next step. Its events are the same as the two forwards': the decode rows', then the
prefills'.
"""
from __future__ import annotations

from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from evo.workloads.generation import GenerationRequest, TokenEvent, check_fits
from evo.workloads.generation_core.drafting import prompt_lookup
from evo.workloads.generation_core.pool import Pool
from evo.workloads.generation_core.runner import ModelRunner, Pick

BATCHING = ("continuous", "static")
PREFILL = ("whole", "chunked")


@dataclass(frozen=True)
class SchedulerPolicy:
    """What the scheduler reads of an engine's genes: how requests are batched, how many run at once (the pool's
    rows), whole prompts or `prefill_chunk` tokens a forward, how many prefill forwards a step runs, and the most
    tokens a decoding request drafts a step (0: no speculation; more needs a runner with `verify`)."""

    batching: str
    max_running: int
    prefill: str
    prefill_chunk: int
    max_prefills_per_step: int
    spec_tokens: int = 0
    spec_min_ngram: int = 1  # the shortest context suffix a draft may match
    spec_max_rows: int = 0  # speculate only while at most this many requests decode (0: however many)
    prefill_together: bool = False  # a step's prefills in one forward (needs a runner with `prefill_rows`)
    prefill_with_decode: bool = False  # ... and its decode rows in that forward (needs a runner with `mixed`)

    def __post_init__(self) -> None:
        if self.batching not in BATCHING or self.prefill not in PREFILL:
            raise ValueError(f"batching must be one of {BATCHING} and prefill one of {PREFILL}, got "
                             f"{self.batching!r}, {self.prefill!r}")
        chunk_ok = self.prefill == "whole" or self.prefill_chunk >= 1
        if self.max_running < 1 or self.max_prefills_per_step < 1 or not chunk_ok:
            raise ValueError(f"max_running, max_prefills_per_step and (chunked) prefill_chunk must be >= 1, got "
                             f"{self.max_running}, {self.max_prefills_per_step}, {self.prefill_chunk}")
        if self.spec_tokens < 0 or self.spec_min_ngram < 1 or self.spec_max_rows < 0:
            raise ValueError(f"spec_tokens must be >= 0 (0: no speculation), spec_min_ngram >= 1 and spec_max_rows >= 0"
                             f" (0: any), got {self.spec_tokens}, {self.spec_min_ngram}, {self.spec_max_rows}")

    def speculates(self, rows: int) -> bool:
        """Whether a decode step of `rows` decoding requests drafts (a verify forward costs more per row than a
        plain step, which pays off at few rows; vLLM turns speculation off above a batch size the same way)."""
        return self.spec_tokens > 0 and (self.spec_max_rows == 0 or rows <= self.spec_max_rows)


@dataclass(eq=False)
class _Run:
    """An admitted request: its pool row, how much of its prompt is prefilled, the tokens it made."""

    request: GenerationRequest
    row: int
    prefilled: int = 0
    made: list[int] = field(default_factory=list)

    @property
    def cached(self) -> int:
        """Positions whose memory is in the pool (the next token to feed sits at this position)."""
        return self.prefilled + max(0, len(self.made) - 1)

    def finished(self) -> bool:
        return len(self.made) >= self.request.max_tokens or self.made[-1] in self.request.stop_ids


class Scheduler:
    """`add`, `step`, `abort` (the generation contract) over a pool and a model runner (see the module).
    `context` makes the context each step runs in (the engine's: no autograd, an attention backend); `drafter`
    (context, k) -> at most k draft tokens, when the policy speculates (prompt lookup by default)."""

    def __init__(self, runner: ModelRunner, pool: Pool, policy: SchedulerPolicy, max_positions: int,
                 num_threads: int | None, context: Callable[[], AbstractContextManager] = nullcontext) -> None:
        if policy.prefill_together and not hasattr(runner, "prefill_rows"):
            raise ValueError(f"prefill_together needs a model runner with prefill_rows; {type(runner).__name__} "
                             "prefills one request a forward")
        if policy.prefill_with_decode and not hasattr(runner, "mixed"):
            raise ValueError(f"prefill_with_decode needs a model runner with mixed; {type(runner).__name__} runs "
                             "prefills and decode steps in forwards of their own")
        self.runner, self.pool, self.policy, self.max_positions = runner, pool, policy, max_positions
        self.num_threads = num_threads  # the engine's threads gene, as the engine's process reads it
        self.context = context
        self.drafter = partial(prompt_lookup, min_ngram=policy.spec_min_ngram)
        self.waiting: deque[GenerationRequest] = deque()
        self.prefilling: list[_Run] = []  # admission order
        self.decoding: list[_Run] = []  # decoding[r].row == r: the pool's first rows
        self.free_rows = set(range(policy.max_running))

    def add(self, request: GenerationRequest) -> None:
        check_fits(request, self.max_positions)
        self.waiting.append(request)

    def step(self) -> list[TokenEvent]:
        """Decode every decoding request by one token, then admit and prefill (first tokens come from there)."""
        with self.context():
            if self.policy.prefill_with_decode and self.decoding and not self.policy.speculates(len(self.decoding)):
                self._admit()  # before the forward that takes the decode rows with the prompts (see the module)
                if self.prefilling:
                    return self._mixed()
            events = self._decode() if self.decoding else []
            self._admit()
            return events + self._prefill()

    def abort(self, request_id: int) -> None:
        """Drop the request wherever it is: out of the queue, or its row freed (decoding rows compacted)."""
        self.waiting = deque(r for r in self.waiting if r.id != request_id)
        run = next((r for r in self.prefilling if r.request.id == request_id), None)
        if run is not None:
            self.prefilling.remove(run)
            self._free(run.row)
        run = next((r for r in self.decoding if r.request.id == request_id), None)
        if run is not None:
            self._end([run])

    @property
    def running(self) -> list[_Run]:
        """The admitted requests: prefilling, then decoding."""
        return self.prefilling + self.decoding

    @property
    def held(self) -> int:
        """Requests this engine holds (queued, prefilling or decoding)."""
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)

    def _admit(self) -> None:
        if self.policy.batching == "static" and (self.decoding or self.prefilling):
            return  # a new batch only once the whole running batch has finished
        while self.waiting and self.free_rows:
            row = min(self.free_rows)  # the lowest: the row it will decode in, so it seldom moves
            self.free_rows.remove(row)
            self.prefilling.append(_Run(self.waiting.popleft(), row))

    def _prefill(self) -> list[TokenEvent]:
        """A prefill forward (the whole prompt, or its next chunk) for the oldest admitted requests: one each, or
        one for them all (`prefill_together`)."""
        chunks = self._prefill_chunks()
        if self.policy.prefill_together and len(chunks) > 1:
            runs, prompts, starts, picks = zip(*chunks)
            tokens = self.runner.prefill_rows([run.row for run in runs], list(prompts), list(starts), list(picks))
        else:
            tokens = [self.runner.prefill(run.row, *rest) for run, *rest in chunks]
        return self._prefilled(chunks, tokens)

    def _prefill_chunks(self) -> list[tuple[_Run, tuple[int, ...], int, Pick | None]]:
        """This step's prompt chunks (run, tokens, start, pick where they end the prompt), their rows reserved."""
        chunks, policy = [], self.policy
        for run in self.prefilling[:policy.max_prefills_per_step]:
            prompt, pos = run.request.prompt, run.prefilled
            T = len(prompt) - pos if policy.prefill == "whole" else min(policy.prefill_chunk, len(prompt) - pos)
            self.pool.reserve(run.row, pos + T)
            chunks.append((run, prompt[pos:pos + T], pos, (run.request, 0) if pos + T == len(prompt) else None))
        return chunks

    def _prefilled(self, chunks: list, tokens: list[int | None]) -> list[TokenEvent]:
        """The chunks forwarded: a prompt done gives its request's first token and starts it decoding."""
        events = []
        for run, chunk, _, _ in chunks:
            run.prefilled += len(chunk)
        for (run, *_), token in zip(chunks, tokens):
            if token is None:
                continue
            run.made.append(token)
            self.prefilling.remove(run)
            events.append(TokenEvent(run.request.id, token, run.finished()))
            if run.finished():
                self._free(run.row)
            else:
                self._start_decoding(run)
        return events

    def _mixed(self) -> list[TokenEvent]:
        """Every decoding request by one token and this step's prompt chunks in one forward (`ModelRunner.mixed`)."""
        runs, chunks = self.decoding, self._prefill_chunks()
        prefills, prompts, starts, picks = zip(*chunks)
        decoded, prefilled = self.runner.mixed(*self._decode_inputs(runs, [run.cached for run in runs]),
                                               [run.row for run in prefills], list(prompts), list(starts), list(picks))
        events = self._decoded(runs, [[token] for token in decoded])
        return events + self._prefilled(chunks, prefilled)

    def _decode(self) -> list[TokenEvent]:
        """One batched forward of every decoding request (see the module for speculation); those that finish
        leave their rows. A request's tokens of one step are its events in order, none after its last."""
        runs = self.decoding
        positions = [run.cached for run in runs]
        drafts = [self._draft(run, p) for run, p in zip(runs, positions)] if self.policy.speculates(len(runs)) else []
        if any(drafts):
            made = self._verify(runs, positions, drafts)
        else:
            made = [[token] for token in self.runner.decode(*self._decode_inputs(runs, positions))]
        return self._decoded(runs, made)

    def _decode_inputs(self, runs: list[_Run], positions: list[int]) -> tuple[list[int], list[int], list[Pick]]:
        """A plain decode of `runs` at `positions`: their rows reserved one position on; (each one's last token,
        the positions, how each next token is picked)."""
        for run, p in zip(runs, positions):
            self.pool.reserve(run.row, p + 1)
        return [run.made[-1] for run in runs], positions, [(run.request, len(run.made)) for run in runs]

    def _decoded(self, runs: list[_Run], made: list[list[int]]) -> list[TokenEvent]:
        """Each decoding run's tokens of this step (its events, none after its last); those that finish leave
        their rows."""
        events, ended = [], []
        for run, tokens in zip(runs, made):
            for token in tokens:
                run.made.append(token)
                events.append(TokenEvent(run.request.id, token, run.finished()))
                if events[-1].finished:
                    ended.append(run)
                    break
        if ended:
            self._end(ended)
        return events

    def _draft(self, run: _Run, position: int) -> tuple[int, ...]:
        """The request's draft: at most spec_tokens, and no more than its tokens left after the one it surely
        makes (a draft of d may yield d + 1) nor than the positions after `position`, where its last token goes."""
        room = min(self.policy.spec_tokens, run.request.max_tokens - len(run.made) - 1,
                   self.max_positions - 1 - position)
        return tuple(self.drafter(run.request.prompt + tuple(run.made), room))[:room] if room > 0 else ()

    def _verify(self, runs: list[_Run], positions: list[int], drafts: list[tuple[int, ...]]) -> list[list[int]]:
        """Each row's last token and draft through one forward; per row the picks its draft agreed with, and the
        first that disagreed (or the one after the whole draft)."""
        fed = [[run.made[-1], *draft] for run, draft in zip(runs, drafts)]
        for run, p, tokens in zip(runs, positions, fed):
            self.pool.reserve(run.row, p + len(tokens))
        picks = [[(run.request, len(run.made) + j) for j in range(len(tokens))] for run, tokens in zip(runs, fed)]
        picked = self.runner.verify(fed, positions, picks)
        kept = []
        for draft, row in zip(drafts, picked):
            agreed = next((j for j, token in enumerate(draft) if token != row[j]), len(draft))
            kept.append(row[:agreed + 1])
        return kept

    # ------------------------------------------------------------------ rows: the decoding ones first
    def _free(self, row: int) -> None:
        self.pool.release(row)
        self.free_rows.add(row)

    def _move(self, run: _Run, row: int) -> None:
        """`run` into the free `row` (its own row freed)."""
        self.pool.move(run.row, row, run.cached)
        self.free_rows.remove(row)
        self.free_rows.add(run.row)
        run.row = row

    def _start_decoding(self, run: _Run) -> None:
        """A prefilled request joins the decoding rows: into the row after them (swapping with a prefilling
        request that holds it)."""
        target = len(self.decoding)
        holder = next((r for r in self.prefilling if r.row == target), None)
        if holder is not None:
            self.pool.swap(run.row, target, max(run.cached, holder.cached))
            holder.row, run.row = run.row, target
        elif run.row != target:
            self._move(run, target)
        self.decoding.append(run)

    def _end(self, ended: list[_Run]) -> None:
        """Free the ended requests' rows; the decoding requests beyond the new count move into the holes."""
        for run in ended:
            self._free(run.row)
        keep = [run for run in self.decoding if all(run is not e for e in ended)]
        holes = sorted(row for row in self.free_rows if row < len(keep))
        for run, hole in zip([r for r in keep if r.row >= len(keep)], holes):
            self._move(run, hole)
        self.decoding = sorted(keep, key=lambda r: r.row)
