"""Lessons across runs: a second `evo run` warm-started from the first run's MLflow experiment uses its
lessons, and says so in its evidence. Real local Ray, the fake workload, a real MLflow store."""
import io
import json

import pytest
import yaml
from mlflow.tracking import MlflowClient

from evo.driver.config import config_from_dict
from evo.core.lessons import FILE, WARM_FILE, LessonsError, read
from evo.evidence.mlflow.lessons import load
from evo.driver.run import run
from tests.run_checks import journal

pytestmark = pytest.mark.slow  # two searches on a local Ray (121 s measured on 2 busy cores, load ~11)

CONFIG = {
    "workload": "tests.fake_workload", "preset": "cpu", "name": "warm", "baselines": ["torch_cumsum"],
    "genes": {"impl": ["zeros", "nan", "raise_build", "loop", "cumsum"]},
    "search": {"seed": 5, "generations": 2, "offspring": 4, "max_evaluations": 8,
               "population": {"size": 4, "elite": 1, "tournament": 2}},
    "evaluators": {"count": 1, "threads": 1},
    "evaluator": {"warmup": 1, "repeats": 3, "eval_timeout_s": 60},
}


@pytest.fixture(scope="module")
def two_runs(ray_local, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("warm")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    config = config_from_dict({**CONFIG, "mlflow": {"tracking_uri": uri, "experiment": "warm",
                                                    "register_model": False}})
    first = run(config, tmp / "first", out=io.StringIO())
    lessons = load("warm", uri)  # from MLflow: the experiment's newest run that logged lessons
    second_config = config_from_dict({**CONFIG, "search": {**CONFIG["search"], "seed": 6},
                                      "mlflow": {"tracking_uri": uri, "experiment": "warm", "register_model": False}})
    log = io.StringIO()
    second = run(second_config, tmp / "second", out=log, lessons=lessons)
    return first, second, uri, log.getvalue()


def test_lessons_are_written_readable_and_logged_to_mlflow(two_runs):
    first, _, uri, _ = two_runs
    text = (first.run_dir / FILE).read_text()
    data = yaml.safe_load(text)
    assert data["format"] == 1 and data["workload"] == "tests.fake_workload" and data["preset"] == "cpu"
    assert data["best"][0]["hash"] == first.summary.best_hash
    assert data["evaluations"] == first.summary.evaluations
    assert data["fails"], "the failing impls should be named, with counts"
    assert set(data["agents"]) == {"fusion", "scheduling", "memory", "integration"}
    artifacts = {a.path for a in MlflowClient(uri).list_artifacts(first.mlflow_run_id)}
    assert FILE in artifacts


def test_a_warm_started_run_uses_the_first_runs_lessons_and_records_it(two_runs):
    first, second, _, log = two_runs
    rows = journal(second.run_dir)
    warm = [r for r in rows if r["move_kind"] == "warm_start"]
    assert warm and warm[0]["genome_hash"] == first.summary.best_hash and warm[0]["generation"] == 0
    assert first.run_dir.name in warm[0]["move"]
    assert "warm start: lessons of" in log
    assert first.run_dir.name in second.summary.warm_start
    state = json.loads((second.run_dir / "state.json").read_text())
    assert first.run_dir.name in state["warm_start"]
    # the first run's evidence is part of what the second knows, and of the lessons it leaves
    assert state["gene_effects"]["results"] == first.summary.evaluations + second.summary.evaluations
    assert read(second.run_dir / WARM_FILE).sources == (first.run_dir.name,)
    assert read(second.run_dir / FILE).sources == (first.run_dir.name, second.run_dir.name)


def test_lessons_of_another_preset_or_a_bad_source_are_refused(two_runs, tmp_path):
    first, _, _, _ = two_runs
    lessons = load(str(first.run_dir))
    with pytest.raises(LessonsError, match="preset='cpu'.*preset='cpu_bf16'"):
        lessons.check("tests.fake_workload", "cpu_bf16", lessons.device, "--warm-start")
    with pytest.raises(LessonsError, match="has no lessons.yaml"):
        load(str(tmp_path))
    (tmp_path / "bad.yaml").write_text("format: 99\n")
    with pytest.raises(LessonsError, match="format 99"):
        load(str(tmp_path / "bad.yaml"))
