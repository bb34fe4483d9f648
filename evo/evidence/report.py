"""`python -m evo report RUN_DIR|RUN_ID`: print the best engine's ancestry and write the lineage page.

A run directory is read as it is. An MLflow run id (or `runs:/ID`, of the parent run or of one of its
generation runs) leads to the run directory recorded in its `run_dir` tag when that exists here; else
the evidence is downloaded from MLflow (each generation run's Parquet file, the parent's summary and
baselines) and the page is drawn from that. Either way the report ends with the MLflow run's URL
(on its runs view, `evo.evidence.mlflow.links`) when the run has one.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TextIO

from evo.evidence.claims import claim_lines
from evo.evidence.lineage import ancestry_lines, load_lineage
from evo.evidence.lineage_view import LINEAGE_DIR, write_lineage


class ReportError(ValueError):
    """The target is neither a run directory nor a run MLflow knows; the message says what was tried."""


def report(target: str, out_dir: str | None = None, uri: str | None = None, out: TextIO | None = None) -> Path:
    """Print the ancestry (to `out`, default stdout) and write lineage.html with its PNGs; returns the page's path."""
    out = out or sys.stdout
    run_dir, default_out, url = _locate(target, uri)
    lineage = load_lineage(run_dir)
    files = write_lineage(run_dir, Path(out_dir) if out_dir else default_out, lineage)
    claim = [*claim_lines(lineage.summary), ""] if lineage.summary else []  # [] for a run still searching
    for line in claim:  # what the run proved first; the ancestry's single timings after it
        print(line, file=out)
    for line in ancestry_lines(lineage):
        print(line, file=out)
    print(f"lineage page: {files.html}\n  tree: {files.png}\n  best so far: {files.best_so_far_png}", file=out, flush=True)
    for line in url:
        print(line, file=out, flush=True)
    return files.html


def _run_dir_url(run_dir: Path) -> list[str]:
    """The MLflow lines of a run directory: its parent run's URL, from summary.json and mlflow_run.json."""
    from evo.evidence.mlflow.links import mlflow_lines, run_url
    from evo.evidence.mlflow.outbox import OUTBOX_FILE, STATE_FILE
    from evo.evidence.summary import SUMMARY_FILE, Summary

    state_path = run_dir / STATE_FILE
    if not state_path.exists():
        return []  # MLflow was off for this run
    state = json.loads(state_path.read_text())
    summary = Summary.read(run_dir / SUMMARY_FILE) if (run_dir / SUMMARY_FILE).exists() else None
    run_id = summary.mlflow_run_id if summary and summary.mlflow_run_id else None
    experiment_id = state.get("experiment_id")
    pending = len((run_dir / OUTBOX_FILE).read_text().splitlines()) if (run_dir / OUTBOX_FILE).exists() else 0
    url = run_url(state["uri"], experiment_id, run_id) if run_id and experiment_id else None
    return mlflow_lines(state["uri"], url, pending, run_dir)


def _locate(target: str, uri: str | None) -> tuple[Path, Path, list[str]]:
    """(directory holding the evidence, default output folder, the lines naming its MLflow run)."""
    path = Path(target)
    if path.is_dir():
        if not (path / "evidence.jsonl").exists() and not (path / "generations").is_dir():
            raise ReportError(f"{path} is a directory but not a run directory (no evidence.jsonl, no generations/)")
        return path, path / LINEAGE_DIR, _run_dir_url(path)
    run_id = target.removeprefix("runs:/").strip("/")
    if not run_id.isalnum():
        raise ReportError(f"{target!r} is neither a run directory nor an MLflow run id (runs:/ID or 32 hex digits)")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from evo.evidence.mlflow.outbox import tracking_uri

    uri = tracking_uri(uri)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        raise ReportError(f"{target!r} is not a directory, and the MLflow store {uri} does not exist; pass a run "
                          f"directory, or --tracking-uri (or MLFLOW_TRACKING_URI) of the store that has run {run_id!r}")
    client = MlflowClient(tracking_uri=uri)
    try:
        run = client.get_run(run_id)
        parent_id = run.data.tags.get("mlflow.parentRunId")
        if parent_id:  # a generation run: report its search
            run = client.get_run(parent_id)
    except MlflowException as exc:
        raise ReportError(f"{target!r} is not a directory, and MLflow at {uri} has no run {run_id!r} "
                          f"({exc.error_code}); pass a run directory, or --tracking-uri of the store that has it") from exc
    from evo.evidence.mlflow.links import mlflow_lines, run_url

    lines = mlflow_lines(uri, run_url(uri, run.info.experiment_id, run.info.run_id), 0, target)
    local = run.data.tags.get("run_dir")
    if local and (Path(local) / "evidence.jsonl").exists():
        return Path(local), Path(local) / LINEAGE_DIR, lines
    return _download(client, run), Path.cwd() / f"lineage-{run.info.run_id[:8]}", lines


def _download(client, run) -> Path:
    """The evidence of a search, from its generation runs' Parquet artifacts, into a temporary run directory."""
    name = run.info.run_name or run.info.run_id
    run_dir = Path(tempfile.mkdtemp(prefix="evo-report-")) / name
    (run_dir / "generations").mkdir(parents=True)
    children = client.search_runs([run.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run.info.run_id}'",
                                  max_results=10000)
    for child in children:
        try:
            staged = Path(client.download_artifacts(child.info.run_id, "evidence", str(run_dir / "staging")))
        except Exception:  # noqa: BLE001 - a generation run whose evidence never reached MLflow
            continue
        for parquet in staged.glob("gen_*.parquet"):
            shutil.move(str(parquet), run_dir / "generations" / parquet.name)
    for name in ("summary.json", "baselines.json"):
        try:
            client.download_artifacts(run.info.run_id, name, str(run_dir))
        except Exception:  # noqa: BLE001 - a search still running has no summary yet; baselines may be missing
            pass
    if not any((run_dir / "generations").iterdir()):
        raise ReportError(f"MLflow run {run.info.run_id} has no generation runs with Parquet evidence to draw")
    return run_dir
