"""Canary requests: the replica's own requests, drawn like its users' and always verified against the
reference, whose tokens go to no client.

An engine that is right while it is checked and wrong for users has to tell the two apart. A canary gives
it nothing to tell by: its id comes from the same sequence as the users' (`evaluators.judge.request_ids`), it is
sent when a user request is (each user request brings one with probability 1 / `canary_every`, so no count
marks it), and its prompt is drawn from the recent users' prompts, one of two ways at random:
- a **window**: a random contiguous part of one recent prompt (real tokens in a real order);
- a **variant**: one recent prompt with one inner token swapped for a token of another recent prompt (the
  same length, the same first and last ids: what templated traffic looks like, and what a cache keyed on
  less than the whole prompt answers wrongly).
Its `max_tokens`, stop ids and sampling (temperature, top_p, a fresh seed) are a recent user request's.
Before any user request there is nothing to copy: the prompt is then random ids.
"""
from __future__ import annotations

import collections
import random
import threading
from typing import Sequence

from evo.workloads.generation import GenerationRequest

RECENT = 64  # user requests a canary may be drawn from


class Canaries:
    """Recent user requests and the canaries drawn from them (thread-safe: callers' threads remember and draw)."""

    def __init__(self, vocab: int, max_prompt: int, max_tokens: int) -> None:
        self.vocab, self.max_prompt, self.max_tokens = vocab, max_prompt, max_tokens
        self._recent: collections.deque[GenerationRequest] = collections.deque(maxlen=RECENT)
        self._random = random.SystemRandom()  # not the engine's to predict
        self._lock = threading.Lock()

    def remember(self, request: GenerationRequest) -> None:
        with self._lock:
            self._recent.append(request)

    def due(self, every: int) -> bool:
        """Whether this user request brings a canary (probability 1 / every; never when every is 0)."""
        return every > 0 and self._random.random() * every < 1

    def draw(self, request_id: int) -> GenerationRequest:
        """A canary with id `request_id` (see the module)."""
        rng = self._random
        with self._lock:
            recent = list(self._recent)
        if not recent:
            length = rng.randint(1, self.max_prompt)
            return GenerationRequest(request_id, tuple(rng.randrange(self.vocab) for _ in range(length)),
                                     rng.randint(1, self.max_tokens))
        like = rng.choice(recent)
        prompt = list(rng.choice(recent).prompt)
        if len(prompt) >= 3 and rng.random() < 0.5:  # a variant: one inner token from another recent prompt
            donor = rng.choice(recent).prompt
            i = rng.randrange(1, len(prompt) - 1)
            choices = [t for t in donor if t != prompt[i]] or [(prompt[i] + 1 + rng.randrange(self.vocab - 1))
                                                                % self.vocab]
            prompt[i] = rng.choice(choices)
        else:  # a window
            start = rng.randrange(len(prompt))
            prompt = prompt[start:start + rng.randint(1, len(prompt) - start)]
        seed = rng.randrange(1 << 62) if not like.greedy else like.seed
        return GenerationRequest(request_id, tuple(prompt), like.max_tokens, like.stop_ids, like.temperature,
                                 like.top_p, seed)


def window_or_variant(canary: Sequence[int], source: Sequence[int]) -> str:
    """Which kind `canary` is of `source` ("window", "variant" or ""), for tests and reports."""
    canary, source = list(canary), list(source)
    if len(canary) == len(source) and canary != source and canary[0] == source[0] and canary[-1] == source[-1] \
            and sum(a != b for a, b in zip(canary, source)) == 1:
        return "variant"
    n = len(canary)
    return "window" if any(source[i:i + n] == canary for i in range(len(source) - n + 1)) else ""
