"""The record of an engine worth serving: its genome, the workload and preset it was searched for, the
sources of its code genes and what the search measured, its loss against the float64 reference included
(a generation engine's `accuracy`). A run's summary, a registered model and the Serve app all speak it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from evo.core.genome import Genome
from evo.core.records import null_for_nan
from evo.evidence.claims import best_accuracy, loss_mode, loss_words, pick_baseline, with_loss
from evo.evidence.summary import Summary

ENGINE_FILE = "engine.json"  # the model artifact: workload, preset, genome and the search's figures


class SourceError(ValueError):
    """An engine source that cannot be resolved; the message says what was given and what is accepted."""


@dataclass(frozen=True)
class EngineRecord:
    workload: str
    preset: str
    genome: Genome
    source: str
    latency_ms: float | None = None
    speedups: dict[str, float] = field(default_factory=dict)
    device: str = ""
    mlflow_run_id: str | None = None
    sources: dict[str, str] = field(default_factory=dict)  # code hash -> source of the genome's code genes
    # The run's final paired re-timing of this engine against each baseline (the `speedups` above and
    # `latency_ms` are single timings): baseline -> the paired estimate, and its 95% interval [low, high].
    speedup_paired: dict[str, float] = field(default_factory=dict)
    speedup_ci: dict[str, list[float]] = field(default_factory=dict)
    # A generation engine's loss against the float64 reference under its run's accuracy contract (mode, top-1
    # agreement, gaps, the budget: `EvalResult.accuracy`); empty for a call engine and for older records.
    accuracy: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        from evo.workloads import get_workload

        preset = get_workload(self.workload).presets()[self.preset]
        return {"workload": self.workload, "preset": self.preset, "genome": self.genome.to_dict(),
                "preset_spec": {"shape": dict(preset.shape), "dtype": preset.dtype, "device": preset.device},
                "hash": self.genome.hash, "source": self.source, "latency_ms": self.latency_ms,
                "speedups": self.speedups, "device": self.device, "mlflow_run_id": self.mlflow_run_id,
                "sources": dict(self.sources), "speedup_paired": dict(self.speedup_paired),
                "speedup_ci": {name: list(ci) for name, ci in self.speedup_ci.items()},
                "accuracy": null_for_nan(self.accuracy)}

    def claim(self) -> dict[str, Any] | None:
        """The headline of what the search measured, to be shown before any single number: the paired
        speedup with its 95% interval over the workload's reference baseline where the run re-timed it,
        else over the baseline whose paired speedup is smallest (the fastest baseline: the modest claim).
        Without a paired re-timing, the single timing's ratio with `paired: False` and no interval;
        None when nothing was measured against a baseline. A generation engine's claim carries its loss:
        `accuracy_mode` ('exact' or 'budget') and `loss` (`loss_words`), and its text ends with it; a call
        engine's has neither."""
        picked = pick_baseline(self.workload, self.speedup_paired, self.speedup_ci, self.speedups)
        if picked is None:
            return None
        vs, paired = picked
        loss = {"accuracy_mode": loss_mode(self.accuracy), "loss": loss_words(self.accuracy)} if self.accuracy else {}
        if paired:
            estimate, (low, high) = self.speedup_paired[vs], self.speedup_ci[vs]
            text = f"{estimate:.2f}x [{low:.2f}, {high:.2f}] vs {vs} (paired re-timing, 95% interval)"
            return {"speedup": round(estimate, 2), "low": round(low, 2), "high": round(high, 2), "vs": vs,
                    "paired": True, **loss, "text": with_loss(text, self.accuracy)}
        single = self.speedups[vs]
        text = f"{single:.2f}x vs {vs} (a single timing: no paired re-timing, no interval)"
        return {"speedup": round(single, 2), "low": None, "high": None, "vs": vs, "paired": False, **loss,
                "text": with_loss(text, self.accuracy)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> EngineRecord:
        return cls(workload=data["workload"], preset=data["preset"], genome=Genome.from_dict(data["genome"]),
                   source=source, latency_ms=data.get("latency_ms"), speedups=data.get("speedups") or {},
                   device=data.get("device", ""), mlflow_run_id=data.get("mlflow_run_id"),
                   sources=dict(data.get("sources") or {}), speedup_paired=dict(data.get("speedup_paired") or {}),
                   speedup_ci=dict(data.get("speedup_ci") or {}), accuracy=dict(data.get("accuracy") or {}))



def record_from_summary(summary: Summary, source: str) -> EngineRecord:
    """The best engine of a run's summary; SourceError when the run found none."""
    if not summary.found:
        raise SourceError(f"{source}: the run found no correct engine (summary.json has no best_genome)")
    return EngineRecord(workload=summary.workload, preset=summary.preset,
                        genome=Genome.from_dict(summary.best_genome), source=source,
                        latency_ms=summary.best_latency_ms if math.isfinite(summary.best_latency_ms) else None,
                        speedups=dict(summary.speedups),
                        device=summary.device, mlflow_run_id=summary.mlflow_run_id,
                        sources=dict(summary.best_sources), speedup_paired=dict(summary.speedup_paired),
                        speedup_ci=dict(summary.speedup_ci), accuracy=best_accuracy(summary))

