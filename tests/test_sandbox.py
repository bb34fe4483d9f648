"""The strict sandbox holds against the attacks of tests/adversaries.py: an engine cannot read or signal
the judge, write the project, load the reference, a baseline or the judge's modules, find the judge's
secrets, run on cores it was not given, leave a process behind, or have work count that finished after
its answer. Each probe is shown to succeed without the sandbox, so a probe that does nothing cannot pass.

These need root, Linux namespaces and libseccomp (as CI has); they are skipped, with the reason, where
the judge cannot build its jail."""
from __future__ import annotations

import ctypes
import errno
import os
import signal
from pathlib import Path

import pytest
import torch

from evaluators.judge.check import expected_dtypes
import evaluators.judge.evaluator as evaluator_module
from evaluators.judge.evaluator import Evaluator
from evaluators.machine import device as devices
from evaluators.sandbox import jail
from evaluators.sandbox.guard import hidden_paths
from evaluators.sandbox.process import EngineProcess, _members, workload_modules
from evaluators.settings import EvaluatorSettings
from evo.core.records import INCORRECT, OK
from tests import adversaries
from tests import fake_workload as fw
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(bool(jail.unavailable()), reason=f"no jail here: {jail.unavailable()}")

FAST = EvaluatorSettings(warmup=1, repeats=3)
NONE = EvaluatorSettings(warmup=1, repeats=3, sandbox="none")
HAS_GIT = (adversaries.ROOT / ".git").exists()


def _evaluator(monkeypatch, workload, settings, preset="cpu") -> Evaluator:
    monkeypatch.setattr(evaluator_module, "get_workload", lambda name: workload)
    return Evaluator(workload.name, preset, settings, seed=3, name=f"sandbox-{settings.sandbox}")


def _evaluate(ev: Evaluator, attack: str):
    return ev.evaluate(adversaries.genome_json(ev.workload, ev.preset.name, attack, ev.device_info()))


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv("EVO_TEST_API_TOKEN", adversaries.SECRET)


FAKE_ATTACKS = ["read_judge_memory", "signal_judge", "write_project", "load_judge_module", "read_secret_env",
                *(["read_git_objects"] if HAS_GIT else [])]


@pytest.mark.parametrize("attack", FAKE_ATTACKS)
def test_an_attack_from_inside_finds_nothing(monkeypatch, secret, attack):
    """The engine tries the attack at build; had it worked, its answers would be wrong. 'ok' with an
    honest error and the sandbox named in the result: the attack got nothing."""
    ev = _evaluator(monkeypatch, adversaries.AttackWorkload(fw.WORKLOAD, "attack_fake"), FAST)
    r = _evaluate(ev, attack)
    assert r.status == OK, f"{attack}: {r.status} {r.message}\n{r.error}"
    assert r.max_rel_error < 1e-5 and r.versions["sandbox"] == "strict"


def test_a_fresh_copy_of_the_reference_cannot_be_loaded(monkeypatch):
    ev = _evaluator(monkeypatch, adversaries.AttackWorkload(adversaries._kda(), "attack_kda"), FAST, "cpu_small")
    r = _evaluate(ev, "load_reference_copy")
    assert r.status == OK and r.max_rel_error < 1e-5, f"{r.status} {r.message}\n{r.error}"


@pytest.mark.parametrize("attack", ["read_judge_memory", "signal_judge", "write_project", "load_judge_module",
                                    *(["read_git_objects"] if HAS_GIT else [])])
def test_without_the_sandbox_the_same_probes_succeed(monkeypatch, attack):
    """The fixtures are real: with `sandbox: none` each attack works, so its engine comes back wrong."""
    ev = _evaluator(monkeypatch, adversaries.AttackWorkload(fw.WORKLOAD, "attack_fake"), NONE)
    r = _evaluate(ev, attack)
    assert r.status == INCORRECT, f"{attack}: {r.status} {r.message}"
    assert r.versions["sandbox"] == "none"


def test_a_jailed_engine_sees_only_its_declared_view(monkeypatch):
    """The engine walks the whole file tree and tries the project's tests, docs, scripts and configs, a
    sibling folder of the checkout, /root, /home, other site-packages: nothing outside the declared view
    (`evaluators.sandbox.view`) exists for it. Without the sandbox the same walk finds them."""
    workload = adversaries.with_view(adversaries.AttackWorkload(fw.WORKLOAD, "attack_fake"))
    r = _evaluate(_evaluator(monkeypatch, workload, FAST), "escape_view")
    assert r.status == OK, f"{r.status} {r.message}\n{r.error}"
    unconfined = _evaluate(_evaluator(monkeypatch, workload, NONE), "escape_view")
    assert "outside the declared view" in unconfined.message and "tests/__init__.py" in unconfined.message, \
        unconfined.message


def test_a_file_the_workload_declares_is_readable_even_under_tmp(monkeypatch, tmp_path):
    """What lies under a private folder of the view (a checkout, a venv or a checkpoint in /tmp) is bound in
    after that folder's tmpfs, read-only: an engine that must read its workload's file reads it."""
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w" * 64)
    workload = adversaries.AttackWorkload(fw.WORKLOAD, "attack_fake")
    workload.engine_file = str(weights.resolve())
    r = _evaluate(_evaluator(monkeypatch, workload, FAST), "read_engine_file")
    assert r.status == OK, f"{r.status} {r.message}\n{r.error}"
    assert str(weights.resolve()).startswith("/tmp/") or not str(tmp_path).startswith("/tmp/")


def test_the_reference_helpers_are_out_of_reach(monkeypatch):
    """An engine's process never loads the reference module (nor the baselines): not importable, not in
    sys.modules, no function of it alive in memory."""
    ev = _evaluator(monkeypatch, adversaries.AttackWorkload(adversaries._kda(), "attack_kda"), FAST, "cpu_small")
    r = _evaluate(ev, "reference_helpers")
    assert r.status == OK and r.max_rel_error < 1e-5, f"{r.status} {r.message}\n{r.error}"


def test_outputs_written_after_the_answer_do_not_count(monkeypatch):
    ev = _evaluator(monkeypatch, adversaries.AttackWorkload(fw.WORKLOAD, "attack_fake"), FAST)
    r = _evaluate(ev, "late_writer")
    assert r.status == INCORRECT, f"{r.status} {r.message}"
    assert "non-finite" in r.message or "changed after the engine returned" in r.message, r.message


# ---------------------------------------------------------------- one engine process, seen from the judge
def _started(workload, attack: str, sandbox: str = "strict", cores=None, preset: str = "cpu") -> EngineProcess:
    p = workload.presets()[preset]
    info = devices.device_info("cpu", 1)
    process = EngineProcess("cpu", threads=1, sandbox=sandbox, cores=cores,
                            hidden=hidden_paths(workload) if sandbox == "strict" else ())
    process.launch(preload=workload_modules(workload))
    process.configure(workload, p, info, genome_json=adversaries.genome_json(workload, preset, attack, info))
    built = process.build(timeout_s=120)
    assert built["op"] == "built", built
    return process


def _call_error(process: EngineProcess, workload, preset: str = "cpu") -> float:
    """One call at the timing case; the largest absolute error against the reference."""
    p = workload.presets()[preset]
    inputs = workload.make_inputs(workload.timing_case(p), p.dtype, "cpu", 7)
    reference = workload.reference(inputs)
    dtypes = expected_dtypes(workload, p)
    result = process.call(inputs, {k: (tuple(v.shape), dtypes[k]) for k, v in reference.items()}, timeout_s=120)
    assert result.reply.get("op") == "returned" and result.outputs is not None, result.reply
    return max(float((result.outputs[k].double() - reference[k]).abs().max()) for k in reference)


def test_no_process_of_a_candidate_outlives_it():
    """A double-forked setsid daemon is frozen with its candidate and killed with it: after close no
    process of that PID namespace or cgroup remains."""
    workload = adversaries.AttackWorkload(fw.WORKLOAD, "attack_fake")
    process = _started(workload, "setsid_daemon")
    namespace, cgroup = process._namespace, process._cgroup
    assert _call_error(process, workload) < 1e-4
    assert len(_members(namespace)) >= 2  # the engine's process and its daemon
    process.close()
    assert process.survivors == ()
    assert _members(namespace) == set() and cgroup.pids() == set()
    assert all(not Path(procs).parent.exists() for procs in cgroup.procs_files)


def test_without_the_sandbox_the_daemon_survives(tmp_path):
    workload = adversaries.AttackWorkload(fw.WORKLOAD, "attack_fake", probe_dir=str(tmp_path))
    process = _started(workload, "setsid_daemon", sandbox="none")
    pid_file = tmp_path / "daemon.pid"
    try:
        wait_for(pid_file.exists, timeout=60, what="the daemon's pid file")
        daemon = int(pid_file.read_text())
        process.close()
        assert os.path.exists(f"/proc/{daemon}")  # the process group kill did not reach it
    finally:
        process.close()
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("sandbox", ["strict", "none"])
def test_widening_the_affinity_gains_no_core(sandbox):
    """The engine is given one core; it asks for all. In the strict sandbox its cpuset keeps it on that
    core (its answers stay right and the kernel lists that core alone); without, it gets them all."""
    mine = (min(os.sched_getaffinity(0)),)
    workload = adversaries.AttackWorkload(fw.WORKLOAD, "attack_fake", cores=mine)
    with _started(workload, "widen_affinity", sandbox=sandbox, cores=mine) as process:
        error = _call_error(process, workload)
        allowed = _cpus_allowed(process.pid)
    if sandbox == "strict":
        assert error < 1e-4 and allowed == set(mine)
    else:
        assert error > 0.5 and allowed > set(mine)


def _cpus_allowed(pid: int) -> set[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            cpus: set[int] = set()
            for part in line.split(":")[1].strip().split(","):
                lo, _, hi = part.partition("-")
                cpus |= set(range(int(lo), int(hi or lo) + 1))
            return cpus
    raise AssertionError("no Cpus_allowed_list")


def test_the_engine_runs_unprivileged_and_filtered():
    """From inside: another user, no capabilities, no_new_privs, a seccomp filter, PID 1 of its own
    namespace, the reference and the judge's package unreadable (checked on the process from outside)."""
    workload = adversaries.AttackWorkload(adversaries._kda(), "attack_kda")
    with _started(workload, adversaries.NONE, preset="cpu_small") as process:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{process.pid}/status").read_text().splitlines())
        assert status["Uid"].split()[0] == str(jail.NOBODY)
        assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0
        assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"
        assert status["NSpid"].split()[-1] == "1"
        assert os.readlink(f"/proc/{process.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")


def test_the_seccomp_filter_refuses_what_reaches_other_processes():
    from evaluators.sandbox import seccomp

    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            seccomp.install()
            libc = ctypes.CDLL(None, use_errno=True)
            for call in (lambda: libc.ptrace(16, os.getppid(), 0, 0), lambda: libc.unshare(0x20000000),
                         lambda: libc.mount(b"none", b"/mnt", b"tmpfs", 0, None)):
                if call() != -1 or ctypes.get_errno() != errno.EPERM:
                    code = 2
            child = os.fork()  # what honest engines do still works
            if child == 0:
                os._exit(0)
            os.waitpid(child, 0)
        except BaseException:  # noqa: BLE001
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_bad_sandbox_setting_names_what_is_allowed():
    with pytest.raises(ValueError, match="sandbox.*'strict'.*'none'"):
        EvaluatorSettings(sandbox="bubblewrap")


def test_no_key_or_secret_reaches_the_engine(secret):
    from evaluators.sandbox.zygote import engine_environment

    env = engine_environment({**os.environ, "OPENAI_API_KEY": "x", "MLFLOW_TRACKING_PASSWORD": "y",
                              "RAY_ADDRESS": "z", "OMP_NUM_THREADS": "1"})
    assert "OPENAI_API_KEY" not in env and "MLFLOW_TRACKING_PASSWORD" not in env and "RAY_ADDRESS" not in env
    assert "EVO_TEST_API_TOKEN" not in env and env["OMP_NUM_THREADS"] == "1"


def test_honest_engines_pass_in_both_sandboxes(monkeypatch):
    for settings in (FAST, NONE):
        r = _evaluate(_evaluator(monkeypatch, adversaries.AttackWorkload(fw.WORKLOAD, "attack_fake"), settings),
                      adversaries.NONE)
        assert r.status == OK and r.max_rel_error < 1e-5, r.message
        assert torch.isfinite(torch.tensor(r.latency_ms))


def test_torch_compile_keeps_working_inside(monkeypatch):
    """An honest engine's build tools run in the sandbox: torch.compile, Inductor's C++ toolchain and its
    caches (in the engine's private /tmp)."""
    ev = _evaluator(monkeypatch, adversaries.AttackWorkload(fw.WORKLOAD, "attack_fake"), FAST)
    r = _evaluate(ev, "torch_compile")
    assert r.status == OK and r.max_rel_error < 1e-5, f"{r.status} {r.message}\n{r.error}"
    assert r.versions["sandbox"] == "strict"


def test_a_compiled_baseline_fills_the_machines_cache_which_no_candidate_sees(monkeypatch, tmp_path):
    """A baseline (trusted) compiles into the machine's baseline cache, bound read-write into its view
    only; a candidate's view holds no such folder, so nothing a candidate writes reaches a baseline."""
    from evaluators.sandbox.view import BASELINE_CACHE, declared_view

    monkeypatch.setenv("EVO_BASELINE_CACHE", str(tmp_path / "cache"))
    assert declared_view((), (), trusted=True, cache=str(tmp_path)).allows(BASELINE_CACHE + "/.inductor_cache")
    candidate = declared_view((), (), cache=str(tmp_path))  # a candidate's view never holds it
    assert not candidate.writable and not candidate.allows(BASELINE_CACHE)
    ev = _evaluator(monkeypatch, adversaries.CompiledBaselineWorkload(fw.WORKLOAD, "attack_fake"), FAST)
    r = ev.evaluate_baseline("compiled")
    assert r.status == OK and r.versions["sandbox"] == "strict", f"{r.status} {r.message}\n{r.error}"
    cached = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert cached and all(p.stat().st_uid == jail.NOBODY for p in cached), cached[:5]  # written from inside


_DYING_JUDGE = """
import os, signal, sys
sys.path.insert(0, {root!r})
from tests import adversaries, test_sandbox
from tests import fake_workload as fw
workload = adversaries.AttackWorkload(fw.WORKLOAD, "attack_fake")
process = test_sandbox._started(workload, adversaries.NONE)
test_sandbox._call_error(process, workload)  # answered: the candidate is frozen now
print(process.pid, *[os.path.dirname(p) for p in process._cgroup.procs_files], flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_judge_killed_while_its_candidate_is_frozen_leaves_nothing_behind():
    """The judge dies by SIGKILL (a Ray actor killed) with its candidate frozen: its zygote dies with
    it, the holder is told, kills and thaws the candidate and removes its cgroups."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _DYING_JUDGE.format(root=str(adversaries.ROOT))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    pid, *groups = done.stdout.split()
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _state_of(pid) == "Z", 60, "the engine process to die")
    wait_for(lambda: not any(os.path.exists(g) for g in groups), 60, "its cgroups to be removed")


def _state_of(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
