"""A clean process that forks engine processes on request: `python -m evaluators.sandbox.zygote FD PATHS`.

Started once per judge process and set of preloaded modules (`Zygote.shared(preload)`: the engines of
one workload never start from a zygote that loaded another workload's modules, which may hold that
workload's reference), it imports torch and the engine-process code and never runs an engine itself, so every engine process starts in milliseconds from the same clean state
and inherits nothing of the judge (no seeds, no inputs, no references). Unlike multiprocessing's fork
server it does not re-import the judge's `__main__` (a Ray worker's, or pytest's).

Protocol on a Unix socket to the judge (both sides are ours; engines never see it):
- `{"op": "spawn", "preload": [module, ...], "jail": plan}` with one file descriptor attached (the
  engine's end of its connection): import the modules once (the workload's: later forks start with
  them loaded), fork a holder; the holder enters the plan's namespaces (`evaluators.sandbox.jail`) and forks
  the engine's process, which confines itself and runs `engine_process.main`; answer
  `{"pid": N, "holder": H, "error": ""}` once it is confined (or why it could not be);
- `{"op": "wait", "holder": H}`: wait for that holder (the judge killed the engine first), answer
  `{"exitcode": C}`, the engine process's exit code;
- `{"op": "ping"}`: answer `{"pong": true}` once started.
The zygote starts with the engines' environment (`engine_environment`: no keys, tokens or
passwords, none of Ray's or MLflow's variables), since a forked process can read the environment
it was exec'd with.
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
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Mapping

from evaluators.sandbox import jail

_MESSAGE = 4096


@dataclass(frozen=True)
class Spawned:
    """An engine process as the zygote started it: its pid (None if it never started), its holder's pid
    (what `Zygote.exitcode` waits on), the judge's end of its connection, and why confinement failed."""

    pid: int | None
    holder: int
    conn: Connection
    error: str = ""


class Zygote:
    """The judge's handle on its zygote (one per judge process, started on first use)."""

    _shared: dict[tuple[str, ...], Zygote] = {}  # by preload set, most recently used last
    _shared_lock = threading.Lock()
    KEPT = 3  # zygotes kept per judge process (one per workload in use; a hot swap may hold two; tests use many)

    @classmethod
    def shared(cls, preload: tuple[str, ...] = ()) -> Zygote:
        """The zygote for engines that need the modules `preload` (started on first use)."""
        key = tuple(sorted(set(preload)))
        with cls._shared_lock:
            current = cls._shared.pop(key, None)
            if current is None or not current.alive() or current.environment != _import_environment():
                if current is not None:
                    current.stop()
                current = cls()
            cls._shared[key] = current
            while len(cls._shared) > cls.KEPT:
                cls._shared.pop(next(iter(cls._shared))).stop()
            return current

    def __init__(self) -> None:
        self.environment = _import_environment()
        ours, theirs = socket.socketpair()
        self._sock = ours
        self._lock = threading.Lock()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "evaluators.sandbox.zygote", str(theirs.fileno()), json.dumps(sys.path)],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=engine_environment(os.environ),
        )
        theirs.close()
        atexit.register(self.stop)

    def alive(self) -> bool:
        return self._process.poll() is None

    def spawn(self, preload: tuple[str, ...] = (), plan: dict | None = None) -> Spawned:
        """A new engine process, confined by `plan` (a `JailPlan` as JSON; None: unconfined)."""
        judge_end, engine_end = socket.socketpair()
        request = json.dumps({"op": "spawn", "preload": list(preload), "jail": plan}).encode()
        with self._lock:
            socket.send_fds(self._sock, [request], [engine_end.fileno()])
            engine_end.close()
            answer = self._answer()
        return Spawned(answer.get("pid"), int(answer["holder"]), Connection(judge_end.detach()),
                       str(answer.get("error") or ""))

    def wait_ready(self) -> None:
        """Return once the zygote has finished starting (its imports would disturb a measurement)."""
        with self._lock:
            self._sock.sendall(json.dumps({"op": "ping"}).encode())
            self._answer()

    def exitcode(self, holder: int) -> int | None:
        """Wait for a (killed or exited) engine process's holder; the engine process's exit code
        (negative: the signal that ended it)."""
        with self._lock:
            self._sock.sendall(json.dumps({"op": "wait", "holder": holder}).encode())
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
    from evaluators.sandbox import engine_process  # preloaded here, so each fork starts ready

    reports: dict[int, _Reports] = {}
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
            plan = request.get("jail")
            view = _view_of(plan)
            report_r, report_w = os.pipe()
            holder = os.fork()
            if holder == 0:
                sock.close()
                os.close(report_r)
                _hold(engine_process, fds[0], plan, view, report_w)
            os.close(report_w)
            for fd in fds:
                os.close(fd)
            reports[holder] = _Reports(report_r)
            answer = reports[holder].until_started()
            sock.sendall(json.dumps({**answer, "holder": holder}).encode())
        elif request["op"] == "ping":
            sock.sendall(json.dumps({"pong": True}).encode())
        elif request["op"] == "wait":
            holder = int(request["holder"])
            code: Any = reports.pop(holder).exit_code() if holder in reports else None
            try:
                os.waitpid(holder, 0)
            except ChildProcessError:
                pass
            sock.sendall(json.dumps({"exitcode": code}).encode())


class _Reports:
    """The lines a holder and its engine process write on their report pipe: `pid N` (the holder),
    `jail ok` or `jail <error>` (the engine process, once confined), `exit C` (the holder, at the end)."""

    def __init__(self, fd: int) -> None:
        self._file = os.fdopen(fd, "r")
        self.lines: dict[str, str] = {}

    def _next(self) -> bool:
        line = self._file.readline()
        if not line:
            return False
        key, _, value = line.strip().partition(" ")
        self.lines[key] = value
        return True

    def until_started(self) -> dict:
        while ("pid" not in self.lines or "jail" not in self.lines) and self._next():
            pass
        jail = self.lines.get("jail", "the engine process ended before it was confined")
        if "pid" not in self.lines:
            return {"pid": None, "error": self.lines.get("error", "the holder process died")}
        return {"pid": int(self.lines["pid"]), "error": "" if jail == "ok" else jail}

    def exit_code(self) -> int | None:
        while "exit" not in self.lines and self._next():
            pass
        self._file.close()
        value = self.lines.get("exit")
        return int(value) if value not in (None, "") else None


def _view_of(plan: dict | None) -> Any:
    """The files the engine process will see (computed here, before the fork, and cached: the view
    depends on the modules loaded so far, the hidden paths and the device)."""
    if plan is None:
        return None
    from evaluators.sandbox import seccomp
    from evaluators.sandbox.view import declared_view

    seccomp.program()  # compiled once here, loaded by each engine process

    return declared_view(plan.get("hidden", ()), list(sys.modules), bool(plan.get("cuda")), bool(plan.get("trusted")),
                         plan.get("readable", ()), plan.get("cache", ""))


def _hold(engine_process: Any, fd: int, plan: dict | None, view: Any, report: int) -> None:
    """The holder: enter the new namespaces, fork the engine's process, wait for it, report its exit.
    If the zygote dies first (its judge died), the holder is told (SIGTERM) and ends the candidate
    itself: a frozen process would not die of its own parent-death signal until someone thawed it."""
    code = 0
    released: list[bool] = []
    try:
        confinement = jail.JailPlan.from_json(plan) if plan is not None else None
        pid = 0

        def orphaned(signum: int, frame: Any) -> None:
            released.append(True)
            jail.release(confinement, pid) if confinement is not None else os.kill(pid, signal.SIGKILL)

        signal.signal(signal.SIGTERM, orphaned)
        engine_process.die_with_parent(signal.SIGTERM)
        if confinement is not None:
            jail.enter_namespaces(confinement)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _child(engine_process, fd, plan, view, report)
        os.close(fd)
        os.write(report, f"pid {pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        if released and confinement is not None:
            jail.remove_groups(confinement)
        os.write(report, f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
    except BaseException as exc:  # noqa: BLE001 - reported to the zygote, which tells the judge
        try:
            os.write(report, f"error {type(exc).__name__}: {exc}\n".replace("\n", " ").encode() + b"\n")
        except OSError:
            pass
        code = 1
    finally:
        os._exit(code)


def _preload(modules: Any) -> None:
    """Import each module and the modules it imports on first use (`evo.workloads.lazy`: a workload's
    engine, baselines and reference), so engine processes start with them loaded, before any jail. An entry
    `module:function` also calls the module's function (no arguments), e.g. to load compiled kernels that a
    jailed process could not build or find (`Workload.engine_preload`)."""
    from evo.workloads.lazy import load_all

    for entry in modules:
        name, _, call = entry.partition(":")
        try:
            module = importlib.import_module(name)
            if call:
                getattr(module, call)()
        except Exception:  # noqa: BLE001 - the engine's process imports it again and reports the error
            pass
    try:
        load_all()
    except Exception:  # noqa: BLE001 - as above
        pass


def _import_environment() -> dict[str, str]:
    """The environment variables that change what importing torch, triton and friends does."""
    return {k: v for k, v in os.environ.items() if k.startswith(_IMPORT_PREFIXES)}


_IMPORT_PREFIXES = ("TRITON", "TORCH", "PYTORCH", "CUDA", "OMP", "MKL", "KMP", "OPENBLAS", "LD_", "PYTHON",
                    "FLA_")  # FLA_: fla's config cache (FLA_CACHE_MODE, FLA_CONFIG_DIR), read when it is imported
_ENGINE_NAMES = ("PATH", "LANG", "LANGUAGE", "TZ", "CC", "CXX", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES")
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSW", "CREDENTIAL", "AUTH", "COOKIE", "SESSION")


def engine_environment(env: Mapping[str, str]) -> dict[str, str]:
    """What an engine may see of the judge's environment: the variables that steer torch, Triton, CUDA
    and the thread pools, the locale and PATH; nothing whose name suggests a secret."""
    kept = {k: v for k, v in env.items()
            if (k in _ENGINE_NAMES or k.startswith(_IMPORT_PREFIXES) or k.startswith("LC_"))
            and not any(word in k.upper() for word in _SECRET_WORDS)}
    return kept


def _child(engine_process: Any, fd: int, plan: dict | None, view: Any, report: int) -> None:
    """The engine's process: confined (when there is a plan) before any engine code, then the engine."""
    code = 0
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        try:
            if plan is not None:
                jail.confine(jail.JailPlan.from_json(plan), keep_fds=(fd, report), view=view)
            os.write(report, b"jail ok\n")
        except BaseException as exc:  # noqa: BLE001 - the engine must not run unconfined
            os.write(report, f"jail {type(exc).__name__}: {exc}".replace("\n", " ").encode() + b"\n")
            raise
        os.close(report)
        engine_process.main(Connection(fd))
    except BaseException:  # noqa: BLE001 - the judge sees the closed connection
        code = 1
    finally:
        os._exit(code)


def main(argv: list[str]) -> None:
    fd, paths = int(argv[0]), json.loads(argv[1])
    sys.path[:] = paths
    from evaluators.sandbox.engine_process import die_with_parent

    die_with_parent()
    import torch  # noqa: F401 - every engine process starts with it loaded; torch._dynamo (~2 s of CPU, what
    # torch.compile and deterministic mode import) only where a spawn's preload names it

    _serve(socket.socket(fileno=fd))


if __name__ == "__main__":
    main(sys.argv[1:])
