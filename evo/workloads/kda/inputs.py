"""Presets, input distributions and the cascade of correctness cases."""
from __future__ import annotations

import math

from evo.workloads.base import CheckCase, Preset
from evo.workloads.lazy import lazy

torch = lazy("torch")  # the presets and constants are read without torch (agents); drawing inputs imports it

PRESETS: dict[str, Preset] = {
    "cpu": Preset("cpu", {"B": 1, "T": 1024, "H": 4, "K": 64, "V": 64}, "float32", "cpu"),
    "cpu_small": Preset("cpu_small", {"B": 1, "T": 256, "H": 2, "K": 32, "V": 32}, "float32", "cpu"),
    "h200": Preset("h200", {"B": 1, "T": 8192, "H": 96, "K": 128, "V": 128}, "bfloat16", "cuda"),
}

DISTRIBUTIONS = ("standard", "strong_decay", "heavy", "beta_edges", "correlated_keys", "decay_floor")
LOG_DECAY_FLOOR = -5.0  # the domain's lower bound of the per-step log decay g (fla's safe gate bound)
STRONG_DECAY_MIN = LOG_DECAY_FLOOR  # strong decay spans [floor, -1]
STRONG_DECAY_FRACTION = 0.25  # share of channels that decay strongly
NEAR_EDGE = 1e-3  # "near" a bound of g or beta: within this of it (beta_edges, decay_floor)
# share of the entries not at a bound moved near each bound: more g near the floor is more strong decay,
# which doubled the error of honest chunk-128 engines (to ~60% of the float32 tolerance) at 1/4
NEAR_EDGE_FRACTION = 1 / 32

# The norm bands of q and k (per token and head, over K), a second part of a distribution's name
# ("heavy+near_zero"): "ordinary" (as drawn, ~sqrt(K)), "zero" (exact zero vectors), "near_zero" (norms
# log-uniform in NEAR_ZERO_NORMS, around and below sqrt(L2NORM_EPS) = 1e-3, where the norm's epsilon
# matters), "large" (norms log-uniform in LARGE_NORMS, one vector per tensor at the bound QK_MAX itself).
NORM_BANDS = ("ordinary", "zero", "near_zero", "large")
NEAR_ZERO_NORMS = (1e-4, 1e-2)
LARGE_NORMS = (1e2, 1e6)
QK_MAX = float(2**20)  # the domain's bound on |q| and |k| (~1e6; a power of two: exact in bfloat16 too)


def distribution(kind: str, norms: str = "ordinary") -> str:
    """The distribution name of `kind` (one of DISTRIBUTIONS) with q and k in the norm band `norms`."""
    return kind if norms == "ordinary" else f"{kind}+{norms}"


def parse_distribution(name: str) -> tuple[str, str]:
    """(kind, norm band) of a distribution name, e.g. "heavy+near_zero" -> ("heavy", "near_zero")."""
    kind, _, norms = name.partition("+")
    norms = norms or "ordinary"
    if kind not in DISTRIBUTIONS or norms not in NORM_BANDS or name != distribution(kind, norms):
        raise ValueError(f"unknown distribution {name!r}; allowed: one of {list(DISTRIBUTIONS)}, optionally "
                         f"followed by '+' and a norm band of {list(NORM_BANDS[1:])}")
    return kind, norms


def presets() -> dict[str, Preset]:
    return dict(PRESETS)


class _Draw:
    """Draws from one seeded generator on the device the inputs live on (CUDA: drawn there, no host
    copy; the values differ from a CPU draw of the same seed, each device is deterministic per seed)."""

    def __init__(self, device: str, seed: int) -> None:
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen, device=self.device)

    def student_t(self, shape: tuple[int, ...], df: int) -> torch.Tensor:
        z = self.randn(*shape)
        chi2 = (self.randn(df, *shape) ** 2).sum(0)
        return z / torch.sqrt(chi2 / df)


def make_inputs(case: CheckCase, dtype: str, device: str, seed: int) -> dict:
    """Fresh inputs for `case`: q, k, v, g, beta in `dtype`, initial_state float32 (or absent), drawn
    on `device` by a generator seeded with `seed` (the judge salts seeds per call).

    Distributions: "standard" (N(0, 1) q, k, v; mild decay), "strong_decay" (a quarter of the
    channels decay in [floor, -1] per step), "heavy" (Student-t q, k and large v), and the domain's
    edges: "beta_edges" (beta exactly 0 or 1 on most tokens, within NEAR_EDGE of them on some),
    "correlated_keys" (keys close to one direction per head, a quarter repeating the previous key
    exactly), "decay_floor" (channels and whole tokens at g = LOG_DECAY_FLOOR exactly, some channels at
    g = 0, some within NEAR_EDGE of either). A name may add a norm band of q and k ("heavy+near_zero",
    see NORM_BANDS). g always lies in [LOG_DECAY_FLOOR, 0], beta in [0, 1], |q| and |k| <= QK_MAX.
    What is drawn after the initial state (near edges, norm bands) leaves the draws before it as they
    were: a seed gives a distribution the values it always had."""
    kind, norms = parse_distribution(case.distribution)
    draw = _Draw(device, seed)
    s = case.shape
    B, T, H, K, V = s["B"], s["T"], s["H"], s["K"], s["V"]
    if kind == "heavy":
        q = draw.student_t((B, T, H, K), 2) * 10
        k = draw.student_t((B, T, H, K), 2) * 10
        v = draw.randn(B, T, H, V) * 100
    else:
        q = draw.randn(B, T, H, K)
        k = draw.randn(B, T, H, K)
        v = draw.randn(B, T, H, V)
    # mild decay: logsigmoid(N(3, 1)) ~ -0.05 per step
    g = torch.nn.functional.logsigmoid(3 + draw.randn(B, T, H, K))
    if kind == "strong_decay":
        strong = draw.rand(B, 1, H, K) < STRONG_DECAY_FRACTION
        u = draw.rand(B, T, H, K)
        g = torch.where(strong, STRONG_DECAY_MIN + u * (-1 - STRONG_DECAY_MIN), g)
    beta = torch.sigmoid(draw.randn(B, T, H))
    if kind == "beta_edges":
        beta = _beta_edges(beta, draw)
    elif kind == "correlated_keys":
        k = _correlated(k, draw)
    elif kind == "decay_floor":
        g = _decay_floor(g, draw)
    initial_state = draw.randn(B, H, K, V) if case.with_initial_state else None
    dt = getattr(torch, dtype)
    if kind == "beta_edges":
        beta = _near_edges(beta, draw, (0.0, 1.0), dt)
    elif kind == "decay_floor":
        g = _near_edges(g, draw, (LOG_DECAY_FLOOR, 0.0), dt)
    if norms != "ordinary":
        q, k = _norm_band(q, draw, norms, last=True), _norm_band(k, draw, norms, last=False)
    g = g.clamp(min=LOG_DECAY_FLOOR)  # the domain's floor (logsigmoid(3 + z) passes it only for z < -8)
    q, k = q.clamp(-QK_MAX, QK_MAX), k.clamp(-QK_MAX, QK_MAX)  # heavy: past the bound only ~1e-10 per entry
    out = {n: x.to(dtype=dt) for n, x in zip(("q", "k", "v", "g", "beta"), (q, k, v, g, beta))}
    if initial_state is not None:
        out["initial_state"] = initial_state
    return out


def _beta_edges(beta: torch.Tensor, draw: _Draw) -> torch.Tensor:
    """beta [B, T, H] exactly 0 on a third of the tokens, exactly 1 on another third; every head's
    first token 0 and (T > 1) last token 1, so both edges occur in every draw."""
    u = draw.rand(*beta.shape)
    beta = torch.where(u < 1 / 3, 0.0, torch.where(u < 2 / 3, 1.0, beta))
    beta[:, -1] = 1.0
    beta[:, 0] = 0.0
    return beta


def _correlated(k: torch.Tensor, draw: _Draw) -> torch.Tensor:
    """k [B, T, H, K] within a few degrees of one direction per (batch, head); a quarter of the tokens
    repeat the previous token's key exactly (an ill-conditioned intra-chunk system)."""
    B, T, H, K = k.shape
    base = draw.randn(B, 1, H, K)
    k = base + 0.05 * base.norm(dim=-1, keepdim=True) * k / K**0.5
    repeat = draw.rand(B, T, H, 1) < 0.25
    return torch.where(repeat, k.roll(1, dims=1), k)


def _decay_floor(g: torch.Tensor, draw: _Draw) -> torch.Tensor:
    """g [B, T, H, K] at LOG_DECAY_FLOOR exactly on half the channels (channel 0 always) and on every
    channel of an eighth of the tokens; an eighth of the channels at exactly 0 (no decay)."""
    B, T, H, K = g.shape
    floor = draw.rand(B, 1, H, K) < 0.5
    floor[..., 0] = True
    floor = floor | (draw.rand(B, T, H, 1) < 0.125)
    none = (draw.rand(B, 1, H, K) < 0.125) & ~floor
    return torch.where(floor, LOG_DECAY_FLOOR, torch.where(none, 0.0, g))


def _near_edges(x: torch.Tensor, draw: _Draw, bounds: tuple[float, float], dtype: torch.dtype) -> torch.Tensor:
    """x with NEAR_EDGE_FRACTION of its entries not exactly at a bound moved near the lower bound and as
    many near the upper (never past them); of those entries the first always near the lower and the last
    near the upper, so both occur in every draw with two or more. Near: within NEAR_EDGE, or within two
    steps of `dtype` at the bound where its steps are coarser (bfloat16: 2^-5 at -5, so that a near
    value does not round onto the bound)."""
    lo, hi = bounds
    u = draw.rand(*x.shape)
    near = {b: draw.rand(*x.shape) * max(NEAR_EDGE, 2 * _step(b, dtype)) for b in bounds}
    low, high = lo + near[lo], hi - near[hi]
    free = (x != lo) & (x != hi)
    moved = torch.where(free & (u < NEAR_EDGE_FRACTION), low, torch.where(free & (u > 1 - NEAR_EDGE_FRACTION), high, x))
    where = free.view(-1).nonzero()
    if len(where) >= 2:
        first, last = int(where[0]), int(where[-1])
        flat = moved.view(-1)
        flat[first], flat[last] = low.view(-1)[first], high.view(-1)[last]
    return moved


def _step(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` around `value` (0 at 0)."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(abs(value))) if value else 0.0


def _norm_band(x: torch.Tensor, draw: _Draw, band: str, last: bool) -> torch.Tensor:
    """x [B, T, H, K] with the vectors (over K) of about half the tokens in `band` (NORM_BANDS; a quarter
    for "zero"), the first token's (`last`: the last token's) always: "zero" exact zeros, "near_zero"
    and "large" rescaled to a norm log-uniform in NEAR_ZERO_NORMS or LARGE_NORMS; "large" also sets
    the first head of that token so its largest entry is QK_MAX, the domain's bound."""
    B, T, H, _ = x.shape
    chosen = draw.rand(B, T, H, 1) < (0.25 if band == "zero" else 0.5)
    chosen[:, -1 if last else 0] = True
    if band == "zero":
        return torch.where(chosen, 0.0, x)
    lo, hi = NEAR_ZERO_NORMS if band == "near_zero" else LARGE_NORMS
    norm = torch.exp(math.log(lo) + draw.rand(B, T, H, 1) * math.log(hi / lo))
    scaled = x * (norm / x.norm(dim=-1, keepdim=True).clamp(min=1e-30))
    if band == "large":
        t = -1 if last else 0
        peak = x[:, t, :1]  # [B, 1, K]
        top = peak.abs().amax(-1, keepdim=True)
        scaled[:, t, :1] = torch.where(peak.abs() == top, peak.sign() * QK_MAX, peak * (QK_MAX / top.clamp(min=1e-30)))
    return torch.where(chosen, scaled, x)


MAX_BATCH = 8  # the largest batch the cascade verifies: Serve may batch requests up to this many along B


def free_axes(preset: Preset) -> dict[str, tuple[int, ...]]:
    """The axes a caller may vary, and the values the fixed check cases verify an engine at (each is
    covered by one; the domain in `domain.py` spans more, drawn at random per evaluation)."""
    s = preset.shape
    small_h = min(2, s["H"])
    return {"B": (1, 2, MAX_BATCH), "T": (1, 77, s["T"] - 17, s["T"], 4 * s["T"]),
            "H": tuple(sorted({1, small_h, small_h + 1, s["H"], s["H"] + 1}))}


def check_cases(preset: Preset) -> list[list[CheckCase]]:
    """Stage 1: small and cheap (ragged T=77, T=1, B=2 and B=MAX_BATCH, one head more). Stage 2: the
    preset shape and its hard cases (another batch size and head count included). Every batch element
    and head gets its own data."""
    full = dict(preset.shape)
    small = {**full, "B": 1, "T": 77, "H": min(2, full["H"])}
    stage1 = [
        CheckCase("small_standard_h0", small, "standard", True),
        CheckCase("small_strong_decay_h0", small, "strong_decay", True),
        CheckCase("t1_standard_h0", {**small, "T": 1}, "standard", True),
        CheckCase("small_batch2_strong_decay_h0", {**small, "B": 2}, "strong_decay", True),
        CheckCase("small_batch_max_h0", {**small, "B": MAX_BATCH}, "standard", True),
        CheckCase("small_heads_plus1_h0", {**small, "H": small["H"] + 1}, "standard", True),
    ]
    stage2 = [
        CheckCase("full_standard", full, "standard"),
        CheckCase("full_strong_decay_h0", full, "strong_decay", True),
        CheckCase("full_heavy_h0", full, "heavy", True),
        CheckCase("ragged_standard", {**full, "T": full["T"] - 17}, "standard", True),
        CheckCase("long_standard_h0", {**full, "T": 4 * full["T"], "H": 1}, "standard", True),
        CheckCase("full_batch2_h0", {**full, "B": 2}, "standard", True),
        CheckCase("full_heads_plus1", {**full, "H": full["H"] + 1}, "strong_decay"),
    ]
    return [stage1, stage2]
