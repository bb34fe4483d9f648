"""Per-gene effect estimates from every result: what each gene value does to latency and to failures.

For every (gene, value) the model keeps how often it was evaluated and how often the result was not
`ok` (by status, with the commonest failure messages). Latency effects come from a Bayesian linear
model of log-latency on one-hot gene values, fitted to every `ok` result: each value's effect is
its contribution with the other genes accounted for (+0.10: about 10% slower), so a value is not
credited for the company it keeps in good genomes. Agents score a candidate child against its
parent with one Thompson draw from that posterior plus the values' failure rates, so moves toward
values that were slow or failed are drawn less often while values seen rarely keep a chance.
Pure: no Ray, no MLflow, no torch.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from evo.core.genome import Genome, Scalar
from evo.core.records import Evaluated

FORMAT = 1
FAILURE_COST = 2.0  # what a certain failure costs, in spreads of log-latency (two: about a bad engine)
_FAIL_PSEUDO = 10.0  # results at the overall failure rate added to each value's count
_PRIOR_SD = 0.3  # log-latency spread assumed before any evidence (about +-30%)
_FAIL_PRIOR = (0.5, 2.0)  # Beta prior of a value's failure rate: mean 0.2, weak
_MESSAGES_KEPT = 3
_ROWS_KEPT = 300  # ok results kept for the latency model (the newest; lessons stay small)


def value_key(value: Scalar) -> str:
    """A gene value as a stable string key (JSON spelling: true, 16, "eager" -> eager)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def message_kind(message: str) -> str:
    """A failure message with numbers and hashes blanked, so failures of one kind count together."""
    text = re.sub(r"[0-9a-f]{8,}", "#", message.splitlines()[0] if message else "")
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", text)[:100]


@dataclass
class ValueEvidence:
    """What the results say about one value of one gene."""

    tries: int = 0
    ok: int = 0
    log_sum: float = 0.0  # sum of log(latency_ms) over ok results
    failures: dict[str, int] = field(default_factory=dict)  # status -> count
    messages: dict[str, int] = field(default_factory=dict)  # message kind -> count (the commonest kept)

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def to_dict(self) -> dict[str, Any]:
        return {"tries": self.tries, "ok": self.ok, "log_sum": self.log_sum, "failures": dict(self.failures),
                "messages": dict(self.messages)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ValueEvidence:
        return cls(int(data["tries"]), int(data["ok"]), float(data["log_sum"]), dict(data.get("failures", {})),
                   dict(data.get("messages", {})))


class GeneEffects:
    """The evidence model shared by the agents of a search (owned by `evo.core.search.Search`)."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, ValueEvidence]] = {}  # gene -> value key -> evidence
        self.rows: list[tuple[dict[str, str], float]] = []  # (gene -> value key, log latency) of ok results
        self._posterior: tuple | None = None  # cached fit, dropped when a result arrives
        self.ok = 0
        self.log_sum = 0.0
        self.log_sq = 0.0
        self.results = 0

    # -- learning -------------------------------------------------------------------------------
    def observe(self, items: Iterable[Evaluated]) -> None:
        """Count results (callers pass them in a fixed order: sums are then identical on replay)."""
        for item in items:
            self.add(item.proposal.genome, item.result.status, item.result.latency_ms, item.result.message)

    def add(self, genome: Genome, status: str, latency_ms: float, message: str = "") -> None:
        ok = status == "ok" and math.isfinite(latency_ms) and latency_ms > 0
        log_latency = math.log(latency_ms) if ok else 0.0
        self.results += 1
        if ok:
            self.ok += 1
            self.log_sum += log_latency
            self.log_sq += log_latency * log_latency
            self.rows.append(({g: value_key(v) for g, v in genome.values().items()}, log_latency))
            del self.rows[:-_ROWS_KEPT]
            self._posterior = None
        for gene, value in genome.values().items():
            ev = self.values.setdefault(gene, {}).setdefault(value_key(value), ValueEvidence())
            ev.tries += 1
            if ok:
                ev.ok += 1
                ev.log_sum += log_latency
            else:
                ev.failures[status] = ev.failures.get(status, 0) + 1
                kind = message_kind(message)
                if kind:
                    ev.messages[kind] = ev.messages.get(kind, 0) + 1
                    if len(ev.messages) > _MESSAGES_KEPT:  # keep the commonest few: lessons stay small
                        del ev.messages[min(ev.messages, key=lambda k: (ev.messages[k], k))]

    def merge(self, other: GeneEffects, weight: float = 1.0) -> None:
        """Add another model's evidence (a warm start's), its counts scaled by `weight`."""
        def scaled(n: float) -> int:
            return int(round(n * weight))

        self.rows = (other.rows + self.rows)[-_ROWS_KEPT:]
        self._posterior = None
        self.ok += scaled(other.ok)
        self.results += scaled(other.results)
        self.log_sum += other.log_sum * weight
        self.log_sq += other.log_sq * weight
        for gene, values in other.values.items():
            for key, ev in values.items():
                mine = self.values.setdefault(gene, {}).setdefault(key, ValueEvidence())
                mine.tries += scaled(ev.tries)
                mine.ok += scaled(ev.ok)
                mine.log_sum += ev.log_sum * weight
                for status, n in ev.failures.items():
                    mine.failures[status] = mine.failures.get(status, 0) + scaled(n)
                for kind, n in ev.messages.items():
                    mine.messages[kind] = mine.messages.get(kind, 0) + scaled(n)

    # -- estimates ------------------------------------------------------------------------------
    @property
    def mean_log(self) -> float:
        return self.log_sum / self.ok if self.ok else 0.0

    @property
    def spread(self) -> float:
        """Standard deviation of log-latency over ok results (a prior value until there are a few)."""
        if self.ok < 3:
            return _PRIOR_SD
        var = self.log_sq / self.ok - self.mean_log ** 2
        return max(math.sqrt(max(var, 0.0)), 0.02)

    def _fit(self) -> tuple[list[tuple[str, str]], np.ndarray, np.ndarray]:
        """Posterior of the per-value effects: (features, mean, Cholesky factor of the covariance)."""
        if self._posterior is None:
            features = sorted({(g, k) for values, _ in self.rows for g, k in values.items()})
            index = {f: i for i, f in enumerate(features)}
            x = np.zeros((len(self.rows), len(features)))
            for r, (values, _) in enumerate(self.rows):
                for g, k in values.items():
                    x[r, index[(g, k)]] = 1.0
            y = np.array([lat for _, lat in self.rows]) - self.mean_log
            tau = max(self.spread, 0.1)  # prior sd of one value's effect
            sigma = max(0.5 * self.spread, 0.03)  # noise sd of one measurement (log units)
            precision = x.T @ x / sigma ** 2 + np.eye(len(features)) / tau ** 2
            cov = np.linalg.inv(precision)
            mean = cov @ x.T @ y / sigma ** 2
            chol = np.linalg.cholesky(cov + 1e-12 * np.eye(len(features)))
            self._posterior = (features, mean, chol)
        return self._posterior

    def evidence(self, gene: str, value: Scalar) -> ValueEvidence | None:
        """What the results say about this value of this gene; None when no result had it."""
        return self.values.get(gene, {}).get(value_key(value))

    def effect(self, gene: str, value: Scalar) -> tuple[float, int]:
        """(posterior mean effect of this value on log-latency, the other genes accounted for; ok results)."""
        ev = self.evidence(gene, value)
        if ev is None or ev.ok == 0 or not self.rows:
            return 0.0, 0
        features, mean, _ = self._fit()
        key = (gene, value_key(value))
        return (float(mean[features.index(key)]) if key in features else 0.0), ev.ok

    def failure_rate(self, gene: str, value: Scalar) -> float:
        """Failure rate of genomes with this value, shrunk toward the overall rate by `_FAIL_PSEUDO`
        results, so a value must fail clearly more often than the rest before it is avoided."""
        overall = (self.results - self.ok + _FAIL_PRIOR[0]) / (self.results + sum(_FAIL_PRIOR))
        ev = self.evidence(gene, value)
        failed, tries = (ev.failed, ev.tries) if ev else (0, 0)
        return (failed + _FAIL_PSEUDO * overall) / (tries + _FAIL_PSEUDO)

    def draw(self, rng: np.random.Generator) -> Callable[[str, Scalar], float]:
        """One Thompson draw: (gene, value) -> sampled effect on log-latency plus `FAILURE_COST` spreads
        times the value's failure rate. Values never seen in an ok result draw from the prior."""
        tau = max(self.spread, 0.1)
        cost = FAILURE_COST * self.spread
        if self.rows:
            features, mean, chol = self._fit()
            theta = dict(zip(features, mean + chol @ rng.standard_normal(len(features))))
        else:
            theta = {}
        unseen: dict[tuple[str, str], float] = {}

        def score(gene: str, value: Scalar) -> float:
            key = (gene, value_key(value))
            if key not in theta and key not in unseen:
                unseen[key] = float(rng.normal(0.0, tau))
            return theta.get(key, unseen.get(key, 0.0)) + cost * self.failure_rate(gene, value)

        return score

    def sample_score(self, rng: np.random.Generator, parent: Genome, child: Genome) -> float:
        """A Thompson draw of how much worse `child` is than `parent` (log-latency units; lower is better)."""
        score, old = self.draw(rng), parent.values()
        return sum(score(g, v) - score(g, old.get(g)) for g, v in child.values().items()
                   if not (old.get(g) == v and type(old.get(g)) is type(v)))

    # -- saved form -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "results": self.results, "ok": self.ok, "log_sum": self.log_sum,
                "log_sq": self.log_sq, "rows": [[v, lat] for v, lat in self.rows],
                "values": {g: {k: ev.to_dict() for k, ev in sorted(vs.items())} for g, vs in sorted(self.values.items())}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GeneEffects:
        if data.get("format") != FORMAT:
            raise ValueError(f"gene effects of format {data.get('format')!r}; this version reads format {FORMAT}")
        model = cls()
        model.results, model.ok = int(data["results"]), int(data["ok"])
        model.log_sum, model.log_sq = float(data["log_sum"]), float(data["log_sq"])
        model.values = {g: {k: ValueEvidence.from_dict(ev) for k, ev in vs.items()} for g, vs in data["values"].items()}
        model.rows = [(dict(v), float(lat)) for v, lat in data.get("rows", [])]
        return model

    def table(self) -> list[dict[str, Any]]:
        """One row per (gene, value), most evidence first: for lessons and logs, readable by a person."""
        rows = []
        for gene, values in sorted(self.values.items()):
            for key, ev in sorted(values.items()):
                effect, n = self.effect(gene, key) if ev.ok else (0.0, 0)
                rows.append({"gene": gene, "value": key, "results": ev.tries, "ok": n, "failed": ev.failed,
                             "latency_vs_mean_pct": round(100 * (math.exp(effect) - 1), 1) if n else None,
                             "failures": dict(ev.failures), "messages": dict(ev.messages)})
        return rows
