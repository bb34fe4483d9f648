"""Every way the project starts Ray listens on loopback only (or behind Ray's token): the test session's
in-process Ray and `evo run`'s. (`evo serve`'s in-process Ray with Serve's proxy is checked on the server
tests/test_llama_serving.py shares; the `ray start` of the Serve tests and of the cluster commands of
docs/cluster.md in tests/test_serving.py and tests/test_ray_job.py.) Each subprocess runs with the environment
of a user's shell (`tests.listeners.user_shell`): no Ray settings but the token, so what keeps it private is the
project's code."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from evo.driver.local_ray import is_loopback
from tests.listeners import exposed, listening, process_tree, user_shell
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[1]
USER_ENV = user_shell(dict(os.environ))


def test_addresses_that_count_as_loopback():
    assert all(map(is_loopback, ["127.0.0.1", "127.0.1.1", "::1", "::ffff:127.0.0.1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.0.2.2", "::ffff:192.0.2.2", "10.0.0.1"]))


def test_the_test_sessions_ray_listens_on_loopback_only(ray_local):
    ray_local.get(ray_local.remote(lambda: 1).remote())  # a worker process, with its own listener
    processes = process_tree(os.getpid())
    assert listening(processes), "found no listener of the session's Ray"
    assert exposed(processes) == []


def start(tmp_path: Path, args: list[str]) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "out.log"
    process = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=USER_ENV, stdin=subprocess.PIPE,
                               stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return process, log


def stop(process: subprocess.Popen) -> None:
    """Ctrl-C to the process this test started (it stops its own Ray and Serve, which signalling the
    whole group would kill under it and make its shutdown wait), then SIGKILL to what is left."""
    if process.stdin:
        process.stdin.close()  # START_RAY ends at the end of its input
    try:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # Ray's helpers left in the group
    except ProcessLookupError:
        pass


START_RAY = """
import ray, sys
from evo.driver.local_ray import start_while_importing
from ray._raylet import AuthenticationMode, get_authentication_mode
assert start_while_importing("evo.driver.run", None, 1)  # as `evo run` starts its Ray
assert "evo.driver.run" in sys.modules and "torch" in sys.modules
ray.get(ray.remote(lambda: 1).remote())
print("ready", ray.util.get_node_ip_address(), get_authentication_mode() == AuthenticationMode.TOKEN, flush=True)
sys.stdin.read()
"""


def test_evo_runs_local_ray_listens_on_loopback_only_with_token_auth(tmp_path):
    process, log = start(tmp_path, ["-c", START_RAY])
    try:
        line = wait_for(lambda: next((l for l in log.read_text().splitlines() if l.startswith("ready")), None), 120,
                        "evo.driver.local_ray.start_while_importing to start a local Ray")
        assert line.split()[1:] == ["127.0.0.1", "True"], log.read_text()[-2000:]
        processes = process_tree(process.pid)
        found = listening(processes)
        assert {name for _, name, _, _ in found} >= {"gcs_server", "raylet"}, found
        assert exposed(processes) == [], found
    finally:
        stop(process)
