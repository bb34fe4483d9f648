"""Presets, input distributions and the cascade of correctness cases."""
from __future__ import annotations

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
    edges: "beta_edges" (beta exactly 0 or 1 on most tokens), "correlated_keys" (keys close to one
    direction per head, a quarter repeating the previous key exactly), "decay_floor" (channels and
    whole tokens at g = LOG_DECAY_FLOOR exactly, some channels at g = 0). g always lies in
    [LOG_DECAY_FLOOR, 0] and beta in [0, 1]."""
    if case.distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {case.distribution!r}; allowed: {list(DISTRIBUTIONS)}")
    draw = _Draw(device, seed)
    s, kind = case.shape, case.distribution
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
    g = g.clamp(min=LOG_DECAY_FLOOR)  # the domain's floor (logsigmoid(3 + z) passes it only for z < -8)
    dt = getattr(torch, dtype)
    out = {n: x.to(dtype=dt) for n, x in zip(("q", "k", "v", "g", "beta"), (q, k, v, g, beta))}
    if case.with_initial_state:
        out["initial_state"] = draw.randn(B, H, K, V)
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
