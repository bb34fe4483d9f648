"""The accuracy contract: what a generation engine may lose against the float64 reference, measured on its own
tokens (docs/evidence.md, "The accuracy contract").

Two modes, declared by the run (`evaluator.accuracy`) and carried by every claim:
- `exact` (the default for float32 and float64 presets): every token is the rule's pick on the reference or a
  near tie with it (`evo.workloads.sampling.check`, the workload's `tie_tolerance`);
- `budget` (the default for bfloat16 presets): the tokens' loss must stay within a `Budget`, tested with
  confidence over every request the judge scored.

The loss is read off tokens alone, teacher-forced: at each step of a request the reference's row over the prompt
and the engine's own tokens before it gives the rule's **pick** (greedy: the argmax; sampled: the seeded draw of
`evo.workloads.sampling`) and the **gap** of the engine's token, how far its score lies below the pick's, in logits
(for a sampled step, the Gumbel-perturbed scores times the temperature; for a token outside the reference's
top_p nucleus, at least its logit's distance below the nucleus's lowest). An engine that took a token `gap` below the pick had
logits off by at least `gap` in that pair: the gap is a lower bound on its logit error that no engine can talk
its way out of (the judge never asks an engine for its own probabilities). Per evaluation:
- **top-1 agreement**: the share of steps whose token is the pick (Wilson 95% interval);
- **mean gap** over all steps (0 where they agree; a ratio estimate with a 95% interval clustered by request),
  the log-probability the float64 model loses per token;
- **largest gap** (where: request, step): a bound on every step, so on every request; over contexts of a few
  tokens (prompt and tokens before the step) its own, wider bound (`Budget.short_max_gap`): there an honest
  bfloat16 execution of a Llama model can be off by tens of logits (SmolLM2-135M, two random tokens: its top-10
  log-probabilities off by up to 18.8, against 0.43 at 64), which one bound for every context would either fail
  or have to admit everywhere;
- per request, its disagreements against the budget's agreement (a binomial tail, Bonferroni over requests): an
  engine cannot spend the budget on a few prompts (a trigger, a prompt class);
- **near ties**: steps whose runner-up lies within the budget's tie window of the pick. An honest engine's rounding
  takes the other token of a tie at most half the time (it is more likely to err the short way than the long
  way); an engine that takes it in k of n ties with P(Binomial(n, 1/2) >= k) < `tie_alpha` steers them.

A `Budget` is given in the config or calibrated (`calibrate`): an honest execution of the reference in a lower
precision (`Workload.honest_logits`, e.g. bfloat16) against float64 over fixed sequences, each of its figures
times `factor`, the largest gap also per band of short contexts (`SHORT_CONTEXTS`).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from evaluators.settings import BUDGET_KEYS, accuracy_mode
from evo.workloads import sampling

Z95 = 1.959963984540054


# ---------------------------------------------------------------------------------------------- per step
@dataclass(frozen=True)
class Marks:
    """One request's steps: whether each token is the pick, its gap (logits), whether the step was a near tie
    (runner-up within the window), and the request and tokens they were read off (so the context each step's row
    reads, the prompt and tokens before it; not known: judged as a long one)."""

    agree: np.ndarray
    gap: np.ndarray
    tie: np.ndarray
    # the request and its tokens: each step's context, and what an honest execution of it is computed from
    # (`recheck`); None: not known (a request without a prompt)
    source: tuple | None = None

    @property
    def context(self) -> np.ndarray | None:
        """How many tokens each step's row reads (the prompt and the tokens before it); None: not known."""
        return None if self.source is None else len(self.source[0].prompt) + np.arange(len(self.agree))


def mark(request, tokens: Sequence[int], rows: np.ndarray, window: float) -> Marks:
    """`Marks` of `tokens` (a request's own, in order) against the reference's `rows` [len(tokens), V]."""
    n = len(tokens)
    agree, gap, tie = np.zeros(n, bool), np.zeros(n), np.zeros(n, bool)
    for step, (token, row) in enumerate(zip(tokens, np.asarray(rows, dtype=np.float64))):
        agree[step], gap[step], tie[step] = _step(request, step, token, row, window)
    prompt = getattr(request, "prompt", None)
    return Marks(agree, gap, tie, None if prompt is None else (request, tuple(tokens)))


def _step(request, step: int, token: int, row: np.ndarray, window: float) -> tuple[bool, float, bool]:
    """One step's (agree, gap, tie): `token` against the reference's `row` by the request's rule."""
    scores, raw, outside = _scores(row, request.temperature, request.top_p, request.seed, step)
    pick = int(np.argmax(scores))
    second = np.partition(scores, -2)[-2] if scores.size > 1 else -math.inf
    scale = request.temperature or 1.0
    gap = 0.0
    if token != pick:
        gap = max(scale * (scores[pick] - raw[token]), outside[token], 0.0)
        if request.temperature and request.top_p < 1:  # the nucleus's edge moves with the logits too
            gap = _least_error(row, token, request, step, gap)
    return token == pick, gap, scale * (scores[pick] - second) < window


def honest_bound(request, step: int, exact_row: np.ndarray, honest_row: np.ndarray, factor: float) -> float:
    """The largest gap a step may have at its own context (`recheck`): `factor` x max(the gap of an honest
    execution's token there, twice its largest top-10 log-probability error there): the budget's `max_gap` rule
    applied to this one context instead of the calibration sample's worst."""
    exact_row, honest_row = np.asarray(exact_row, np.float64), np.asarray(honest_row, np.float64)
    token = sampling.choose(honest_row, request.temperature, request.top_p, request.seed, step)
    _, gap, _ = _step(request, step, token, exact_row, 0.0)
    error = float(_logprob_errors(exact_row[None], honest_row[None])[0])
    return factor * max(gap, 2 * error)


def _least_error(row: np.ndarray, token: int, request, index: int, most: float, rounds: int = 24) -> float:
    """The least logit error under which `sampling.check` explains a sampled `token` (bisected up to `most`, an
    error that surely does: the pick's score lead and the distance below the nucleus's edge). An engine whose
    logits are off a little may leave the pick just outside its nucleus and take another token well behind it."""
    def explains(error: float) -> bool:
        return not sampling.check(row, token, request.temperature, request.top_p, request.seed, index, error)
    low, high = 0.0, most
    while not explains(high) and high < 1e6:
        low, high = high, 2 * high + 1.0
    for _ in range(rounds):
        middle = (low + high) / 2
        low, high = (low, middle) if explains(middle) else (middle, high)
    return high


def _scores(row: np.ndarray, temperature: float, top_p: float, seed: int, index: int):
    """The rule's scores over the vocabulary (greedy: the logits; sampled: logits / T + Gumbel noise, -inf outside
    the nucleus), the same without the nucleus, and per token how far (logits) it lies below the nucleus's edge
    (0 inside): an engine that took a token outside the nucleus had its logits off by at least that much."""
    if temperature == 0:
        return row, row, np.zeros_like(row)
    scaled = row / temperature
    raw = scaled + sampling.gumbel(seed, index, len(row))
    if top_p >= 1:
        return raw, raw, np.zeros_like(row)
    inside = sampling.preceding_mass(scaled) < top_p
    edge = row[inside].min()
    return np.where(inside, raw, -math.inf), raw, np.where(inside, 0.0, edge - row)


# ---------------------------------------------------------------------------------------------- a tally
@dataclass(frozen=True)
class Figures:
    """What an engine lost, over the requests of a tally (see the module); `to_dict` is what records carry."""

    steps: int
    requests: int
    agreement: float
    agreement_ci: tuple[float, float]
    mean_gap: float
    mean_gap_ci: tuple[float, float]
    max_gap: float
    max_gap_at: str
    ties: int
    tie_flips: int
    tie_p: float

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}


class Tally:
    """Marks of the requests scored so far (one evaluation's, or a replica's running estimate)."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.requests: dict[str, Marks] = {}
        # (request name, step) -> the largest gap an honest execution of that step's own context allows
        # (`Budget.recheck`): computed once, for the steps past the budget's largest gap
        self.rechecked: dict[tuple[str, int], float] = {}

    def add(self, name: str, marks: Marks) -> None:
        """A request's marks (`name`: how messages call it); a request marked again replaces its earlier prefix."""
        if len(marks.agree):
            self.requests[name] = marks

    def score(self, request, tokens: Sequence[int], rows: np.ndarray, name: str = "") -> None:
        self.add(name or f"request {request.id}", mark(request, tokens, rows, self.window))

    @property
    def steps(self) -> int:
        return sum(len(m.agree) for m in self.requests.values())

    def figures(self) -> Figures:
        marks = list(self.requests.values())
        steps = self.steps
        if not steps:
            return Figures(0, 0, math.nan, (math.nan, math.nan), math.nan, (math.nan, math.nan), math.nan, "", 0, 0, 1.0)
        agreed = sum(int(m.agree.sum()) for m in marks)
        sums = np.array([float(m.gap.sum()) for m in marks])
        counts = np.array([len(m.gap) for m in marks], dtype=float)
        mean = float(sums.sum() / steps)
        worst_name, worst = max(((n, m) for n, m in self.requests.items()), key=lambda nm: float(nm[1].gap.max()))
        ties = sum(int(m.tie.sum()) for m in marks)
        flips = sum(int((m.tie & ~m.agree).sum()) for m in marks)
        return Figures(steps, len(marks), agreed / steps, wilson(agreed, steps), mean,
                       clustered_interval(sums, counts), float(worst.gap.max()),
                       f"{worst_name} step {int(worst.gap.argmax())}", ties, flips, binomial_tail(flips, ties, 0.5))


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion."""
    if n == 0:
        return (math.nan, math.nan)
    p = successes / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low, high = (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)
    return (max(0.0, min(low, p)), min(1.0, max(high, p)))  # rounding never leaves p outside its interval


def clustered_interval(sums: np.ndarray, counts: np.ndarray, z: float = Z95) -> tuple[float, float]:
    """A 95% interval of the ratio sum(sums) / sum(counts) with requests as clusters (the linearised variance of
    a ratio estimator): steps of one request are not independent draws. Infinite gaps give (inf, inf)."""
    total, mean = counts.sum(), sums.sum() / counts.sum()
    if not math.isfinite(mean):
        return (mean, mean)
    k = len(sums)
    if k < 2:
        return (0.0, math.inf)
    spread = math.sqrt(k / (k - 1) * float(((sums - mean * counts) ** 2).sum())) / total
    return (max(0.0, float(mean - z * spread)), float(mean + z * spread))


@functools.lru_cache(maxsize=1 << 16)  # Serve re-judges a window of thousands of requests after every check
def binomial_tail(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) >= k)."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0:
        return 0.0
    if p >= 1:
        return 1.0
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * math.log(p)
            + (n - i) * math.log1p(-p) for i in range(k, n + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(x - top) for x in logs))


# ---------------------------------------------------------------------------------------------- the budget
@dataclass(frozen=True)
class Budget:
    """The loss an engine may have (see the module), and where the bounds come from (`basis`)."""

    min_agreement: float
    max_mean_gap: float
    max_gap: float
    tie_window: float
    tie_alpha: float = 1e-3
    request_alpha: float = 1e-3
    basis: str = "config"
    # (longest context, largest gap) per band of short contexts, shortest first: a step whose row reads at most
    # that many tokens may lie that far below the pick (never less than max_gap); longer contexts: max_gap
    short_max_gap: tuple[tuple[int, float], ...] = ()
    # a calibrated max_gap: a step past it is held instead to `factor` x an honest `recheck` execution of its own
    # context (computed by the judge: `recheck`, `honest_bound`), at most MAX_RECHECKS new steps per judgement;
    # "": max_gap holds at every step (the config set it)
    recheck: str = ""
    factor: float = 2.0

    def largest_gaps(self, context: np.ndarray | None, steps: int) -> np.ndarray:
        """The largest gap each of `steps` steps reading `context` tokens may have (None: max_gap at each)."""
        allowed = np.full(steps, self.max_gap)
        if context is None:
            return allowed
        for longest, gap in reversed(self.short_max_gap):  # shortest band last: it wins where bands nest
            allowed[np.asarray(context) <= longest] = max(self.max_gap, gap)
        return allowed

    def breach(self, tally: Tally) -> str:
        """Why the tally breaks the budget (with 95% confidence for the averages; every step for the largest
        gap, its context's; Bonferroni over requests for one request's agreement), or ""."""
        f = tally.figures()
        if not f.steps:
            return ""
        over = self._largest_gap_breach(tally)
        if over:
            return over
        if f.agreement_ci[1] < self.min_agreement:
            return (f"top-1 agreement {_pct(f.agreement)} {_pct_ci(f.agreement_ci)} over {f.steps} steps, below the "
                    f"budget's {_pct(self.min_agreement)} with 95% confidence")
        if f.mean_gap_ci[0] > self.max_mean_gap:
            return (f"mean gap {f.mean_gap:.3g} [{f.mean_gap_ci[0]:.3g}, {f.mean_gap_ci[1]:.3g}] logits per token, "
                    f"over the budget's {self.max_mean_gap:.3g} with 95% confidence")
        if f.tie_p < self.tie_alpha:
            return (f"near ties steered: a token other than the reference's pick in {f.tie_flips} of {f.ties} near "
                    f"ties (runner-up within {self.tie_window:.3g}); an honest engine takes each at most half the "
                    f"time: p = {f.tie_p:.2g} < {self.tie_alpha:g}")
        return self._request_breach(tally)

    def allowed_gaps(self, tally: Tally, name: str, marks: Marks) -> np.ndarray:
        """The largest gap each of a request's steps may have: its context's band, or what an honest execution of
        its own context allows where the judge rechecked it."""
        allowed = self.largest_gaps(marks.context, len(marks.gap))
        for (other, step), bound in tally.rechecked.items():
            if other == name and step < len(allowed):
                allowed[step] = max(allowed[step], bound)
        return allowed

    def over_largest_gap(self, tally: Tally) -> list[tuple[str, int]]:
        """The (request, step)s past their largest gap and not yet rechecked, the furthest past first."""
        over = []
        for name, marks in tally.requests.items():
            excess = marks.gap - self.allowed_gaps(tally, name, marks)
            over += [(float(excess[s]), name, int(s)) for s in np.flatnonzero(excess > 0)
                     if (name, int(s)) not in tally.rechecked]
        return [(name, step) for _, name, step in sorted(over, reverse=True)]

    def _largest_gap_breach(self, tally: Tally) -> str:
        """The step furthest past its context's largest gap, named, or ""."""
        worst, excess = "", 0.0
        for name, marks in tally.requests.items():
            allowed = self.allowed_gaps(tally, name, marks)
            step = int(np.argmax(marks.gap - allowed))
            if marks.gap[step] - allowed[step] > excess:
                excess = float(marks.gap[step] - allowed[step])
                where = f" at a context of {int(marks.context[step])} tokens" if marks.context is not None else ""
                why = (f" (rechecked against an honest {self.recheck} execution of its context)"
                       if (name, step) in tally.rechecked else "")
                worst = (f"{name} step {step}: a token {marks.gap[step]:.4g} logits below the reference's pick, beyond "
                         f"the budget's largest gap {allowed[step]:.4g}{where}{why}")
        return worst

    def _request_breach(self, tally: Tally) -> str:
        miss = 1.0 - self.min_agreement
        worst, worst_p = "", 1.0
        for name, marks in tally.requests.items():
            wrong = int((~marks.agree).sum())
            p = binomial_tail(wrong, len(marks.agree), miss)
            if p < worst_p:
                worst, worst_p = f"{name}: {wrong} of {len(marks.agree)} tokens not the reference's pick", p
        if worst_p < self.request_alpha / len(tally.requests):
            return (f"{worst}: p = {worst_p:.2g} under the budget's {_pct(self.min_agreement)} agreement, below "
                    f"{self.request_alpha:g} / {len(tally.requests)} requests: the loss is not spread over requests")
        return ""

    def to_dict(self) -> dict:
        return {**asdict(self), "short_max_gap": [list(band) for band in self.short_max_gap]}


def recheck(tally: Tally, budget: Budget, exact_row, honest_row) -> None:
    """Hold the steps past the budget's largest gap (at most MAX_RECHECKS new ones a call, the furthest past first) to
    what an honest execution of each one's own context allows (`honest_bound`), recorded in `tally.rechecked`.
    `exact_row(prompt, context)` / `honest_row(prompt, context)`: the float64 reference's / the honest `recheck`
    execution's row predicting context[-1] from the prompt and the tokens before it.

    Why: `max_gap` is factor x the worst of the calibration sample's rows, but it bounds every step of every
    evaluation, and an honest execution's logit error has a heavy tail in rare ill-conditioned contexts
    (docs/evidence.md, "The largest gap"). Computed by the judge, on the engine's own context, so no engine can
    move it; a step's bound only widens where honest arithmetic at that precision is that far off there too."""
    tally.rechecked = {key: bound for key, bound in tally.rechecked.items()
                       if key[0] in tally.requests}  # not the requests the tally let go of
    for name, step in budget.over_largest_gap(tally)[:MAX_RECHECKS]:
        source = tally.requests[name].source
        if source is None:  # marks without their request (context unknown): max_gap holds
            continue
        request, tokens = source
        context = list(tokens[:step + 1])  # row `step` predicts tokens[step] from the prompt and the tokens before
        tally.rechecked[(name, step)] = honest_bound(request, step, exact_row(request.prompt, context),
                                                     honest_row(request.prompt, context), budget.factor)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _pct_ci(ci: Sequence[float]) -> str:
    return f"[{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


# ---------------------------------------------------------------------------------------------- the contract
DEFAULT_FACTOR = 2.0
# steps past the calibrated largest gap the judge rechecks per judgement of a tally (an honest execution of each
# one's context; a judgement's cost bound): an honest engine's tail is a step or two per evaluation, or per Serve
# check; past this many in one judgement, the rest are held to max_gap
MAX_RECHECKS = 8


@dataclass(frozen=True)
class AccuracyContract:
    """A run's mode and, in budget mode, its budget."""

    mode: str = "exact"
    budget: Budget | None = None

    def window(self, tolerance: float) -> float:
        """The near-tie window the figures count ties in: the budget's, else (exact) the tie tolerance."""
        return self.budget.tie_window if self.budget is not None else tolerance

    def to_dict(self) -> dict:
        return {"mode": self.mode, **({"budget": self.budget.to_dict()} if self.budget else {})}


def resolve(accuracy: Mapping, workload, preset) -> AccuracyContract:
    """The run's contract from `evaluator.accuracy` (see the module): the mode defaults to `exact` at a float32
    or float64 preset and `budget` at a lower precision; a budget's bounds are the config's, any left out
    calibrated against an honest execution `against` (default: the preset's dtype, else bfloat16) times `factor`.
    ValueError names what is missing."""
    accuracy = dict(accuracy or {})
    if accuracy_mode(accuracy, preset.dtype) == "exact":
        return AccuracyContract("exact", None)
    given = {k: float(accuracy[k]) for k in BUDGET_KEYS if k in accuracy}
    if not {"min_agreement", "max_mean_gap", "max_gap"} <= set(given):
        against = accuracy.get("against") or (preset.dtype if preset.dtype not in ("float32", "float64") else "bfloat16")
        factor = float(accuracy.get("factor", DEFAULT_FACTOR))
        try:
            calibrated = calibrate(workload, preset, against, factor)
        except NotImplementedError as exc:
            raise ValueError(f"evaluator.accuracy: mode budget needs min_agreement, max_mean_gap and max_gap, or a "
                             f"workload that can calibrate them ({exc})") from exc
        # a max_gap the config sets holds at every context; a calibrated one keeps its short contexts' bands
        bands = () if "max_gap" in given else calibrated.short_max_gap
        recheck = "" if "max_gap" in given else against
        given = {**{k: v for k, v in asdict(calibrated).items() if k in BUDGET_KEYS}, **given}
        basis = calibrated.basis + (f"; set in the config: {sorted(set(accuracy) & set(BUDGET_KEYS))}"
                                    if set(accuracy) & set(BUDGET_KEYS) else "")
    else:
        basis, bands, recheck, factor = "config", (), "", DEFAULT_FACTOR
    given.setdefault("tie_window", given["max_gap"])
    return AccuracyContract("budget", Budget(**given, basis=basis, short_max_gap=bands, recheck=recheck, factor=factor))


# ---------------------------------------------------------------------------------------------- calibration
CALIBRATION_SEQUENCES = 16
CALIBRATION_SEED = 20261205  # fixed: every evaluator and every replica computes the same budget
# Bands of short contexts (the longest of each) whose largest gap is calibrated apart, from SHORT_SEQUENCES
# sequences of SHORT_CONTEXTS[-1] tokens scored from their first: a row per context each. An honest bfloat16
# SmolLM2-135M over 64 draws of random tokens: its picks up to 3.5 logits below float64's at a context of two
# tokens (top-10 log-probabilities off by up to 18.8), 0.52 at three, 0.07-0.16 from four to 64.
SHORT_CONTEXTS = (1, 2, 4, 8)
SHORT_SEQUENCES = 64


def calibrate(workload, preset, dtype: str, factor: float) -> Budget:
    """A budget `factor` times an honest `dtype` execution's loss (see the module): over fixed random sequences of
    the preset's longest length, every row of the reference computed in `dtype` teacher-forced against float64,
    its argmax taken as an engine's greedy token. NotImplementedError: the workload has no `honest_logits`."""
    return _calibrated(workload, preset, dtype, float(factor))


_CALIBRATIONS: dict[tuple, Budget] = {}


def _calibrated(workload, preset, dtype: str, factor: float) -> Budget:
    key = (workload.name, preset.name, repr(preset), dtype, factor)
    if key not in _CALIBRATIONS:
        _CALIBRATIONS[key] = _measure(workload, preset, dtype, factor)
    return _CALIBRATIONS[key]


def _measure(workload, preset, dtype: str, factor: float) -> Budget:
    rng = np.random.default_rng(CALIBRATION_SEED)
    vocab, prompt_len = int(preset.shape["V"]), max(1, int(preset.shape["P"]) // 2)
    length = min(int(preset.shape["P"]) + int(preset.shape["N"]), 2 * prompt_len + 16)
    tally, errors = Tally(math.inf), []
    for i in range(CALIBRATION_SEQUENCES):
        seq = rng.integers(0, vocab, size=length).tolist()
        prompt, rest = seq[:prompt_len], seq[prompt_len:]
        exact = workload.reference_logits(preset, prompt, rest)
        honest = workload.honest_logits(preset, prompt, rest, dtype)
        tally.score(_Greedy(i), np.argmax(honest, axis=1).tolist(), exact, name=f"sequence {i}")
        errors.append(_logprob_errors(exact, honest))
    bands = _short_bands(workload, preset, dtype, factor, rng)
    f, errors = tally.figures(), np.concatenate(errors)
    typical, tail, largest = (float(np.quantile(errors, q)) for q in (0.5, 0.99, 1.0))
    miss = max(1.0 - f.agreement, 1.0 / f.steps)  # no flip seen still allows the rate one in the sample implies
    return Budget(min_agreement=max(0.0, 1.0 - factor * miss),
                  max_mean_gap=factor * max(f.mean_gap, 2 * largest / f.steps),  # no flip seen: still one at 2E
                  # a pair of logits each off by the 99th percentile's error flips a tie that wide
                  max_gap=factor * max(f.max_gap, 2 * tail),
                  # where an honest execution's rounding flips most ties (twice its typical error): a narrow window
                  # is where steering shows most (an MoE routing flip's rare large errors would blur it)
                  tie_window=2 * typical,
                  basis=(f"calibrated: {factor:g} x an honest {dtype} execution of the reference over "
                         f"{CALIBRATION_SEQUENCES} sequences, {f.steps} rows: agreement {_pct(f.agreement)}, mean gap "
                         f"{f.mean_gap:.3g}, largest gap {f.max_gap:.3g}; log-probability error of a top-10 token: "
                         f"median {typical:.3g}, 99th percentile {tail:.3g}, largest {largest:.3g}; contexts of "
                         + ", ".join(f"<= {n} tokens: largest gap {g:.3g}" for n, g in bands)
                         + f" ({SHORT_SEQUENCES} sequences)"),
                  short_max_gap=bands)


def _short_bands(workload, preset, dtype: str, factor: float, rng: np.random.Generator
                 ) -> tuple[tuple[int, float], ...]:
    """(longest context, largest gap) per band of `SHORT_CONTEXTS`: factor x max(the honest execution's largest
    gap there, twice the 99th percentile of its top-10 log-probability error there), as `max_gap` is for long
    contexts."""
    vocab, longest = int(preset.shape["V"]), min(SHORT_CONTEXTS[-1], int(preset.shape["P"]) + int(preset.shape["N"]) - 1)
    gaps, errors = [], []
    for i in range(SHORT_SEQUENCES):
        seq = rng.integers(0, vocab, size=longest + 1).tolist()
        prompt, rest = seq[:1], seq[1:]
        exact = workload.reference_logits(preset, prompt, rest)
        honest = workload.honest_logits(preset, prompt, rest, dtype)
        gaps.append(mark(_Greedy(i), np.argmax(honest, axis=1).tolist(), exact, math.inf).gap)
        errors.append(_logprob_errors(exact, honest))
    gaps, errors = np.stack(gaps), np.stack(errors)  # [sequence, context - 1]
    bands, shortest = [], 1
    for top in SHORT_CONTEXTS:
        if top > longest:
            break
        columns = slice(shortest - 1, top)
        bands.append((top, factor * max(float(gaps[:, columns].max()), 2 * float(np.quantile(errors[:, columns], 0.99)))))
        shortest = top + 1
    return tuple(bands)


@dataclass(frozen=True)
class _Greedy:
    """A calibration sequence as a greedy request (what `mark` reads of a request)."""

    id: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


def _logprob_errors(exact: np.ndarray, honest: np.ndarray, top: int = 10) -> np.ndarray:
    """Per row, the largest |log-probability error| among the float64 top-`top` tokens."""
    def logsoftmax(x):
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    k = min(top, exact.shape[1])
    idx = np.argpartition(-exact, k - 1, axis=1)[:, :k]
    diff = np.take_along_axis(logsoftmax(exact), idx, 1) - np.take_along_axis(logsoftmax(honest), idx, 1)
    return np.abs(diff).max(axis=1)
