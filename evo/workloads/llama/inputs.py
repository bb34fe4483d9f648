"""Token inputs, the cascade of check cases, the verified domain and the request schema.

One call is one generation: `prompt` [B, P] and `continuation` [B, N] int64 token ids (the sequence
[B, P+N] split at P, so the prompt length travels as a shape). Free axes B, P, N:
    B in [1, MAX_B]   P in [1, 2 P_preset]   N in [0, 2 N_preset]
Distributions: "uniform" (ids uniform over the vocabulary), "repeated" (one token repeated through
prompt and continuation, per row), "extremes" (ids 0, 1, V-2 and V-1 only), "vocab_edges" (uniform,
with the ids 0 and V-1 in the prompt and in the continuation of every row).

Bands, each reached by the draws of every evaluation by construction (`draw_cases`):
    prompt length   1, short (2..SHORT_P), odd (past SHORT_P, below the longest), the longest
    output length   N = 0, 1, some (2..N_max-1), the longest
    vocabulary      the ids 0 and V-1 in a prompt and in a continuation ("vocab_edges")
"""
from __future__ import annotations

import numpy as np

from evo.workloads.base import CheckCase, Preset
from evo.workloads.domain import AxisRange, InputDomain, ValueRange
from evo.workloads.lazy import lazy
from evo.workloads.requests import TensorSpec

torch = lazy("torch")  # presets and specs are read without torch (agents); tensors import it

DISTRIBUTIONS = ("uniform", "repeated", "extremes", "vocab_edges")
SHORT_P = 8  # the longest prompt of the "short" band
PROMPT_BANDS = ("one", "short", "odd", "longest")
OUTPUT_BANDS = ("none", "one", "some", "longest")


def max_batch(preset: Preset) -> int:
    """The largest batch the cascade verifies (Serve batches requests up to it)."""
    return max(4, 2 * preset.shape["B"])


def max_lengths(preset: Preset) -> tuple[int, int]:
    """The longest prompt and continuation verified: twice the preset's."""
    return 2 * preset.shape["P"], 2 * preset.shape["N"]


def max_positions(preset: Preset) -> int:
    P, N = max_lengths(preset)
    return P + N


def make_inputs(case: CheckCase, dtype: str, device: str, seed: int) -> dict:
    """Fresh token ids for `case` (shape B, P, N, V): {"prompt": [B, P], "continuation": [B, N]} int64."""
    if case.distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {case.distribution!r}; allowed: {list(DISTRIBUTIONS)}")
    gen = torch.Generator().manual_seed(seed)
    s = case.shape
    B, P, N, V = s["B"], s["P"], s["N"], s["V"]
    if case.distribution == "uniform":
        tokens = torch.randint(0, V, (B, P + N), generator=gen)
    elif case.distribution == "repeated":
        tokens = torch.randint(0, V, (B, 1), generator=gen).expand(B, P + N).clone()
    elif case.distribution == "extremes":
        edges = torch.tensor([0, 1, V - 2, V - 1])
        tokens = edges[torch.randint(0, 4, (B, P + N), generator=gen)]
    else:
        tokens = torch.randint(0, V, (B, P + N), generator=gen)
        _place_edges(tokens[:, :P], V, gen)
        _place_edges(tokens[:, P:], V, gen)
    tokens = tokens.to(device)
    return {"prompt": tokens[:, :P].contiguous(), "continuation": tokens[:, P:].contiguous()}


def _place_edges(part: torch.Tensor, V: int, gen: torch.Generator) -> None:
    """In place: ids 0 and V-1 at two distinct random positions of each row of `part` [B, L] (one id,
    V-1, where L = 1; nothing where L = 0)."""
    B, L = part.shape
    if L == 0:
        return
    rows = torch.arange(B)
    first = torch.randint(0, L, (B,), generator=gen)
    part[rows, first] = V - 1
    if L >= 2:
        part[rows, (first + torch.randint(1, L, (B,), generator=gen)) % L] = 0


def free_axes(preset: Preset) -> dict[str, tuple[int, ...]]:
    """Each free axis with the values the fixed cascade verifies."""
    s = preset.shape
    P_max, N_max = max_lengths(preset)
    return {"B": tuple(sorted({1, 2, s["B"], max_batch(preset)})),
            "P": tuple(sorted({1, 5, 7, 9, s["P"], P_max})), "N": tuple(sorted({0, 1, 3, 4, s["N"], N_max}))}


def check_cases(preset: Preset) -> list[list[CheckCase]]:
    """Stage 1: short and cheap (P=1, N=0 and 1, odd P, B=2 and the largest B, repeated and extreme
    ids). Stage 2: the preset's shape, its repeated-token edge, another batch size, the longest lengths."""
    s = dict(preset.shape)
    P_max, N_max = max_lengths(preset)
    short = {**s, "B": 1}

    def case(name, distribution="uniform", **axes):
        return CheckCase(name, {**short, **axes}, distribution)

    stage1 = [
        case("p1_n0", P=1, N=0), case("p1_n1", P=1, N=1), case("odd_p7_n3", P=7, N=3),
        case("batch2_p5_n4", B=2, P=5, N=4), case("repeated_b2_p9_n4", "repeated", B=2, P=9, N=4),
        case("extremes_bmax_p5_n3", "extremes", B=max_batch(preset), P=5, N=3),
    ]
    stage2 = [
        CheckCase("preset", s, "uniform"),
        CheckCase("preset_repeated", s, "repeated"),
        CheckCase("preset_other_batch", {**s, "B": 2 if s["B"] != 2 else 1}, "uniform"),
        CheckCase("longest", {**s, "B": 1, "P": P_max, "N": N_max}, "uniform"),
    ]
    return [stage1, stage2]


def domain(preset: Preset) -> InputDomain:
    V = preset.shape["V"]
    P_max, N_max = max_lengths(preset)
    ids = ValueRange(0, V - 1)
    return InputDomain(axes={"B": AxisRange(1, max_batch(preset)), "P": AxisRange(1, P_max),
                             "N": AxisRange(0, N_max)}, values={"prompt": ids, "continuation": ids})


def draw_cases(preset: Preset, rng: np.random.Generator) -> list[CheckCase]:
    """Four cases per evaluation, stratified: each prompt band once, each output band once (paired at
    random), batch sizes uniform; "vocab_edges" on the case whose shorter part is longest (P and N of
    2 or more: at most one of the two longer outputs meets P = 1), the others in any distribution."""
    d = domain(preset)
    B, P, N = d.axes["B"], d.axes["P"], d.axes["N"]
    odd = list(range((SHORT_P + 1) | 1, P.hi, 2)) or list(range(1, P.hi + 1, 2))  # past short, below the longest
    prompts = {"one": 1, "short": P.uniform(rng, min(2, P.hi), SHORT_P), "odd": int(rng.choice(odd)),
               "longest": P.hi}
    some = N.uniform(rng, min(2, N.hi), max(min(2, N.hi), N.hi - 1))
    outputs = {"none": 0, "one": min(1, N.hi), "some": some, "longest": N.hi}
    pairs = [(prompts[p], outputs[n], f"draw_p_{p}_n_{n}") for p, n in zip(rng.permutation(PROMPT_BANDS), OUTPUT_BANDS)]
    edges = max(range(len(pairs)), key=lambda i: min(pairs[i][:2]))
    return [CheckCase(name, {**preset.shape, "B": B.uniform(rng), "P": p, "N": n},
                      "vocab_edges" if i == edges else str(rng.choice(DISTRIBUTIONS[:-1])))
            for i, (p, n, name) in enumerate(pairs)]


def output_shapes(case: CheckCase) -> dict[str, tuple[int, ...]]:
    s = case.shape
    return {"logits": (s["B"], s["N"] + 1, s["V"])}


def request_specs(preset: Preset) -> tuple[TensorSpec, ...]:
    """prompt [B, P] and continuation [B, N], int64 ids in [0, V-1]; B, P, N free (Serve bounds them by
    the domain). An empty continuation (N=0) asks for the next-token logits of the prompt alone."""
    V = preset.shape["V"]
    return (TensorSpec("prompt", ("B", "P"), ("int64",), bounds=(0, V - 1), dim_names=("B", "P")),
            TensorSpec("continuation", ("B", "N"), ("int64",), bounds=(0, V - 1), dim_names=("B", "N")))


def example_request(preset: Preset, seed: int, **axes: int) -> dict:
    """One request's token ids on CPU at the preset's shape (B, P, N overridable), uniform ids."""
    unknown = sorted(set(axes) - {"B", "P", "N"})
    if unknown:
        raise ValueError(f"axes {unknown} are fixed by the llama preset {preset.name!r}; only B, P and N are free")
    return make_inputs(CheckCase("example", {**preset.shape, **axes}, "uniform"), preset.dtype, "cpu", seed)
