"""A clean process that forks engine processes on request: `python -m evaluators.zygote FD PATHS`.

Started once per judge process (`Zygote.shared()`), it imports torch and the engine-process code and
never runs an engine itself, so every engine process starts in milliseconds from the same clean state
and inherits nothing of the judge (no seeds, no inputs, no references). Unlike multiprocessing's fork
server it does not re-import the judge's `__main__` (a Ray worker's, or pytest's).

Protocol on a Unix socket to the judge (both sides are ours; engines never see it):
- `{"op": "spawn", "preload": [module, ...]}` with one file descriptor attached (the engine's end of
  its connection): import the modules once (the workload's: later forks start with them loaded), fork;
  the child closes the zygote's socket, starts its own session and runs `engine_process.main`; answer
  `{"pid": N}`;
- `{"op": "wait", "pid": N}`: reap that child (the judge killed it first), answer `{"exitcode": C}`;
- `{"op": "ping"}`: answer `{"pong": true}` once started.
The zygote and its children die with the judge (PR_SET_PDEATHSIG). Modules read some environment
variables when they are imported (TRITON_INTERPRET, TORCH_*, CUDA_*, ...): when those differ in the
judge from what the zygote started with, `Zygote.shared()` starts a new zygote.
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

_MESSAGE = 4096


class Zygote:
    """The judge's handle on its zygote (one per judge process, started on first use)."""

    _shared: Zygote | None = None
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> Zygote:
        with cls._shared_lock:
            current = cls._shared
            if current is None or not current.alive() or current.environment != _import_environment():
                if current is not None:
                    current.stop()
                cls._shared = cls()
            return cls._shared

    def __init__(self) -> None:
        self.environment = _import_environment()
        ours, theirs = socket.socketpair()
        self._sock = ours
        self._lock = threading.Lock()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "evaluators.zygote", str(theirs.fileno()), json.dumps(sys.path)],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
        )
        theirs.close()
        atexit.register(self.stop)

    def alive(self) -> bool:
        return self._process.poll() is None

    def spawn(self, preload: tuple[str, ...] = ()) -> tuple[int, Connection]:
        """A new engine process: (pid, the judge's end of its connection)."""
        judge_end, engine_end = socket.socketpair()
        request = json.dumps({"op": "spawn", "preload": list(preload)}).encode()
        with self._lock:
            socket.send_fds(self._sock, [request], [engine_end.fileno()])
            engine_end.close()
            answer = self._answer()
        return int(answer["pid"]), Connection(judge_end.detach())

    def wait_ready(self) -> None:
        """Return once the zygote has finished starting (its imports would disturb a measurement)."""
        with self._lock:
            self._sock.sendall(json.dumps({"op": "ping"}).encode())
            self._answer()

    def exitcode(self, pid: int) -> int | None:
        """Reap a (killed or exited) engine process and return its exit code (negative: signal)."""
        with self._lock:
            self._sock.sendall(json.dumps({"op": "wait", "pid": pid}).encode())
            return self._answer().get("exitcode")

    def stop(self) -> None:
        if self.alive():
            self._process.kill()
            self._process.wait(timeout=10)
        self._sock.close()

    def _answer(self) -> dict:
        data = self._sock.recv(_MESSAGE)
        if not data:
            raise RuntimeError(f"the zygote (pid {self._process.pid}) exited with {self._process.poll()}")
        return json.loads(data)


def _serve(sock: socket.socket) -> None:
    from evaluators import engine_process  # preloaded here, so each fork starts ready

    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 4)
        except OSError:
            return
        if not message:
            return
        request = json.loads(message)
        if request["op"] == "spawn":
            _preload(request.get("preload", ()))
            pid = os.fork()
            if pid == 0:
                sock.close()
                _child(engine_process, fds[0])
            for fd in fds:
                os.close(fd)
            sock.sendall(json.dumps({"pid": pid}).encode())
        elif request["op"] == "ping":
            sock.sendall(json.dumps({"pong": True}).encode())
        elif request["op"] == "wait":
            try:
                _, status = os.waitpid(int(request["pid"]), 0)
                code: Any = os.waitstatus_to_exitcode(status)
            except ChildProcessError:
                code = None
            sock.sendall(json.dumps({"exitcode": code}).encode())


def _preload(modules: Any) -> None:
    for name in modules:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the engine's process imports it again and reports the error
                pass


def _import_environment() -> dict[str, str]:
    """The environment variables that change what importing torch, triton and friends does."""
    prefixes = ("TRITON", "TORCH", "PYTORCH", "CUDA", "OMP", "MKL", "KMP", "OPENBLAS", "LD_", "PYTHON")
    return {k: v for k, v in os.environ.items() if k.startswith(prefixes)}


def _child(engine_process: Any, fd: int) -> None:
    code = 0
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        engine_process.main(Connection(fd))
    except BaseException:  # noqa: BLE001 - the judge sees the closed connection
        code = 1
    finally:
        os._exit(code)


def main(argv: list[str]) -> None:
    fd, paths = int(argv[0]), json.loads(argv[1])
    sys.path[:] = paths
    from evaluators.engine_process import die_with_parent

    die_with_parent()
    import torch

    # Switching deterministic mode imports torch._dynamo & co. (~900 modules, seconds): do it once here
    # so each engine process only flips the flag. The zygote itself runs no engine; leave it off.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.use_deterministic_algorithms(False)

    _serve(socket.socket(fileno=fd))


if __name__ == "__main__":
    main(sys.argv[1:])
