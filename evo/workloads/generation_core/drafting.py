"""Draft tokens for speculative decoding, from the request's own context: prompt lookup (vLLM's n-gram
proposer). Text that quotes, edits or repeats its prompt continues an n-gram the way it continued before;
the verify forward keeps only the drafted tokens the model itself picks, so a wrong draft costs time, never
a token."""
from __future__ import annotations

from typing import Sequence


def prompt_lookup(context: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[int, ...]:
    """Up to k tokens that followed the most recent earlier occurrence of the context's last n tokens, for the
    largest n in [min_ngram, max_ngram] that occurs earlier; () when none does (or k < 1).

    One backward pass over the occurrences of the last token: each one's match is extended backwards, at most
    max_ngram tokens, so the cost is O(len(context) * max_ngram) however many n are tried."""
    L = len(context)
    if k < 1 or L < 2 or min_ngram < 1:
        return ()
    last, longest = context[-1], min(max_ngram, L - 1)
    found: dict[int, int] = {}  # n -> where the most recent earlier match of the last n tokens ends
    for end in range(L - 2, -1, -1):
        if context[end] != last:
            continue
        n = 1
        while n < longest and n <= end and context[end - n] == context[L - 1 - n]:
            n += 1
        for m in range(1, n + 1):
            found.setdefault(m, end)
        if n == longest:
            break  # the most recent match of the longest n-gram: nothing earlier can beat it
    n = max((m for m in found if m >= min_ngram), default=0)
    return tuple(context[found[n] + 1:found[n] + 1 + k]) if n else ()
