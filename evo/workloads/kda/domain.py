"""The KDA input domain (what engines are verified for and Serve accepts) and the cases the cascade
draws over it on every evaluation, besides the fixed check cases of `inputs.py`.

    B in [1, MAX_BATCH]   T in [1, 8 T_preset]   H in [1, H_preset + 1] (Serve: the preset's H)
    g in [LOG_DECAY_FLOOR, 0]   beta in [0, 1]   |q|, |k| <= QK_MAX entry-wise (~1e6)

Its bands: the parts of the domain where an engine can be wrong and right everywhere else. The draws
of every evaluation reach each band by construction, not by chance (tests/test_domain.py checks it):

    T mod 128       every residue 0..127 (LARGEST_CHUNK; every chunk size of the gene space divides it,
                    so every ragged last chunk of every engine), at T up to two chunks
    q, k norms      as drawn (~sqrt K), exact zero vectors, near zero (1e-4..1e-2, around and below
                    sqrt(L2NORM_EPS) = 1e-3, where the norm's epsilon matters), large (1e2..1e6, one
                    vector up to the bound QK_MAX)                                      NORM_BANDS
    keys            correlated ("correlated_keys") and not (every other distribution)
    g               mild, strong decay, at the floor and at 0 exactly, within 1e-3 of either (bfloat16:
                    two of its steps, 2^-5 at -5) ("decay_floor")
    beta            0 and 1 exactly, within 1e-3 of either ("beta_edges"); values heavy-tailed ("heavy")
    initial state   given and absent
    shapes          B in 3..MAX_BATCH-1 at T past one largest chunk, the decay floor over a whole chunk
                    at any B, T in (2 chunks, 4 T_preset], T in (4 T_preset, 8 T_preset]  (SHAPED)

One case per residue of T (LARGEST_CHUNK cases): the SHAPED ones, each at its residue, and the rest
cheap (B = H = 1, T <= SWEEP_T) cycling through every combination of distribution, norm band and
initial state, so each combination occurs at least twice per evaluation.

Not bounded: v and the initial state. The outputs are linear in both together, so their scale leaves
relative errors as they are (short of float32's overflow near 1e38).
"""
from __future__ import annotations

import itertools

import numpy as np

from evo.workloads.base import CheckCase, Preset
from evo.workloads.domain import AxisRange, InputDomain, ValueRange
from evo.workloads.kda.inputs import (DISTRIBUTIONS, LOG_DECAY_FLOOR, MAX_BATCH, NORM_BANDS, QK_MAX,
                                      distribution)

LARGEST_CHUNK = 128  # the largest chunk_size of any KDA engine (every other one divides it)
LONGEST = 8  # T up to LONGEST x the preset's T
SWEEP_T = 2 * LARGEST_CHUNK  # the cheap cases' longest T: a whole chunk and a ragged one
PLAIN = ("standard", "strong_decay", "heavy")
EDGES = ("beta_edges", "correlated_keys", "decay_floor")
SHAPED = ("draw_batch", "draw_decay_floor", "draw_long", "draw_beyond_4t")
# every (distribution, norm band, initial state) the cheap cases cycle through
COMBINATIONS = tuple(itertools.product(DISTRIBUTIONS, NORM_BANDS, (False, True)))


def domain(preset: Preset) -> InputDomain:
    s = preset.shape
    qk = ValueRange(-QK_MAX, QK_MAX)
    return InputDomain(
        axes={"B": AxisRange(1, MAX_BATCH), "T": AxisRange(1, LONGEST * s["T"], LARGEST_CHUNK),
              "H": AxisRange(1, s["H"] + 1)},
        values={"g": ValueRange(LOG_DECAY_FLOOR, 0.0), "beta": ValueRange(0.0, 1.0), "q": qk, "k": qk})


def log_uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    """An integer in [lo, hi], log-uniform in its distance from lo - 1 (every scale equally likely)."""
    return min(hi, lo - 1 + int(np.exp(rng.uniform(0.0, np.log(hi - lo + 2)))))


def draw_cases(preset: Preset, rng: np.random.Generator) -> list[CheckCase]:
    """LARGEST_CHUNK cases, one per residue of T modulo it (in random order): the SHAPED ones (B in
    3..MAX_BATCH-1 past one chunk; the decay floor over at least a whole chunk at any B; a long T up to
    4x the preset's; one beyond, both at a log-uniform scale), each in a random distribution and norm
    band, then the cheap ones (B = H = 1, T <= SWEEP_T) through COMBINATIONS in a random order, every
    one at least twice."""
    d = domain(preset)
    B, T, H = d.axes["B"], d.axes["T"], d.axes["H"]
    Tp = preset.shape["T"]
    residues = T.residue_sweep(rng)

    def case(name: str, kind: str, norms: str, initial: bool, b: int, h: int, t: tuple[int, int]) -> CheckCase:
        r = residues.pop()
        shape = {**preset.shape, "B": b, "T": T.with_residue(rng, r, *t), "H": h}
        return CheckCase(name, shape, distribution(kind, norms), initial)

    def anything() -> tuple[str, str, bool]:
        return str(rng.choice(DISTRIBUTIONS)), str(rng.choice(NORM_BANDS)), bool(rng.integers(2))

    def scale(lo: int, hi: int) -> tuple[int, int]:  # a window of one chunk or more at a log-uniform scale
        return lo, max(lo + LARGEST_CHUNK - 1, log_uniform(rng, lo, hi))

    shaped = [
        case("draw_batch", *anything(), B.uniform(rng, 3, MAX_BATCH - 1), H.uniform(rng),
             (LARGEST_CHUNK + 1, SWEEP_T)),
        case("draw_decay_floor", "decay_floor", str(rng.choice(NORM_BANDS)), bool(rng.integers(2)),
             B.uniform(rng), H.uniform(rng), (LARGEST_CHUNK, SWEEP_T)),
        case("draw_long", *anything(), 1, H.uniform(rng, hi=2), scale(SWEEP_T + 1, 4 * Tp)),
        case("draw_beyond_4t", *anything(), 1, 1, scale(4 * Tp + 1, T.hi)),
    ]
    order, left = rng.permutation(len(COMBINATIONS)), len(residues)
    cheap = [case("draw_sweep", *COMBINATIONS[order[i % len(order)]], 1, 1, (1, SWEEP_T)) for i in range(left)]
    return shaped + cheap


def output_shapes(case: CheckCase) -> dict[str, tuple[int, ...]]:
    s = case.shape
    return {"o": (s["B"], s["T"], s["H"], s["V"]), "final_state": (s["B"], s["H"], s["K"], s["V"])}
