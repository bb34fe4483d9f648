"""No baseline is silently dropped: one that times out (or fails) is a row, with its status and why, in the
summary, the terminal and MLflow; baselines build under their own limit (`baseline_build_timeout_s`).
No Ray: the plain Evaluator on the fake workload with a slow-building baseline (tests/slow_baseline_workload.py)."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from evaluators.judge.evaluator import Evaluator
from evaluators.judge.synthetic import SyntheticEvaluator
from evaluators.pool.actors import EvaluatorPool
from evaluators.settings import EvaluatorSettings
from evo.core.loop import LocalExecutor, run_search
from evo.core.records import OK, TIMEOUT, EvalResult
from evo.core.search import Search, SearchSettings
from evo.driver.progress import SUMMARY
from evo.driver.run import _print_summary
from evo.evidence.mlflow.describe import run_description
from evo.evidence.mlflow.sink import MlflowSink
from evo.evidence.summary import Summary, make_summary
from operators.team import LocalTeam
from tests import fake_workload as fw
from tests import slow_baseline_workload as slow
from tests.toy_space import toy_space


def test_baselines_have_their_own_build_limit_declared_once():
    s = EvaluatorSettings()
    assert s.baseline_build_timeout_s == 600.0 and s.build_timeout_s == 120.0
    assert s.budgets() == (("build_timeout_s", 120.0), ("eval_timeout_s", 300.0))
    (name, build_s), (_, whole_s) = s.budgets(baseline=True)
    assert (name, build_s, whole_s) == ("baseline_build_timeout_s", 600.0, 300.0 + 480.0)  # the extra build time
    # no longer than a candidate's: the same budget as a candidate's (scripts/gpu_engines.py relies on it)
    assert EvaluatorSettings(baseline_build_timeout_s=60).budgets(baseline=True)[1] == ("eval_timeout_s", 300.0)
    assert "baseline_build_timeout_s" in {row["option"] for row in EvaluatorSettings.describe()}
    pool = SimpleNamespace(settings=s)  # the pool waits as long for a baseline as its evaluator may take (no Ray)
    assert EvaluatorPool._budget_factor(pool, ["baseline:x"]) == pytest.approx(780 / 300)
    assert EvaluatorPool._budget_factor(pool, ["{}", "baseline:x"]) == pytest.approx((300 + 780) / 300)
    with pytest.raises(ValueError, match="baseline_build_timeout_s=-1"):
        EvaluatorSettings.from_dict({"baseline_build_timeout_s": -1})


@pytest.fixture(scope="module")
def timed_out_and_ok() -> dict[str, EvalResult]:
    """The slow baseline past its own (short) limit, a quick one measured, a broken one incorrect (the limit
    leaves the quick ones room on a loaded machine; the slow one sleeps twice past it)."""
    settings = EvaluatorSettings(warmup=1, repeats=3, build_timeout_s=30.0, baseline_build_timeout_s=2.0)
    ev = Evaluator(slow.NAME, "cpu", settings, seed=1, name="ev-baselines")
    return {name: ev.evaluate_baseline(name) for name in ("slow_compile", "torch_cumsum", "broken")}


def test_a_baseline_slower_than_its_own_limit_times_out_naming_it(timed_out_and_ok):
    r = timed_out_and_ok["slow_compile"]
    assert r.status == TIMEOUT and "baseline_build_timeout_s 2 s" in r.message, r.message
    assert timed_out_and_ok["torch_cumsum"].status == OK, timed_out_and_ok["torch_cumsum"].message


def test_baselines_build_under_their_limit_and_candidates_under_theirs():
    settings = EvaluatorSettings(warmup=1, repeats=3, build_timeout_s=0.2, baseline_build_timeout_s=30.0)
    ev = Evaluator(slow.NAME, "cpu", settings, seed=1, name="ev-baselines")
    baseline = ev.evaluate_baseline("slow_compile")  # builds 4 s: over build_timeout_s, within its own limit
    assert baseline.status == OK and baseline.build_s >= slow.SLOW_BUILD_S, baseline.message
    candidate = ev.evaluate(fw.genome_json("slow_build"))  # builds 0.3 s: a candidate keeps build_timeout_s
    assert candidate.status == TIMEOUT and "build_timeout_s 0.2 s" in candidate.message, candidate.message


def _search() -> Search:
    settings = SearchSettings(seed=0, generations=2, offspring=4, max_evaluations=8, agents=("fusion",))
    space = toy_space()
    search = Search(space, settings, LocalTeam(list(settings.agents), space, settings.seed))
    run_search(search, LocalExecutor(SyntheticEvaluator()))
    return search


def test_a_timed_out_baseline_is_a_row_in_the_summary_the_terminal_and_mlflow(timed_out_and_ok, tmp_path, caplog):
    summary = make_summary(_search(), timed_out_and_ok, None, "slow-baseline-fake", "cpu", 1.0)
    assert summary.found and summary.best_baseline == "torch_cumsum"
    assert summary.baselines_compared == ["torch_cumsum"]  # what "faster than the best baseline" covers
    again = Summary.from_dict(json.loads(json.dumps(summary.to_dict())))
    assert again.baselines["slow_compile"]["status"] == TIMEOUT and again.baselines_compared == ["torch_cumsum"]
    assert "baseline_build_timeout_s" in again.baselines["slow_compile"]["message"]

    with caplog.at_level(SUMMARY, logger="evo.run"):
        _print_summary(summary, tmp_path)
    text = caplog.text  # one row per baseline not compared, saying why; the headline names what it covers
    assert "best baseline torch_cumsum (of those measured: torch_cumsum; not compared: broken, slow_compile)" in text
    assert "  slow_compile: timeout — build took longer than baseline_build_timeout_s 2 s" in text, text
    assert "  broken: incorrect — " in text and text.count("; not compared\n") == 2, text

    note = run_description(summary, tmp_path)
    row = next(line for line in note.splitlines() if line.startswith("| slow_compile |"))
    assert "| - | timeout — build took longer than baseline_build_timeout_s 2 s" in row, row
    assert row.endswith("; not compared |") and row.count("|") == 4, row
    assert "faster than the best baseline (torch_cumsum) of those measured: torch_cumsum; not compared: broken," \
           " slow_compile" in note, note

    logged = {}
    sink = SimpleNamespace(baseline_ms=math.nan, outbox=SimpleNamespace(pump=lambda: None),
                           _batch=lambda ref, metrics=(), tags=None: logged.update(metrics=metrics, tags=tags),
                           parent="parent")
    MlflowSink.log_baselines(sink, timed_out_and_ok, None)
    tags, metrics = logged["tags"], {m[0] for m in logged["metrics"]}
    assert tags["baseline.slow_compile.status"] == TIMEOUT and tags["baselines_compared"] == "torch_cumsum"
    assert "baseline_build_timeout_s" in tags["baseline.slow_compile.message"]
    assert "baseline.torch_cumsum.status" not in tags  # compared: named in baselines_compared, one tag for them all
    assert "baseline_torch_cumsum_ms" in metrics and "baseline_slow_compile_ms" not in metrics
