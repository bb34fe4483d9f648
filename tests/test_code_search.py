"""End to end: a search on the KDA CPU preset with the code agent in the team, against a scripted
OpenAI-compatible server. The driver is killed with SIGKILL after a generation and resumed; then a
second run reads the lessons of the first. Checks the evidence (code hashes, prompts, tokens, costs),
MLflow (code diffs per generation, lessons), the agent's saved state and the lessons file."""
from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from evo.core.code import is_code_hash
from evo.core.genome import Genome
from evo.core.lessons import read as read_lessons
from tests.llm_server import CommentingModel, ScriptedLlmServer
from tests.run_checks import journal, run_evo

KEY = "sk-scripted-key-do-not-log-42"
EAGER = {f"backend_{s}": ["eager"] for s in ("gate", "l2norm", "intra", "recurrence", "output")}


def config(tmp: Path, url: str, name: str, generations: int, budget: int) -> Path:
    data = {
        "workload": "kda", "preset": "cpu_small", "name": name, "baselines": ["chunk_pairwise_c64"], "genes": EAGER,
        "search": {"seed": 1, "generations": generations, "offspring": 4, "max_evaluations": budget,
                   "agents": ["scheduling", "code"], "population": {"size": 4, "elite": 1, "tournament": 2}},
        "evaluators": {"count": 2, "threads": 1},
        "evaluator": {"warmup": 1, "repeats": 3, "eval_timeout_s": 120, "build_timeout_s": 60},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "code", "register_model": False},
        "code_agent": {"llm": {"base_url": url, "model": "scripted", "api_key_env": "SCRIPTED_LLM_KEY",
                               "timeout_s": 20, "max_retries": 1,
                               "prices": {"scripted": {"input_per_mtok": 3.0, "output_per_mtok": 15.0}}},
                       "lessons_dir": str(tmp / "lessons"), "queue": 2},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def evo(*args: str, crash_at: str | None = None) -> subprocess.CompletedProcess:
    return run_evo(*args, crash_at=crash_at, env={"SCRIPTED_LLM_KEY": KEY}, timeout_s=420)


def test_a_search_with_the_code_agent_survives_a_kill_and_teaches_the_next_run(tmp_path):
    model = CommentingModel()
    with ScriptedLlmServer(model) as server:
        run_dir = tmp_path / "first"
        killed = evo("run", str(config(tmp_path, server.url, "first", 4, 14)), "--out", str(run_dir),
                     crash_at="evidence:3")
        assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
        checkpoint = json.loads((run_dir / "state.json").read_text())["agents"]["code"]
        resumed = evo("resume", str(run_dir))
        assert resumed.returncode == 0, resumed.stdout[-3000:]
        first_requests = len(server.requests)

        rows = journal(run_dir)
        hashes = [r["genome_hash"] for r in rows]
        assert len(hashes) == len(set(hashes)) == 14  # nothing evaluated twice, the budget kept
        mine = [r for r in rows if r["agent"] == "code"]
        assert mine, "no candidate of the code agent was evaluated"
        for row in mine:
            genome, notes = json.loads(row["genome"]), json.loads(row["notes"])
            digest = genome["fusion"][notes["stage"]]
            assert digest == notes["code_hash"] and (run_dir / "code" / f"{digest}.py").exists()
            assert notes["tokens_in"] > 0 and notes["tokens_out"] > 0 and notes["cost_usd"] > 0
            assert (run_dir / notes["prompt"]).exists()
        assert any(json.loads(r["notes"])["repairs"] >= 1 for r in mine) or \
            "could not be used" in json.dumps(server.requests)  # the first edit did not apply: repaired

        state = json.loads((run_dir / "state.json").read_text())["agents"]["code"]
        assert state["spent"]["calls"] >= checkpoint["spent"]["calls"] > 0  # the agent's spend survived the kill
        # the scripted model only adds comments: a correct edit is a lesson only when a paired re-timing
        # confirmed it faster than its parent (intensification), and a comment never is
        book = tmp_path / "lessons" / "kda-cpu.md"
        lessons = book.read_text() if book.exists() else ""
        retimed = [json.loads(line) for line in (run_dir / "retimings.jsonl").read_text().splitlines()] \
            if (run_dir / "retimings.jsonl").exists() else []
        confirmed = {t["a"] for t in retimed if t["verdict"] == "faster"}
        assert all(r["genome_hash"] not in lessons for r in mine if r["status"] == "ok" and r["genome_hash"] not in confirmed)
        assert (run_dir / "code_lessons.md").exists()
        with open(book, "a") as f:  # a lesson by hand, so the second run's reading of the file is tested
            f.write("\n## 2026-12-01 · intra · ok\n- lesson: Scripted lesson, written by hand.\n- evidence: a test\n")
        for path in (run_dir / "agent").iterdir():
            assert KEY not in path.read_text()

        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
        experiment = client.get_experiment_by_name("code")
        runs = client.search_runs([experiment.experiment_id])
        diffs = [a.path for r in runs if "mlflow.parentRunId" in r.data.tags
                 for a in client.list_artifacts(r.info.run_id, "diffs")]
        assert any(p.endswith(".diff") for p in diffs), "no code diff reached MLflow"
        one = next(r for r in runs if "mlflow.parentRunId" in r.data.tags and client.list_artifacts(r.info.run_id, "diffs"))
        diff_path = client.download_artifacts(one.info.run_id, client.list_artifacts(one.info.run_id, "diffs")[0].path,
                                              str(tmp_path / "dl"))
        assert "+" in Path(diff_path).read_text() and "scripted variant" in Path(diff_path).read_text()
        parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
        assert any(a.path == "code_lessons.md" for r in parents for a in client.list_artifacts(r.info.run_id))

        second = evo("run", str(config(tmp_path, server.url, "second", 2, 6)), "--out", str(tmp_path / "second"),
                     "--warm-start", str(run_dir))
        assert second.returncode == 0, second.stdout[-3000:]
        later = [json.dumps(r["messages"]) for r in server.requests[first_requests:]
                 if "review one experiment" not in r["messages"][0]["content"]]
        assert later and any("Scripted lesson" in text for text in later), "the second run did not read the lessons"

    # the warm start carries the first run's best genomes with their code: the sources travel in lessons.yaml
    learned = read_lessons(run_dir / "lessons.yaml")
    coded = {d for genome, _ in learned.best for d in Genome.from_dict(genome).values().values() if is_code_hash(d)}
    assert coded == set(learned.code), "a best genome's code is missing from the lessons"
    warm = [r for r in journal(tmp_path / "second") if r["move_kind"] == "warm_start"]
    assert warm, "the second run did not seed from the first run's best genomes"
    for row in warm:
        for digest in filter(is_code_hash, Genome.from_json(row["genome"]).values().values()):
            assert (tmp_path / "second" / "code" / f"{digest}.py").read_text() == learned.code[digest]
        assert row["status"] != "build_error", row["message"]  # its code was found and built
