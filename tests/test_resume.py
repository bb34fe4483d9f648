"""`python -m evo resume`: clear errors for unusable run directories, and never on another device type. A kill -9
mid-generation and its resume: tests/test_stop.py (after a SIGTERM stop); between a result and its Parquet
file: tests/test_code_search.py."""
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from evo.driver.resume import RunDirError, load_run
from tests.run_checks import run_evo

CONFIG = {
    "workload": "tests.fake_workload", "preset": "cpu", "name": "crash", "baselines": ["torch_cumsum"],
    "genes": {"impl": ["cumsum", "loop", "zeros", "nan", "noisy", "slow_build"]},
    "search": {"seed": 3, "generations": 4, "offspring": 4, "max_evaluations": 16,
               "population": {"size": 4, "elite": 1, "tournament": 2}},
    "evaluators": {"count": 2, "threads": 1},
    "evaluator": {"warmup": 1, "repeats": 3, "eval_timeout_s": 60},
}


def evo(tmp: Path, *args: str, crash_at: str | None = None) -> subprocess.CompletedProcess:
    return run_evo(*args, crash_at=crash_at)


def test_unusable_run_directories_get_clear_errors(tmp_path):
    with pytest.raises(RunDirError, match="not a directory"):
        load_run(tmp_path / "missing")
    with pytest.raises(RunDirError, match="run.json .*missing"):
        load_run(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(RunDirError, match="run format 99"):
        load_run(tmp_path)
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(RunDirError, match="corrupt"):
        load_run(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"format": 1}))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"search": {"generatoins": 2}}))
    with pytest.raises(RunDirError, match="config.yaml is corrupt.*generatoins"):
        load_run(tmp_path)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    (tmp_path / "evidence.jsonl").write_text('{"broken": \n{"also": "broken"}\n')
    with pytest.raises(RunDirError, match="evidence.jsonl:1 is corrupt"):
        load_run(tmp_path)
    result = evo(tmp_path, "resume", str(tmp_path))
    assert result.returncode == 2 and "cannot resume" in result.stdout


def test_a_run_is_never_resumed_on_another_device_type(tmp_path):
    from evo.core.genome import Genome
    from evo.core.records import EvalResult, Evaluated, Proposal
    from evo.driver.resume import SavedRun, check_device
    from tests import fake_workload

    genome = Genome.from_json(fake_workload.genome_json("cumsum"))
    timed = Evaluated(Proposal(genome, (), "seed", "m", 0), EvalResult(genome.hash, "ok", latency_ms=1.0,
                                                                         device="cuda:NVIDIA H200"))
    failed = Evaluated(Proposal(genome, (), "seed", "m", 0), EvalResult(genome.hash, "timeout"))  # no device
    saved = SavedRun(tmp_path, None, None, (timed, failed))
    check_device(saved, "cuda:NVIDIA H200")
    with pytest.raises(RunDirError, match=r"timed on \['cuda:NVIDIA H200'\].*'cpu:AMD EPYC'"):
        check_device(saved, "cpu:AMD EPYC")
