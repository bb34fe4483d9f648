"""Seeded sampling that an engine and the judge compute alike, so a sampled token can be checked.

A request with `temperature` > 0 picks its token at output index i by the Gumbel-max rule over the
nucleus: among the smallest set of most probable tokens whose probability (softmax of logits / T) reaches
`top_p`, the token with the largest logits / T + g, where g is Gumbel noise drawn from a generator keyed on
(seed, i) alone. That is a draw from the nucleus distribution, and it is reproducible: the judge draws
the same noise and checks the engine's token against the float64 reference's logits (near ties and
tokens at the nucleus's edge allowed), as it checks a greedy token. Temperature 0 is greedy.
"""
from __future__ import annotations

import math

import numpy as np

TOP_P_SLACK = 1e-3  # probability mass by which an engine's nucleus edge may differ from the reference's


def gumbel(seed: int, index: int, vocab: int) -> np.ndarray:
    """The Gumbel noise [vocab] (float64) of output index `index` of a request seeded `seed`."""
    u = np.random.Generator(np.random.PCG64([int(seed), int(index)])).random(vocab)
    return -np.log(-np.log(np.clip(u, 1e-300, 1.0 - 2 ** -53)))


def preceding_mass(scaled: np.ndarray) -> np.ndarray:
    """Per token, the probability of the tokens ranked above it (softmax of `scaled`)."""
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.empty_like(p)
    before[order] = np.cumsum(p[order]) - p[order]
    return before


def choose(logits, temperature: float, top_p: float, seed: int, index: int) -> int:
    """The token of output index `index` from logits [V] (see the module)."""
    row = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        return int(np.argmax(row))
    scaled = row / temperature
    scores = scaled + gumbel(seed, index, len(row))
    if top_p < 1:
        scores = np.where(preceding_mass(scaled) < top_p, scores, -math.inf)
    return int(np.argmax(scores))


def check(reference: np.ndarray, token: int, temperature: float, top_p: float, seed: int, index: int,
          tolerance: float) -> str:
    """Why `token` is not what the rule picks from the float64 reference's logits [V], or "" when it is: its
    score within `tolerance` / T of the best among the tokens surely in the nucleus, and itself possibly in it.
    An engine's logits may differ from the reference's by `tolerance`, which moves probabilities by up to a
    factor exp(2 tolerance / T) and may swap near-tied ranks: the nucleus's edge is judged with that slack."""
    if temperature == 0:
        top = int(np.argmax(reference))
        if token == top or (math.isfinite(reference[token]) and reference[top] - reference[token] <= tolerance):
            return ""
        return (f"token {token}, the reference's is {top} (logit {reference[token]:.4g} vs {reference[top]:.4g}, "
                f"beyond the near-tie tolerance {tolerance:g})")
    scaled = np.asarray(reference, dtype=np.float64) / temperature
    slack = tolerance / temperature
    scores = scaled + gumbel(seed, index, len(scaled))
    if top_p < 1:
        p = np.exp(scaled - scaled.max())
        p /= p.sum()
        order = np.argsort(scaled, kind="stable")
        ascending = scaled[order]
        mass_from = np.concatenate([np.cumsum(p[order][::-1])[::-1], [0.0]])  # [i]: of ascending[i:]

        def above(threshold: np.ndarray) -> np.ndarray:  # mass of tokens whose scaled logit exceeds threshold
            return mass_from[np.searchsorted(ascending, threshold, side="right")]
        factor = math.exp(2 * slack)
        surely_above = above(scaled + slack)  # an engine ranks these above the token whatever its error
        maybe_above = above(scaled - slack) - p  # ... and at most these
        if surely_above[token] / factor >= top_p + TOP_P_SLACK:
            return f"token {token} lies outside the top_p {top_p:g} nucleus (mass {surely_above[token]:.4f} ranks above it)"
        inside = maybe_above * factor < max(top_p - TOP_P_SLACK, 1e-12)  # surely in the nucleus
        inside[int(np.argmax(scaled))] = True
    else:
        inside = np.ones(len(scaled), dtype=bool)
    best = int(np.argmax(np.where(inside, scores, -math.inf)))
    if scores[token] < scores[best] - slack:
        return (f"token {token}, the seeded draw picks {best} (score {scores[token]:.4g} vs {scores[best]:.4g} at "
                f"temperature {temperature:g}, beyond the near-tie tolerance)")
    return ""
