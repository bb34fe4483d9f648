"""A durable, ordered outbox of MLflow writes, replayed until the tracking store has them all.

The search must not wait for MLflow: every write becomes an operation that is appended to
`mlflow_outbox.jsonl` in the run directory (fsynced) and then replayed in order. When the store is
down, the operations stay there, one warning says MLflow is behind, and replay is retried with
exponential backoff; `python -m evo mlflow-sync RUN_DIR` replays what a finished run left behind.

Files in the run directory:
  mlflow_outbox.jsonl          pending operations, one JSON object a line (absent when none are pending);
                               read with `evo.core.jsonl.read_jsonl`: a last line torn by a crash is dropped
  mlflow_run.json              tracking URI, experiment, this sink's key and the run ids created so far
  mlflow_outbox.dropped.jsonl  operations the store refused for good (e.g. a param logged with a new value)

Every operation can be replayed safely, so a crash between a write and its removal loses nothing:
  run        create a run, unless one tagged with its key `evo.sink_key` already exists
  batch      log_batch; metrics keep their original timestamps, and MLflow ignores an identical metric
             logged twice; params are re-logged with the same value; tags overwrite
  artifact   log a file of the run directory (overwrites)
  terminate  set a run's final status (idempotent)
  note       set a run's description (`mlflow.note.content`, overwrites), its `<run_id>` and
             `<experiment_id>` filled in once the run exists (its links to the run's own pages)
Runs are named by reference ("3fa2c1d0/parent", "3fa2c1d0/gen:3": one prefix per sink), resolved to
run ids only when an operation is replayed.
"""
from __future__ import annotations

import json
import logging
import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from evo.core.jsonl import read_jsonl, trim_torn_tail
from evo.evidence.mlflow.describe import EXPERIMENT_ID, NOTE_TAG, RUN_ID
from evo.evidence.mlflow.links import EXPERIMENT_KIND, KIND_TAG

log = logging.getLogger("evo.mlflow")

OUTBOX_FILE = "mlflow_outbox.jsonl"
STATE_FILE = "mlflow_run.json"
DROPPED_FILE = "mlflow_outbox.dropped.jsonl"
KEY_TAG = "evo.sink_key"
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
MAX_NOTE_CHARS = 8000  # MLflow's longest tag value


def tracking_uri(configured: str | None) -> str:
    """The configured tracking URI, else $MLFLOW_TRACKING_URI, else SQLite in the working directory."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"



class Unresolvable(Exception):
    """An operation that can never succeed (its run was never created, its file is gone)."""


class Outbox:
    """Pending MLflow operations of one run directory, with their replay against one tracking store."""

    def __init__(self, run_dir: Path, uri: str | None = None, experiment: str | None = None,
                 request_timeout_s: float = 5.0) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path, self.state_path = self.run_dir / OUTBOX_FILE, self.run_dir / STATE_FILE
        state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        if (uri and state.get("uri") not in (None, uri)) or (experiment and state.get("experiment") not in (None, experiment)):
            # Another store or experiment: its run ids mean nothing here; replay creates the runs anew.
            state = {"experiment": state.get("experiment")} if experiment is None else {}
        if not state.get("uri") and not uri:
            raise ValueError(f"no tracking URI given and none recorded in {self.state_path}")
        self.state: dict[str, Any] = {"key": uuid.uuid4().hex, "runs": {}, **state}
        self.state.update({k: v for k, v in (("uri", uri), ("experiment", experiment)) if v})
        self._save_state()
        self.ops: list[dict] = read_jsonl(self.path)  # a line torn by a crash is skipped
        trim_torn_tail(self.path)  # and cut, so the next operation starts on a line of its own
        self.client = MlflowClient(tracking_uri=self.state["uri"])
        self.request_timeout_s = request_timeout_s
        self.failures, self.next_attempt, self.last_error = 0, 0.0, ""

    @property
    def uri(self) -> str:
        return self.state["uri"]

    def run_id(self, ref: str) -> str | None:
        return self.state["runs"].get(ref)

    def add(self, op: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(op) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.ops.append(op)

    def pump(self) -> None:
        """Replay pending operations unless backing off; warn once when MLflow falls behind and once when it catches up."""
        if not self.ops or time.monotonic() < self.next_attempt:
            return
        before = len(self.ops)
        if self.flush():
            if self.failures:
                log.warning("MLflow caught up: %d operations backfilled to %s", before, self.uri)
            self.failures, self.next_attempt = 0, 0.0
            return
        if self.failures == 0:
            log.warning("MLflow is behind: %d operations pending (%s); evidence is on disk in %s",
                        len(self.ops), self.last_error, self.run_dir)
        self.failures += 1
        self.next_attempt = time.monotonic() + min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (self.failures - 1))

    def drain(self, wait_s: float) -> bool:
        """Replay everything, retrying with backoff for at most `wait_s` seconds; returns whether nothing is left."""
        deadline, delay = time.monotonic() + wait_s, FIRST_BACKOFF_S
        while True:
            self.next_attempt = 0.0
            self.pump()
            left = deadline - time.monotonic()
            if not self.ops or left <= 0:
                return not self.ops
            time.sleep(min(delay, left))
            delay = min(2 * delay, MAX_BACKOFF_S)

    def flush(self) -> bool:
        """Replay pending operations in order, stopping at the first one the store cannot take now."""
        done, ok = 0, True
        with _quick_http(self.request_timeout_s):
            for op in self.ops:
                try:
                    self._apply(op)
                except Exception as exc:  # noqa: BLE001 - MLflow must never stop the search
                    if not _permanent(exc):
                        self.last_error, ok = _reason(exc), False
                        break
                    self._drop(op, exc)
                done += 1
        if done:
            self.ops = self.ops[done:]
            self._rewrite()
        return ok

    # --- replay of one operation ---

    def _apply(self, op: dict) -> None:
        kind = op["op"]
        if kind == "run":
            self._ensure_run(op)
        elif kind == "batch":
            self.client.log_batch(self._resolve(op["run"]),
                                  metrics=[Metric(k, v, ts, step) for k, v, ts, step in op.get("metrics", [])],
                                  params=[Param(k, v) for k, v in op.get("params", {}).items()],
                                  tags=[RunTag(k, v) for k, v in op.get("tags", {}).items()])
        elif kind == "artifact":
            path = self.run_dir / op["path"]
            if not path.exists():
                raise Unresolvable(f"artifact {path} is gone")
            self.client.log_artifact(self._resolve(op["run"]), str(path), op.get("artifact_path"))
        elif kind == "terminate":
            self.client.set_terminated(self._resolve(op["run"]), op["status"], end_time=op.get("end_time"))
        elif kind == "note":
            run_id = self._resolve(op["run"])
            text = op["text"].replace(RUN_ID, run_id).replace(EXPERIMENT_ID, self._experiment_id())
            self.client.set_tag(run_id, NOTE_TAG, text[:MAX_NOTE_CHARS])
        else:
            raise Unresolvable(f"unknown operation {kind!r}; known: run, batch, artifact, terminate, note")

    def _ensure_run(self, op: dict) -> None:
        ref = op["ref"]
        if ref in self.state["runs"]:
            return
        experiment_id = self._experiment_id()
        key = f"{self.state['key']}/{ref}"
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{KEY_TAG}` = '{key}'", max_results=1)
        if found:
            run_id = found[0].info.run_id
        else:
            tags = {**op.get("tags", {}), KEY_TAG: key}
            if op.get("parent"):
                tags["mlflow.parentRunId"] = self._resolve(op["parent"])
            run_id = self.client.create_run(experiment_id, start_time=op.get("start_time"), tags=tags,
                                            run_name=op.get("run_name")).info.run_id
        self.state["runs"][ref] = run_id
        self._save_state()

    def _experiment_id(self) -> str:
        if not self.state.get("experiment_id"):
            name = self.state["experiment"]
            found = self.client.get_experiment_by_name(name)
            if found is None:
                experiment_id = self.client.create_experiment(name, tags={KIND_TAG: EXPERIMENT_KIND})
            else:  # the UIs that read the tag open it on its runs, not on the GenAI overview (evo.evidence.mlflow.links)
                experiment_id = found.experiment_id
                if KIND_TAG not in found.tags:
                    self.client.set_experiment_tag(experiment_id, KIND_TAG, EXPERIMENT_KIND)
            self.state["experiment_id"] = experiment_id
            self._save_state()
        return self.state["experiment_id"]

    def _resolve(self, ref: str) -> str:
        run_id = self.run_id(ref)
        if run_id is None:
            raise Unresolvable(f"run {ref!r} was never created in MLflow")
        return run_id

    # --- files ---

    def _drop(self, op: dict, exc: Exception) -> None:
        log.warning("MLflow refused an operation for good, kept in %s: %s", self.run_dir / DROPPED_FILE, _reason(exc))
        with open(self.run_dir / DROPPED_FILE, "a") as f:
            f.write(json.dumps({"op": op, "error": _reason(exc)}) + "\n")

    def _rewrite(self) -> None:
        if not self.ops:
            self.path.unlink(missing_ok=True)
            return
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(op) + "\n" for op in self.ops)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def _save_state(self) -> None:
        tmp = self.state_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.state, indent=2, sort_keys=True))
        os.replace(tmp, self.state_path)


def _permanent(exc: Exception) -> bool:
    """Refused for good (4xx other than auth, timeout, rate limit), not just unreachable right now."""
    if isinstance(exc, Unresolvable):
        return True
    if isinstance(exc, MlflowException):
        status = exc.get_http_status_code()
        return 400 <= status < 500 and status not in (401, 403, 408, 429)
    return False


def _reason(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


@contextmanager
def _quick_http(timeout_s: float) -> Iterator[None]:
    """One short attempt per request, so an unreachable store costs seconds; backoff is the outbox's job.

    MLflow reads these variables at each request; they are set only while the outbox replays.
    """
    values = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(max(1, timeout_s)))}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
