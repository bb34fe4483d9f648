"""The KDA input domain (what engines are verified for and Serve accepts) and the random cases the
cascade draws over it on every evaluation, besides the fixed check cases of `inputs.py`.

    B in [1, MAX_BATCH]   T in [1, 8 T_preset] (drawn near multiples of the largest chunk)
    H in [1, H_preset + 1] (Serve: the preset's H, the engine is built for it)
    g in [LOG_DECAY_FLOOR, 0]   beta in [0, 1]

Each draw is one call with one float64 reference of T steps, so draws stay short (T <= SHORT_T) but
for two: a length log-uniform in [1, 4T] and one beyond 4T (log-uniform excess, up to the maximum).
"""
from __future__ import annotations

import numpy as np

from evo.workloads.base import CheckCase, Preset
from evo.workloads.domain import AxisRange, InputDomain, ValueRange
from evo.workloads.kda.inputs import LOG_DECAY_FLOOR, MAX_BATCH

LARGEST_CHUNK = 128  # the largest chunk_size of any KDA engine (every other one divides it)
LONGEST = 8  # T up to LONGEST x the preset's T
SHORT_T = 2 * LARGEST_CHUNK + 15  # the longest T of the short draws
PLAIN = ("standard", "strong_decay", "heavy")
EDGES = ("beta_edges", "correlated_keys", "decay_floor")


def domain(preset: Preset) -> InputDomain:
    s = preset.shape
    return InputDomain(
        axes={"B": AxisRange(1, MAX_BATCH), "T": AxisRange(1, LONGEST * s["T"], LARGEST_CHUNK),
              "H": AxisRange(1, s["H"] + 1)},
        values={"g": ValueRange(LOG_DECAY_FLOOR, 0.0), "beta": ValueRange(0.0, 1.0)})


def log_uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    """An integer in [lo, hi], log-uniform in its distance from lo - 1 (every scale equally likely)."""
    return min(hi, lo - 1 + int(np.exp(rng.uniform(0.0, np.log(hi - lo + 2)))))


def draw_cases(preset: Preset, rng: np.random.Generator) -> list[CheckCase]:
    """Six cases, random over the domain: B between the fixed points (3..MAX_BATCH-1) at T just past a
    multiple of the largest chunk (a ragged last chunk of 1-7 tokens for every chunk size); each edge
    distribution at a random B, H and T near a chunk multiple (decay_floor over at least one whole
    chunk); a length log-uniform in [1, 4T]; one beyond 4T up to the maximum."""
    d = domain(preset)
    B, T, H = d.axes["B"], d.axes["T"], d.axes["H"]
    Tp = preset.shape["T"]

    def case(name: str, distribution: str, b: int, t: int, h: int | None = None) -> CheckCase:
        shape = {**preset.shape, "B": b, "T": t, "H": H.uniform(rng) if h is None else h}
        return CheckCase(name, shape, distribution, bool(rng.integers(2)))

    def any_distribution() -> str:
        return str(rng.choice(PLAIN + EDGES))

    return [
        case("draw_batch_past_chunk", str(rng.choice(PLAIN)), B.uniform(rng, 3, MAX_BATCH - 1),
             T.near_multiple(rng, (1, 7), most=SHORT_T)),
        case("draw_beta_edges", "beta_edges", B.uniform(rng), T.near_multiple(rng, (1, 15), before=True, most=SHORT_T)),
        case("draw_correlated_keys", "correlated_keys", B.uniform(rng), T.near_multiple(rng, (8, 15), most=SHORT_T)),
        case("draw_decay_floor", "decay_floor", B.uniform(rng), T.uniform(rng, LARGEST_CHUNK, SHORT_T)),
        case("draw_length", any_distribution(), 1, log_uniform(rng, 1, 4 * Tp), h=H.uniform(rng, hi=2)),
        case("draw_beyond_4t", any_distribution(), 1, log_uniform(rng, 4 * Tp + 1, T.hi), h=1),
    ]


def output_shapes(case: CheckCase) -> dict[str, tuple[int, ...]]:
    s = case.shape
    return {"o": (s["B"], s["T"], s["H"], s["V"]), "final_state": (s["B"], s["H"], s["K"], s["V"])}
