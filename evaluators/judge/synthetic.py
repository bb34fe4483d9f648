"""A deterministic stand-in evaluator for testing the search without timing anything.

Like Kernel Tuner's simulation runner: the "latency" of a genome is a fixed function of its genes,
and a fixed fraction of genomes (chosen by hash) fail with each failure status. Same genome, same
result, in any process: so search invariants (budget, best never worse, same seed same proposals)
can be tested exactly. It is never used to judge a real engine.
"""
from __future__ import annotations

import hashlib

from evo.core.genome import Genome
from evo.core.records import BUILD_ERROR, INCORRECT, OK, RUNTIME_ERROR, EvalResult


def _unit(text: str) -> float:
    """A number in [0, 1) fixed by `text`."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") / 2**64


class SyntheticEvaluator:
    def __init__(self, name: str = "synthetic-0", failure_rate: float = 0.2) -> None:
        self.name = name
        self.failure_rate = failure_rate
        self.calls: list[str] = []  # hashes evaluated, in order

    def evaluate(self, genome_json: str) -> EvalResult:
        genome = Genome.from_json(genome_json)
        self.calls.append(genome.hash)
        fate = _unit("fate:" + genome.hash)
        if fate < self.failure_rate:
            status = (INCORRECT, BUILD_ERROR, RUNTIME_ERROR)[int(fate / self.failure_rate * 3)]
            return EvalResult(genome.hash, status, message=f"synthetic {status}", evaluator=self.name)
        # Each (gene, value) adds a fixed cost: a smooth landscape agents can learn.
        latency = 1.0 + sum(5.0 * _unit(f"{k}={v}") for k, v in sorted(genome.values().items()))
        return EvalResult(genome.hash, OK, latency_ms=latency, latency_spread_ms=0.0,
                          max_rel_error=0.0, device="synthetic", threads=1, evaluator=self.name)

    def evaluate_baseline(self, baseline: str) -> EvalResult:
        latency = 20.0 + 10.0 * _unit("baseline:" + baseline)
        return EvalResult(f"baseline:{baseline}", OK, latency_ms=latency, latency_spread_ms=0.0,
                          device="synthetic", threads=1, evaluator=self.name)
