"""The command line's error paths and help, without starting Ray: an empty config, a busy port, every
option's help and default, the gene table; the request `evo serve` prints; `import evo` stays light."""
import argparse
import json
import os
import socket
import subprocess
import sys

import pytest

from evo.cli import GENE_COLUMNS, build_parser, gene_table, main
from tests.run_checks import ROOT


@pytest.mark.parametrize("text", ["", "# only a comment\n\n# and another\n"])
def test_an_empty_or_comment_only_config_is_one_line_naming_the_file_and_a_sample(tmp_path, capsys, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "configs/kda_smoke.yaml" in err, err
    assert (ROOT / "configs" / "kda_smoke.yaml").is_file()  # the sample it points at exists


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_of_every_command_has_help_and_says_its_default():
    commands = _subcommands(build_parser())
    assert {"run", "resume", "serve", "genes", "bench", "compare", "ab", "report", "mlflow-sync"} <= set(commands)
    missing = []
    for name, command in commands.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            text = formatter._get_help_string(action) if action.help else ""
            flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreConstAction))
            if not text or (action.option_strings and not flag and "default" not in text):
                missing.append(f"{name} {action.option_strings or action.dest}: {text!r}")
    assert not missing, "\n".join(missing)
    serve_help = commands["serve"].format_help()
    assert "(default: 8000)" in serve_help and "(default: 127.0.0.1)" in serve_help


def test_genes_prints_an_aligned_table_with_a_header(capsys):
    assert main(["genes", str(ROOT / "configs" / "kda_smoke.yaml")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == list(GENE_COLUMNS) and set(lines[1]) <= {"-", " "}
    starts = [lines[0].index(c) for c in (*GENE_COLUMNS[1:], "doc")]  # every row's cells start under the header
    rows = [line for line in lines[2:] if not line.startswith("constraint over")]
    assert len(rows) > 10
    for row in rows:  # each cell read at its header's column is whole: aligned
        assert row[starts[0]:starts[1]].strip() in ("fusion", "scheduling", "memory"), row
        assert row[starts[2]:starts[3]].strip() in row[starts[1]:starts[2]] or "None" in row, row  # default in values
    assert any("sub_chunk_size divides chunk_size" in row for row in rows)


def test_the_table_pads_each_column_to_its_widest_cell():
    rows = [{"gene": "a", "domain": "fusion", "values": [1, 2], "default": 1, "constraint": "", "doc": "x"},
            {"gene": "longer_name", "domain": "memory", "values": ["p"], "default": "p", "constraint": "c", "doc": "y"}]
    header, rule, first, second = gene_table(rows)
    assert len({line.index("fusion" if line is first else "memory" if line is second else "domain")
                for line in (header, first, second)}) == 1
    assert rule.split()[0] == "-" * len("longer_name")


def _ray_up() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def test_serve_on_a_busy_port_is_one_line_and_exit_2_before_ray(capsys):
    ray_before = _ray_up()  # a session Ray another module started (when run after it) is not this test's
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = main(["serve", "default:nope/none", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and str(port) in err and "--port" in err, err
    assert ray_before or not _ray_up()


def test_the_request_evo_serve_prints_passes_the_engines_own_schema():
    from evo.serving.app import request_schema
    from evo.serving.codec import decode_request
    from evo.serving.example import example_body, example_curl
    from evo.workloads import get_workload

    workload = get_workload("kda")
    preset = workload.presets()["cpu_small"]
    specs, axes = request_schema(workload, preset)
    body = example_body(specs, axes)
    inputs = decode_request(json.dumps(body), specs, max_bytes=1 << 20, axes=axes)
    assert set(inputs) == {s.name for s in specs if s.required}
    assert inputs["q"].shape == (1, 1, preset.shape["H"], preset.shape["K"])
    command = example_curl("http://127.0.0.1:8000", specs, axes)
    assert command.startswith("curl -s http://127.0.0.1:8000/v1/infer ") and json.dumps(body, separators=(",", ":")) in command


def test_import_evo_loads_neither_torch_nor_ray():
    code = "import sys, evo; assert callable(evo.run) and callable(evo.load_run); " \
           "print(sorted(m for m in ('torch', 'ray', 'mlflow', 'pandas') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ})
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_load_run_names_what_is_missing(tmp_path):
    import evo
    from evo.driver.resume import RunDirError

    with pytest.raises(RunDirError, match="not a directory"):
        evo.load_run(tmp_path / "nowhere")


def test_a_candidate_line_says_generation_hash_status_latency_ratio_and_move():
    from evo.core.genome import Genome
    from evo.core.records import EvalResult, Evaluated, Proposal
    from evo.driver.progress import CandidateLines

    parent, child, broken = (Genome("w", fusion=(("x", v),)) for v in (1, 2, 3))
    lines = CandidateLines()
    seed = lines.line(Evaluated(Proposal(parent, (), "seed", "default genome", 0),
                                EvalResult(parent.hash, "ok", latency_ms=4.0)))
    faster = lines.line(Evaluated(Proposal(child, (parent.hash,), "memory", "x: 1 -> 2", 1),
                                  EvalResult(child.hash, "ok", latency_ms=2.0)))
    failed = lines.line(Evaluated(Proposal(broken, (child.hash,), "fusion", "x: 2 -> 3", 1),
                                  EvalResult(broken.hash, "incorrect", message="max rel error 3e-2")))
    assert seed.startswith("cand gen   0 | " + parent.hash[:12]) and "4.000 ms" in seed and "| seed " in seed
    assert "2.000 ms" in faster and "2.00x vs parent" in faster and faster.endswith("memory: x: 1 -> 2")
    assert "incorrect" in failed and "vs parent" not in failed and "(max rel error 3e-2)" in failed


def test_evo_run_applies_nested_and_dotted_overrides_to_the_file(monkeypatch, tmp_path):
    import evo
    import evo.api
    import evo.driver.run
    from evo.driver.run import RunOutcome

    seen = {}

    def fake_run(config, run_dir, verbosity):
        seen.update(config=config, run_dir=run_dir, verbosity=verbosity)
        return RunOutcome(tmp_path, None, None)

    monkeypatch.setattr(evo.driver.run, "run", fake_run)
    monkeypatch.setattr(evo.api, "load_run", lambda path: ("loaded", path))
    got = evo.run(ROOT / "configs" / "kda_smoke.yaml", overrides={"search": {"generations": 2}, "mlflow.enabled": False,
                                                                 "genes": {"chunk_size": [16]}}, quiet=True)
    config = seen["config"]
    assert got == ("loaded", tmp_path) and seen["verbosity"] == -1
    assert config.search.generations == 2 and config.mlflow.enabled is False and config.genes == {"chunk_size": [16]}
    assert config.preset == "cpu_small" and config.search.offspring == 4  # the file's other values stay


def test_report_names_the_runs_mlflow_url_from_its_run_directory(tmp_path):
    from evo.evidence.mlflow.outbox import OUTBOX_FILE, STATE_FILE
    from evo.evidence.report import _run_dir_url
    from evo.evidence.summary import SUMMARY_FILE, Summary

    assert _run_dir_url(tmp_path) == []  # MLflow was off
    (tmp_path / STATE_FILE).write_text(json.dumps({"uri": "http://127.0.0.1:5111", "experiment_id": "4", "runs": {}}))
    (tmp_path / SUMMARY_FILE).write_text(json.dumps(Summary(mlflow_run_id="abc").to_dict()))
    assert _run_dir_url(tmp_path) == ["MLflow run: http://127.0.0.1:5111/#/experiments/4/runs/abc?workflowType=machine_learning"]
    (tmp_path / SUMMARY_FILE).write_text(json.dumps(Summary().to_dict()))  # MLflow never answered
    (tmp_path / OUTBOX_FILE).write_text('{"op": "run"}\n{"op": "batch"}\n')
    (line,) = _run_dir_url(tmp_path)
    assert "2 operations pending" in line and f"mlflow-sync {tmp_path}" in line


def test_genes_takes_set_overrides_and_refuses_bad_ones_in_one_line(capsys):
    config = str(ROOT / "configs" / "llama_cpu.yaml")
    assert main(["genes", config]) == 0
    cpu = capsys.readouterr().out
    assert main(["genes", config, "--set", "preset=h200"]) == 0  # the CUDA preset's genes: a CUDA-graph step
    h200 = capsys.readouterr().out
    assert "cuda_graph" in _gene_values(h200, "decode_step") and "cuda_graph" not in _gene_values(cpu, "decode_step")
    for override, words in (("presett=cpu", ["'presett'", "allowed:", "'preset'", "'workload'"]),
                            ("preset=nope", ["'nope'", "available:", "cpu_batch"])):
        assert main(["genes", config, "--set", override]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and all(w in err for w in words), err


def _gene_values(table: str, gene: str) -> list[str]:
    """The values cell of `gene`'s row in a printed gene table."""
    header, *rows = table.splitlines()
    cell = next(row for row in rows if row.startswith(gene + " "))[header.index("values"):header.index("default")]
    return [value.strip() for value in cell.split(",")]


def test_serve_defaults_max_batch_size_to_the_verified_batch_and_refuses_more_before_ray(capsys):
    from evo.serving.serve_cli import batch_size
    from evo.serving.source import resolve

    record = resolve("default:llama/cpu_small")
    assert batch_size(record, None) == 4 and batch_size(record, 3) == 3  # llama cpu_small: verified up to B=4
    assert batch_size(resolve("default:kda/cpu_small"), None) == 8
    ray_before = _ray_up()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve", "default:llama/cpu_small", "--port", str(port), "--max-batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-batch-size 8" in err and "B=4" in err and "1..4" in err, err
    assert ray_before or not _ray_up()


def test_a_failed_deployment_is_its_replicas_last_exception_in_one_line():
    from types import SimpleNamespace

    from evo.serving.serve_cli import deployment_error

    # serve.status() after a replica failed its verification three times (Ray 2.60's message, abridged)
    message = ("The deployment failed to start 3 times in a row. This may be due to a problem with its constructor "
               "or initial health check failing. See controller logs for details. Error:\n"
               "\x1b[36mray::ServeReplica:engine:EngineServer.initialize_and_get_metadata()\x1b[39m (pid=1, ip=127.0.0.1)\n"
               '  File "ray/serve/_private/replica.py", line 1928, in initialize\n'
               "RuntimeError: Traceback (most recent call last):\n"
               '  File "evaluators/served/engine.py", line 59, in _start\n'
               "evaluators.served.engine.ServedEngineError: engine f11 failed its verification in the sandbox: incorrect\n"
               "\nThe above exception was the direct cause of the following exception:\n\n"
               '  File "evo/serving/app.py", line 325, in reconfigure\n'
               "evo.serving.app.EngineRejected: engine f11 from /runs/x: engine f11 failed its verification\n"
               "  in the sandbox: incorrect: output 'o' has 4928 non-finite values\n")
    deployment = SimpleNamespace(status="DEPLOY_FAILED", message=message)
    status = SimpleNamespace(applications={"engine": SimpleNamespace(
        status="DEPLOY_FAILED", message="Deploying app 'engine' failed", deployments={"EngineServer": deployment})})
    line = deployment_error(status, "engine", RuntimeError("Deploying application engine failed: ..."))
    assert line == ("application 'engine' failed to deploy: EngineRejected: engine f11 from /runs/x: engine f11 failed "
                    "its verification in the sandbox: incorrect: output 'o' has 4928 non-finite values")
    gone = deployment_error(None, "engine", RuntimeError("Deploying application engine failed:\n no status"))
    assert gone == "application 'engine' failed to deploy: Deploying application engine failed: no status"


def test_the_claim_is_the_paired_speedup_over_the_reference_baseline_else_the_modest_one():
    from evo.evidence.engine_record import EngineRecord
    from evo.serving.source import resolve

    record = resolve("default:llama/cpu_small")
    paired = EngineRecord(record.workload, record.preset, record.genome, "x", latency_ms=3.0,
                          speedups={"hf_sdpa": 2.5, "eager_ours": 1.2},
                          speedup_paired={"hf_sdpa": 2.04, "eager_ours": 1.1}, speedup_ci={"hf_sdpa": [1.9, 2.4],
                                                                                           "eager_ours": [1.0, 1.2]})
    assert paired.claim()["vs"] == "hf_sdpa" and paired.claim()["paired"] is True  # llama's reference baseline
    assert EngineRecord.from_dict(paired.to_dict(), "y").claim() == paired.claim()  # engine.json keeps it
    kda = resolve("default:kda/cpu_small")  # its reference (fla_chunk_kda) was not timed: the smallest claim
    other = EngineRecord(kda.workload, kda.preset, kda.genome, "x", speedup_paired={"a": 3.0, "b": 1.5},
                         speedup_ci={"a": [2.5, 3.5], "b": [1.2, 1.8]})
    assert other.claim() == {"speedup": 1.5, "low": 1.2, "high": 1.8, "vs": "b", "paired": True,
                             "text": "1.50x [1.20, 1.80] vs b (paired re-timing, 95% interval)"}
    single = EngineRecord(kda.workload, kda.preset, kda.genome, "x", speedups={"a": 4.0})
    assert single.claim()["paired"] is False and single.claim()["low"] is None and "single timing" in single.claim()["text"]
    assert kda.claim() is None  # nothing measured
