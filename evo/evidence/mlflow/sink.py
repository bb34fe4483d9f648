"""Evidence in MLflow: a parent run per search, a nested child run per generation.

Only the driver writes (one writer per store). Parent run: the flattened config as params, the
baselines and roofline floor, per-generation metrics by step (best latency, median, fraction valid,
evaluations per second, best speedup) and, at the end, the summary and best genome as artifacts, and
the best engine's loss: tag `accuracy_mode`, metrics `accuracy_agreement`, `accuracy_mean_gap`, `accuracy_max_gap`.
The parent run's description (`evo.evidence.mlflow.describe`) states the best engine, its speedups
and links to the lineage page. Child run per generation, spanning the generation's wall time: its
metrics, its Parquet evidence as an artifact, lineage tags (the best's, and
`candidate.NN.*` per candidate) and a candidates table (`candidates.json`). The lineage page and plots
(`evo.evidence.lineage_view`) reach the parent run through `log_lineage`.

Every write goes through an `Outbox` in the run directory, so an unreachable tracking store never
stops or slows the search: the evidence stays on disk, MLflow is backfilled when it answers again,
and whatever is still pending at the end can be replayed with `python -m evo mlflow-sync RUN_DIR`.
"""
from __future__ import annotations

import json
import logging
import math
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from evo.evidence.claims import best_accuracy, loss_mode, short_claim
from evo.evidence.lineage import CANDIDATES_FILE, candidate_table, candidate_tags, write_candidate_table
from evo.evidence.mlflow.describe import MODE_TAG, run_description
from evo.evidence.mlflow.links import run_url
from evo.evidence.mlflow.outbox import OUTBOX_FILE, Outbox, tracking_uri
from evo.core.records import EvalResult
from evo.core.search import GenerationReport, Search
from evo.evidence.sink import FINISHED, Sink
from evo.evidence.summary import Summary, best_baseline

MAX_BATCH = 100  # MLflow accepts at most 100 params/tags per log_batch
MAX_METRICS = 1000  # and at most 1000 metrics
log = logging.getLogger("evo.mlflow")
# The final metrics are named so the claims sort first where MLflow sorts metric names (the runs table's
# columns, the charts, run comparison; a run's Overview lists metrics in the order they were first logged):
# `a_paired_speedup_vs_<baseline>` with `.low95` / `.high95`, its 95% interval, before everything else, and the
# single timings labelled `single_timing_...`.
CLAIM = "a_paired_speedup_vs_"
SINGLE_TIMING = "single_timing_"
RUN_NAME_TAG = "mlflow.runName"  # set at the end: the run's name followed by its claim


def claim_metrics(baseline: str, estimate: float | None, low: float, high: float) -> dict[str, float | None]:
    """The paired speedup over `baseline` and its 95% interval as metrics (see CLAIM)."""
    return {f"{CLAIM}{baseline}": estimate, f"{CLAIM}{baseline}.low95": low, f"{CLAIM}{baseline}.high95": high}


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(data, dict):
        out: dict[str, str] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): json.dumps(data) if isinstance(data, (list, tuple)) else str(data)}


class MlflowSink:
    """Search sink that logs to MLflow through a durable outbox; no method raises because of MLflow.

    `run_dir` holds the outbox and the run ids (default: `tags["run_dir"]`; without either, a temporary
    directory, and nothing survives the process). `finish_wait_s` bounds how long `finish` retries a
    store that is down. Each sink names its runs under its own session, so a resumed search gets a new
    parent run while what the interrupted one left in the outbox is still replayed to the old one.
    """

    def __init__(self, uri: str, experiment: str, run_name: str, config: dict, tags: dict[str, str],
                 run_dir: Path | None = None, finish_wait_s: float = 30.0, request_timeout_s: float = 5.0) -> None:
        self.uri, self.run_name = uri, run_name
        run_dir = run_dir or tags.get("run_dir")
        self.run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="mlflow-outbox-"))
        self.outbox = Outbox(self.run_dir, uri, experiment, request_timeout_s)
        self.finish_wait_s = finish_wait_s
        self.baseline_ms = math.nan
        self.finished = False  # whether `finish` ran (the parent run is ended once)
        self.session = uuid.uuid4().hex[:8]
        self.parent = f"{self.session}/parent"
        now = _now()
        self.outbox.add({"op": "run", "ref": self.parent, "run_name": run_name, "tags": dict(tags), "start_time": now})
        params = {k: v[:6000] for k, v in flatten(config).items()}
        self._batch(self.parent, params=params)
        self.outbox.pump()

    @property
    def run_id(self) -> str | None:
        """The parent run's id, or None while MLflow has not yet been reached."""
        return self.outbox.run_id(self.parent)

    @property
    def experiment_id(self) -> str | None:
        return self.outbox.state.get("experiment_id")

    @property
    def run_url(self) -> str | None:
        """The parent run in the MLflow UI, on its runs view (evo.evidence.mlflow.links), once MLflow has it."""
        if not (self.run_id and self.experiment_id):
            return None
        return run_url(self.uri, self.experiment_id, self.run_id)

    @property
    def pending(self) -> int:
        return len(self.outbox.ops)

    def log_baselines(self, baselines: dict[str, EvalResult], floor_ms: float | None) -> None:
        now = _now()
        metrics = [(f"baseline_{name}_ms", r.latency_ms, now, 0) for name, r in baselines.items() if r.ok]
        if floor_ms is not None:
            metrics.append(("roofline_floor_ms", floor_ms, now, 0))
        # a baseline not compared is tagged with its status and why; those compared are named in one tag (the UI
        # shows every tag above the run's description: a tag per baseline would push its claim out of sight)
        tags = {f"baseline.{name}.status": r.status for name, r in baselines.items() if not r.ok}
        tags.update({f"baseline.{name}.message": f"{r.message[:500]}; not compared"  # why it has no metric
                     for name, r in baselines.items() if not r.ok})
        tags["baselines_compared"] = ", ".join(sorted(n for n, r in baselines.items() if r.ok)) or "none"
        top = best_baseline(baselines)
        if top:
            self.baseline_ms = top[1].latency_ms
            metrics.append(("best_baseline_ms", self.baseline_ms, now, 0))
            tags["best_baseline"] = top[0]
        self._batch(self.parent, metrics=metrics, tags=tags)
        self.outbox.pump()

    def on_generation(self, report: GenerationReport, search: Search, parquet: Path | None = None,
                      extra: list[tuple[Path, str]] = ()) -> None:
        """`extra`: more files of the run directory for this generation's run, with their artifact folders
        (the code agent's diffs, sources and prompt records, see evo.evidence.code_diffs)."""
        step, now, ref = report.generation, _now(), f"{self.session}/gen:{report.generation}"
        # the generation's run spans its real wall time (proposals, evaluations, re-timings), not this call
        started = now - int(1000 * report.wall_s) if math.isfinite(report.wall_s) and report.wall_s > 0 else now
        values = {
            "best_latency_ms": report.best_latency_ms,
            "median_latency_ms": report.median_latency_ms,
            "fraction_valid": report.fraction_valid,
            "evaluations": float(report.evaluations),
            "evals_per_s": report.evals_per_s,
            "best_speedup": self.baseline_ms / report.best_latency_ms,
        }
        if report.retimings:  # this generation's paired re-timings (intensification)
            verdicts = [t.verdict for t in report.retimings]
            values.update(retimings=float(len(verdicts)), retimings_faster=float(verdicts.count("faster")),
                          retimings_equal=float(verdicts.count("equal")),
                          retime_s=float(sum(t.wall_s for t in report.retimings if math.isfinite(t.wall_s))))
        metrics = [(k, v, now, step) for k, v in values.items() if math.isfinite(v)]
        counts = [(f"count_{s}", float(n), now, step) for s, n in report.status_counts.items()]
        self._batch(self.parent, metrics=metrics + counts)
        best = report.best
        self.outbox.add({"op": "run", "ref": ref, "parent": self.parent, "run_name": f"generation-{step:03d}",
                         "start_time": started, "tags": {
                             "generation": str(step),
                             "best_hash": best.proposal.hash if best else "",
                             "best_parents": ",".join(best.proposal.parents) if best else "",
                             "best_agent": best.proposal.agent if best else "",
                             "agents": json.dumps(sorted({e.proposal.agent for e in report.evaluated})),
                             # the candidates table below, shown by the UI like one `mlflow.log_table` wrote
                             "mlflow.loggedArtifacts": json.dumps([{"path": CANDIDATES_FILE, "type": "table"}]),
                         }})
        table = candidate_table(report.evaluated, search.known)
        self._batch(ref, metrics=metrics, tags=candidate_tags(table),
                    params={"generation": str(step), "candidates": str(len(report.evaluated))})
        if parquet is not None:
            self._artifact(ref, Path(parquet), "evidence")
        for path, folder in extra:
            self._artifact(ref, Path(path), folder)
        self._artifact(ref, write_candidate_table(table, self.run_dir / "lineage" / f"gen_{step:04d}" / CANDIDATES_FILE), None)
        self.outbox.add({"op": "terminate", "run": ref, "status": "FINISHED", "end_time": _now()})
        self.outbox.pump()

    def log_lineage(self, paths: list[Path]) -> None:
        """Queue the lineage page and plots (files of the run directory) for the parent run's `lineage/` folder;
        each call replaces what an earlier one logged."""
        for path in paths:
            self._artifact(self.parent, Path(path), "lineage")
        self.outbox.pump()

    def finish(self, summary: Summary | dict | None, run_dir: Path, status: str = "FINISHED") -> bool:
        """Log the summary, end the parent run and wait up to `finish_wait_s` for MLflow to have it all.

        Returns whether MLflow has everything; if not, the outbox stays in the run directory.
        """
        summary = summary if isinstance(summary, Summary) else Summary.from_dict(summary or {})  # {}: none was made
        self.finished = True
        now = _now()
        final = {}
        for name, (low, high) in summary.speedup_ci.items():  # the claims: the final paired re-timing, 95%
            final.update(claim_metrics(name, summary.speedup_paired.get(name), low, high))
        if summary.vs_default:  # the best against the run's default genome, paired (what the search earned)
            estimate, low, high = summary.vs_default["speedup"]
            final.update({"speedup_vs_default_genome": estimate, "speedup_vs_default_genome.low95": low,
                          "speedup_vs_default_genome.high95": high})
        final.update({f"{SINGLE_TIMING}best_latency_ms": summary.best_latency_ms,
                      f"{SINGLE_TIMING}speedup_vs_best_baseline": summary.speedup_vs_best_baseline,
                      **{f"{SINGLE_TIMING}speedup_vs_{name}": v for name, v in summary.speedups.items()},
                      "fraction_of_roofline": (summary.roofline or {}).get("fraction_of_floor")})
        for key in ("retimings", "faster", "equal", "wall_s"):
            if key in summary.intensification:
                final[f"intensify_{key}"] = summary.intensification[key]
        accuracy = best_accuracy(summary)  # a generation engine's loss against float64 (accuracy contract)
        final.update({f"accuracy_{key}": accuracy.get(key) for key in ("agreement", "mean_gap", "max_gap")})
        metrics = [(k, float(v), now, 0) for k, v in final.items() if isinstance(v, (int, float)) and math.isfinite(v)]
        tags = {"best_hash": str(summary.best_hash), "run_dir": str(run_dir)}
        if accuracy:  # a generation engine's (a call engine's run page keeps its tags: they push the description down)
            tags[MODE_TAG] = loss_mode(accuracy)
        claim = short_claim(summary)
        if claim:  # the page's title and the runs table's name column lead with the claim
            tags[RUN_NAME_TAG] = f"{self.run_name} · {claim}"[:250]
        self._batch(self.parent, metrics=metrics, tags=tags)
        self.outbox.add({"op": "note", "run": self.parent, "text": run_description(summary, run_dir, status)})
        for name in ("summary.json", "best_genome.json", "baselines.json", "config.yaml", "lessons.yaml",
                     "code_lessons.md", "agent/log.jsonl", "retimings.jsonl"):
            if (Path(run_dir) / name).exists():
                self._artifact(self.parent, Path(run_dir) / name, str(Path(name).parent) if "/" in name else None)
        self.outbox.add({"op": "terminate", "run": self.parent, "status": status, "end_time": _now()})
        if self.outbox.drain(self.finish_wait_s):
            return True
        log.warning("MLflow is still behind after %.0f s: %d operations left in %s; replay them with"
                    " `python -m evo mlflow-sync %s` once %s answers", self.finish_wait_s, self.pending,
                    self.run_dir / OUTBOX_FILE, self.run_dir, self.uri)
        return False

    def _batch(self, ref: str, metrics: list[tuple] = (), params: dict[str, str] | None = None,
               tags: dict[str, str] | None = None) -> None:
        """Queue log_batch operations within MLflow's limits (1000 metrics, 100 params and tags each)."""
        metrics = [(key, _shown(value), *rest) for key, value, *rest in metrics]
        params, tags = list((params or {}).items()), list((tags or {}).items())
        chunks = max(math.ceil(len(metrics) / MAX_METRICS), math.ceil(len(params) / MAX_BATCH),
                     math.ceil(len(tags) / MAX_BATCH))
        for i in range(chunks):
            op = {"op": "batch", "run": ref,
                  "metrics": [list(m) for m in metrics[i * MAX_METRICS:(i + 1) * MAX_METRICS]],
                  "params": dict(params[i * MAX_BATCH:(i + 1) * MAX_BATCH]),
                  "tags": dict(tags[i * MAX_BATCH:(i + 1) * MAX_BATCH])}
            self.outbox.add({k: v for k, v in op.items() if v})

    def _artifact(self, ref: str, path: Path, artifact_path: str | None) -> None:
        path = path.resolve()
        stored = path.relative_to(self.run_dir.resolve()) if path.is_relative_to(self.run_dir.resolve()) else path
        self.outbox.add({"op": "artifact", "run": ref, "path": str(stored), "artifact_path": artifact_path})


class MlflowEvidence(Sink):
    """The MLflow sink in the search's list: each generation reaches MLflow after its Parquet file (and its
    code diffs) are on disk, so it comes after those sinks; at the end, the summary and the parent run's
    status (so it closes after the lineage sink has queued its last drawing)."""

    def __init__(self, mlflow: MlflowSink, run_dir: Path, parquet_of: Callable[[int], Path],
                 extra_of: Callable[[int], list[tuple[Path, str]]] = lambda generation: []) -> None:
        self.mlflow, self.run_dir, self.parquet_of, self.extra_of = mlflow, Path(run_dir), parquet_of, extra_of

    def on_generation(self, report: GenerationReport, search: Search) -> None:
        self.mlflow.on_generation(report, search, self.parquet_of(report.generation), self.extra_of(report.generation))

    def close(self, summary: Summary | None = None, status: str = FINISHED) -> None:
        self.mlflow.finish(summary, self.run_dir, status)


def sync(run_dir: Path, uri: str | None = None, wait_s: float = 30.0) -> int:
    """Replay a run directory's leftover outbox (`python -m evo mlflow-sync`); returns how many operations are left."""
    outbox = Outbox(Path(run_dir), uri)
    before = len(outbox.ops)
    outbox.drain(wait_s)
    log.info("replayed %d of %d MLflow operations from %s", before - len(outbox.ops), before, run_dir)
    return len(outbox.ops)


def _shown(value: float) -> float:
    """A metric to 6 significant digits: what MLflow's pages show (31.4786, not 31.478594999953202); timing
    noise is far above the digits dropped."""
    return float(f"{value:.6g}")


def _now() -> int:
    return int(time.time() * 1000)
