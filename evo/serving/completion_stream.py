"""One OpenAI request's tokens, from the engine loop to the HTTP answer, on the replica's event loop.

`pieces` submits a `Job` to the served generator (`evaluators.served.generator.ServedGenerator`) and
yields `Piece`s as the engine makes tokens: the new token ids, the new text (detokenized incrementally,
held back while it could still become a stop string) and, on the last, why it finished. The engine's
loop thread hands tokens over with `call_soon_threadsafe`, so no thread waits per token; tokens that
arrived while the previous piece was being sent go out together as one piece (a client or proxy that fell
behind gets fewer, larger chunks). However the
caller stops iterating (a client that went away cancels the handler; a stop string ends it early), the
request is cancelled and the engine aborts it, freeing its slot. A request that ran to its end is
offered to the live re-scoring (`on_done(request, tokens)`).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable, Sequence

from evaluators.served.generator import DONE, Token
from evo.serving.openai_api import Job


@dataclass(frozen=True)
class Piece:
    token_ids: tuple[int, ...]
    text: str
    finish: str | None = None  # "stop" (a stop id or string) or "length" (max_tokens) on the last piece


class TextOutput:
    """Tokens in, text out: stop ids give no text, and the text ends before the first stop string."""

    def __init__(self, codec, stop_texts: Sequence[str], stop_ids: Sequence[int]) -> None:
        self.detokenizer = codec.detokenizer() if codec is not None else None
        self.stop_texts, self.stop_ids = tuple(stop_texts), set(stop_ids)
        self.hold = max((len(s) for s in self.stop_texts), default=1) - 1  # characters a stop string may still need
        self.pending = ""  # text not yet handed out
        self.stopped = False

    def push(self, token: int) -> str:
        """The text that is safe to hand out after `token`; `stopped` once a stop string matched."""
        if self.detokenizer is None or token in self.stop_ids:
            return ""
        self.pending += self.detokenizer.push(token)
        return self._release(final=False)

    def finish(self) -> str:
        if self.detokenizer is not None and not self.stopped:
            self.pending += self.detokenizer.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        cut = min((i for i in (self.pending.find(s) for s in self.stop_texts) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        keep = 0 if final else min(self.hold, len(self.pending))
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out


async def pieces(generator, job: Job, codec, on_done: Callable[[object, list[int]], None]) -> AsyncIterator[Piece]:
    """The job's pieces as the engine makes them (see the module). Raises what `submit` raises before the
    first piece (RequestError, Overloaded, ServedGeneratorError), and ServedGeneratorError if the engine
    fails midway."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()
    def sink(item: object) -> None:  # on the engine loop's thread
        try:
            loop.call_soon_threadsafe(inbox.put_nowait, item)
        except RuntimeError:  # this request's event loop is closed: nobody waits for it any more
            pass

    stream = generator.submit(job.prompt, job.max_tokens, job.stop_ids, sink=sink, temperature=job.temperature,
                              top_p=job.top_p, seed=job.seed)
    text = TextOutput(codec, job.stop_texts, job.stop_ids)
    tokens: list[int] = []
    ended = False
    try:
        while True:
            items = [await inbox.get()]
            while not inbox.empty():  # the client fell behind the engine: what waits goes out as one chunk
                items.append(inbox.get_nowait())
            made: list[int] = []
            delta = ""
            for item in items:
                if item is DONE:
                    ended = True
                    break
                if isinstance(item, Exception):
                    ended = True
                    raise item
                assert isinstance(item, Token)
                tokens.append(item.token)
                made.append(item.token)
                delta += text.push(item.token)
                if text.stopped:  # a stop string: the text ends before it; the engine need not go on
                    yield Piece(tuple(made), delta, "stop")
                    return
                if item.finished:
                    ended = True
                    on_done(stream.request, list(tokens))
                    delta += text.finish()  # a stop string may complete only once held-back bytes are flushed
                    stopped = text.stopped or item.token in job.stop_ids
                    yield Piece(tuple(made), delta, "stop" if stopped else "length")
                    return
            if made:
                yield Piece(tuple(made), delta)
            if ended:
                return
    finally:
        if not ended:
            stream.cancel()  # the client went away, or a stop string ended it: the engine aborts it
            if tokens:  # what it made so far is still checked: a prefix of its greedy decode
                on_done(replace(stream.request, max_tokens=len(tokens)), list(tokens))
