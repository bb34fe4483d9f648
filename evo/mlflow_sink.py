"""Evidence in MLflow: a parent run per search, a nested child run per generation.

Only the driver writes (one writer per store). Parent run: the flattened config as params, the
baselines and roofline floor, per-generation metrics by step (best latency, median, fraction valid,
evaluations per second, best speedup) and, at the end, the summary and best genome as artifacts.
Child run per generation: its metrics, its Parquet evidence as an artifact, lineage tags.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from evo.records import EvalResult
from evo.search import GenerationReport, Search
from evo.summary import best_baseline

MAX_BATCH = 100  # MLflow accepts at most 100 params/tags per log_batch


def tracking_uri(configured: str | None) -> str:
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(data, dict):
        out: dict[str, str] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): json.dumps(data) if isinstance(data, (list, tuple)) else str(data)}


class MlflowSink:
    def __init__(self, uri: str, experiment: str, run_name: str, config: dict, tags: dict[str, str]) -> None:
        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        found = self.client.get_experiment_by_name(experiment)
        self.experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        self.run_id = run.info.run_id
        params = [Param(k, v[:6000]) for k, v in flatten(config).items()]
        for i in range(0, len(params), MAX_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MAX_BATCH])
        self.baseline_ms = math.nan
        self.child_runs: list[str] = []

    def log_baselines(self, baselines: dict[str, EvalResult], floor_ms: float | None) -> None:
        now = _now()
        metrics = [Metric(f"baseline_{name}_ms", r.latency_ms, now, 0) for name, r in baselines.items() if r.ok]
        if floor_ms is not None:
            metrics.append(Metric("roofline_floor_ms", floor_ms, now, 0))
        tags = [RunTag(f"baseline.{name}.status", r.status) for name, r in baselines.items()]
        top = best_baseline(baselines)
        if top:
            self.baseline_ms = top[1].latency_ms
            metrics.append(Metric("best_baseline_ms", self.baseline_ms, now, 0))
            tags.append(RunTag("best_baseline", top[0]))
        self.client.log_batch(self.run_id, metrics=metrics, tags=tags)

    def on_result(self, evaluated) -> None:
        pass  # results reach MLflow per generation, after the Parquet file is on disk

    def on_generation(self, report: GenerationReport, search: Search, parquet: Path | None = None) -> None:
        step, now = report.generation, _now()
        values = {
            "best_latency_ms": report.best_latency_ms,
            "median_latency_ms": report.median_latency_ms,
            "fraction_valid": report.fraction_valid,
            "evaluations": float(report.evaluations),
            "evals_per_s": report.evals_per_s,
            "best_speedup": self.baseline_ms / report.best_latency_ms,
        }
        metrics = [Metric(k, v, now, step) for k, v in values.items() if math.isfinite(v)]
        metrics += [Metric(f"count_{s}", float(n), now, step) for s, n in report.status_counts.items()]
        self.client.log_batch(self.run_id, metrics=metrics)
        child = self.client.create_run(self.experiment_id, run_name=f"generation-{step:03d}", tags={
            "mlflow.parentRunId": self.run_id,
            "generation": str(step),
            "best_hash": report.best.proposal.hash if report.best else "",
            "best_parents": ",".join(report.best.proposal.parents) if report.best else "",
            "best_agent": report.best.proposal.agent if report.best else "",
            "agents": json.dumps(sorted({e.proposal.agent for e in report.evaluated})),
        })
        child_id = child.info.run_id
        self.client.log_batch(child_id, metrics=[Metric(k, v, now, step) for k, v in values.items() if math.isfinite(v)],
                              params=[Param("generation", str(step)), Param("candidates", str(len(report.evaluated)))])
        if parquet is not None:
            self.client.log_artifact(child_id, str(parquet), artifact_path="evidence")
        self.client.set_terminated(child_id, "FINISHED")
        self.child_runs.append(child_id)

    def finish(self, summary: dict, run_dir: Path, status: str = "FINISHED") -> None:
        now = _now()
        final = {"final_best_latency_ms": summary.get("best_latency_ms"),
                 "speedup_vs_best_baseline": summary.get("speedup_vs_best_baseline")}
        final.update({f"speedup_vs_{name}": v for name, v in summary.get("speedups", {}).items()})
        roofline = summary.get("roofline") or {}
        final["fraction_of_roofline"] = roofline.get("fraction_of_floor")
        metrics = [Metric(k, float(v), now, 0) for k, v in final.items() if v is not None and math.isfinite(v)]
        tags = [RunTag("best_hash", str(summary.get("best_hash"))), RunTag("run_dir", str(run_dir))]
        self.client.log_batch(self.run_id, metrics=metrics, tags=tags)
        for name in ("summary.json", "best_genome.json", "baselines.json", "config.yaml"):
            if (run_dir / name).exists():
                self.client.log_artifact(self.run_id, str(run_dir / name))
        self.client.set_terminated(self.run_id, status)


def _now() -> int:
    return int(time.time() * 1000)
