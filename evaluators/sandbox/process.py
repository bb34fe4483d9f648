"""The judge's side of an engine's own process: start it, have it build the engine, call it, kill it.

One fresh process per candidate (forked from a clean zygote that only imported torch, never an engine,
see `evaluators.sandbox.zygote`), so whatever an engine patches or leaks dies with it. With `sandbox="strict"`
(the default) the process is confined before any engine code runs (`evaluators.sandbox.jail`): an unprivileged
user with no capabilities and a seccomp filter, in PID, mount, IPC, UTS and network namespaces of its
own, a read-only view of the files with the reference, the baselines and the judge's modules hidden,
a private /tmp, and cgroups (`evaluators.sandbox.cgroups`) that bound its cores, memory and processes. The judge:
- sends pickles (it is trusted) and reads only size-capped JSON back (the engine is not); shared
  arenas travel as file descriptors over the engine's own channel (no key of the judge's is handed out);
- writes each call's inputs into a shared arena and NaN-fills the output slots before the call;
- owns the clock: wall time from sending the call to its answer, which comes only after the engine's
  outputs were copied into the judge's arena (and, on CUDA, the device synchronised);
- at each answer copies the outputs, freezes the whole candidate (cgroup freezer: every process it
  started, whatever it called) and compares: an output that changed after the answer counts as late;
  the candidate stays frozen until the next call, so nothing of it runs while the judge reads and
  computes; on CUDA, where queued kernels are not stopped by a freeze, it re-reads after `settle_s`;
- enforces deadlines itself, and at the end kills the candidate as a whole (its PID namespace dies
  with its first process) and verifies that none of its processes remains (`survivors`).
With `sandbox="none"` the process runs as the judge's user in the judge's namespaces, frozen and killed
by process group (for trusted engines only; every result says which sandbox judged it).
"""
from __future__ import annotations

import json
import math
import os
import pickle
import pickletools
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Mapping, Sequence

import torch

from evaluators.machine.device import sync
from evaluators.sandbox import arena as arenas
from evaluators.sandbox import jail
from evaluators.sandbox.cgroups import CandidateCgroup
from evaluators.sandbox.view import BASELINE_CACHE, baseline_cache
from evaluators.sandbox.zygote import Zygote, engine_environment
from evo.workloads.base import DeviceInfo, Preset

_MAX_MESSAGE = 1 << 20  # bytes: the largest answer the judge reads from an engine's process
_FREEZE_WAIT_S = 10.0  # a candidate that cannot be stopped in this long is killed
_MAX_PIDS = 512  # processes and threads of one candidate
SANDBOXES = ("strict", "none")


class EngineProcessError(Exception):
    """The engine's process died, hung past its deadline or broke the protocol (`kind` says which)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "died" | "timeout" | "protocol" | "sandbox"


@dataclass(frozen=True)
class CallResult:
    """One call as the judge saw it. `outputs` are the judge's own copies (None unless the engine
    returned without a problem)."""

    elapsed_s: float
    reply: dict
    outputs: dict[str, torch.Tensor] | None
    inputs_changed: tuple[str, ...] = ()
    late: tuple[str, ...] = ()
    forbidden: tuple[str, ...] = field(default=())


class EngineProcess:
    """One engine in its own process. Use as a context manager; `close()` kills the whole candidate."""

    def __init__(self, device: str, *, threads: int | None = None, settle_s: float = 0.0, poison: bool = False,
                 memory_bytes: int | None = None, network: bool = False, sandbox: str = "strict",
                 hidden: tuple[str, ...] = (), trusted: bool = False, readable: tuple[str, ...] = (),
                 cores: tuple[int, ...] | None = None,
                 arena_pool: arenas.ArenaPool | None = None) -> None:
        if sandbox not in SANDBOXES:
            raise ValueError(f"sandbox must be one of {SANDBOXES}, got {sandbox!r}")
        self.device = torch.device(device)
        self.threads = threads or torch.get_num_threads()
        self.settle_s = settle_s
        self.poison = poison
        self.memory_bytes = memory_bytes  # RLIMIT_AS of the engine's process (CPU engines), None: unlimited
        self.network = network
        self.sandbox = sandbox
        self.hidden = tuple(hidden)  # paths the engine's view leaves out (strict sandbox)
        self.trusted = trusted  # a baseline: its view also holds the libraries baselines build on
        self.readable = tuple(readable)  # files its engine reads (Workload.engine_files), in its view read-only
        self.cores = tuple(sorted(cores or os.sched_getaffinity(0)))  # the engine's, enforced by its cpuset
        self.pid: int | None = None
        self.conn: Any = None
        self.survivors: tuple[int, ...] = ()  # processes of the candidate still there after close()
        self._holder: int | None = None
        self._sock: socket.socket | None = None
        self._cgroup: CandidateCgroup | None = None
        self._namespace = ""  # the candidate's PID namespace (strict), to find its processes without a freezer
        self._zygote: Zygote | None = None
        self._exitcode: int | None = None
        self._reaped = False
        self._killed = False
        # The judge's arenas: lent by the evaluator's pool (allocated once per evaluator, reused across
        # candidates), else by a pool of this process's own, freed at close.
        self._own_pool = arena_pool is None
        self._pool = arena_pool if arena_pool is not None else arenas.ArenaPool(str(self.device))
        self._pair: arenas.ArenaPair | None = None
        self._sent_version = -1  # the version of the pair this engine's process has mapped
        self._guard = _Watchdog(self._kill)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ lifecycle
    def launch(self, preload: tuple[str, ...] = ()) -> None:
        """Fork the engine's process from the zygote (waits for the zygote to be ready on first use),
        confined as `sandbox` says; `preload` names modules (the workload's) the zygote imports once for
        every later fork."""
        self._zygote = Zygote.shared(preload)
        plan = None
        if self.sandbox == "strict":
            cpu = self.device.type == "cpu"
            self._cgroup = CandidateCgroup(self.cores, self.memory_bytes if cpu else None, _MAX_PIDS, self.threads)
            # Its own IPC namespace and /dev/shm on every device: CUDA arenas travel as descriptors over
            # its channel, as CPU ones do (`evaluators.sandbox.cuda_memory`), so it needs nothing of the judge's.
            plan = jail.JailPlan(cgroup_procs=tuple(self._cgroup.procs_files), hidden=self.hidden,
                                 network=self.network, cuda=not cpu, trusted=self.trusted,
                                 readable=self.readable, cache=baseline_cache() if self.trusted else "").to_json()
        spawned = self._zygote.spawn(preload, plan)
        self._holder, self.pid, self.conn = spawned.holder, spawned.pid, spawned.conn
        self._sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        if spawned.error or self.pid is None:
            self.close()
            raise EngineProcessError("sandbox", f"the engine's process could not be confined: {spawned.error}")
        if self.sandbox == "strict":
            self._namespace = _namespace_of(self.pid)

    def configure(self, workload: Any, preset: Preset, info: DeviceInfo, *, genome_json: str | None = None,
                  baseline: str | None = None, guarded: bool = True, sources: Mapping[str, str] | None = None,
                  contract: str = "call") -> None:
        """Tell the launched process its environment, cores, threads and which engine it will build."""
        if self.pid is None:
            self.launch()
        try:
            workload_bytes, workload_name = pickle.dumps(workload), None
        except Exception:  # a workload object that does not pickle is looked up by name there
            workload_bytes, workload_name = None, workload.name
        env = engine_environment(os.environ)
        if self.sandbox == "strict":  # its own /tmp is the only place it can write (a baseline: also its cache)
            cache = BASELINE_CACHE if self.trusted else "/tmp"
            env.update(HOME="/tmp", TMPDIR="/tmp", TRITON_CACHE_DIR=f"{cache}/.triton/cache",
                       TORCHINDUCTOR_CACHE_DIR=f"{cache}/.inductor_cache")
        spec = {
            "env": env, "cores": list(self.cores),
            "threads": self.threads, "device": str(self.device), "poison": self.poison,
            "memory_bytes": self.memory_bytes if self.device.type == "cpu" else None,
            "network": self.network or self.sandbox == "strict",  # strict: cut by its namespace already
            "workload": workload_bytes, "workload_name": workload_name, "preset": preset, "info": info,
            "genome": genome_json, "baseline": baseline, "guarded": guarded, "sources": dict(sources or {}),
            "contract": contract,  # "call": engine(**inputs) -> outputs; "generation": add / step
        }
        self._send(ForkingPickler.dumps(spec), math.inf)

    def calibrate(self, inputs: Mapping[str, torch.Tensor | None], outputs: Mapping[str, tuple[Sequence[int], str]],
                  repeats: int = 7, timeout_s: float = 60.0) -> float:
        """The judge's least cost of one call with no engine: the fastest of `repeats` echo calls (arena
        views built, outputs of these sizes copied in, device synchronised), measured before the engine
        is built, so no engine code can have touched it. Subtracted from every timed call: the least
        cost, so that noise never makes an engine look faster than it is."""
        samples = []
        for _ in range(repeats):
            elapsed, reply, _, _, _, _ = self._exchange("echo", inputs, outputs, timeout_s)
            if reply.get("op") != "echoed":
                raise EngineProcessError("protocol", f"engine process answered {str(reply.get('op'))[:40]!r} to an echo")
            samples.append(elapsed)
        return min(samples)

    def build(self, timeout_s: float = math.inf) -> dict:
        """Build the engine in the configured process; the build's answer (`op` built or raised)."""
        return self._ask({"op": "build"}, timeout_s)

    def start(self, workload: Any, preset: Preset, info: DeviceInfo, *, genome_json: str | None = None,
              baseline: str | None = None, guarded: bool = True, sources: Mapping[str, str] | None = None,
              timeout_s: float = math.inf) -> dict:
        """`configure` then `build` (no calibration)."""
        self.configure(workload, preset, info, genome_json=genome_json, baseline=baseline, guarded=guarded,
                       sources=sources)
        return self.build(timeout_s)

    def close(self) -> None:
        """Kill the whole candidate, reap its process, verify none of its processes remains."""
        if self._holder is None:
            return
        if self.pid is not None:
            self._kill()
            self._exit_code()
        survivors: set[int] = set()
        if self._cgroup is not None:
            survivors |= self._cgroup.remove()
        if self._namespace:
            survivors |= _wait_empty(self._namespace)
        self.survivors = tuple(sorted(survivors))
        for closable in (self.conn, self._sock):
            if closable is not None:
                closable.close()
        if self._pair is not None:
            if self.survivors:  # a process of the candidate outlived the kill: never lend this pair again
                self._pool.discard(self._pair)
            else:  # the candidate is dead: nothing of it can write there any more
                self._pool.give_back(self._pair)
            self._pair = None
        if self._own_pool:
            self._pool.close()
        self._guard.close()
        self.pid = self._holder = None

    # ------------------------------------------------------------------ one call
    def call(self, inputs: Mapping[str, torch.Tensor | None], outputs: Mapping[str, tuple[Sequence[int], str]],
             timeout_s: float = math.inf) -> CallResult:
        """Call the engine on `inputs` (the judge keeps them; the engine gets copies in the arena);
        `outputs` names the expected (shape, dtype) of each output. The outputs are the judge's copies
        taken at the answer; any that changed once the candidate was frozen (or, on CUDA, after
        `settle_s`) is named in `late`."""
        elapsed, reply, forbidden, in_slots, out_slots, copies = self._exchange("call", inputs, outputs, timeout_s)
        changed = tuple(k for k, s in in_slots.items()
                        if s is not None and not torch.equal(arenas.view(self._in_arena, s), inputs[k]))
        late: tuple[str, ...] = ()
        if copies is not None:
            if self.device.type == "cuda" and self.settle_s > 0:
                time.sleep(self.settle_s)
                sync(str(self.device))
            late = tuple(k for k, s in out_slots.items() if not _same_bits(arenas.view(self._out_arena, s), copies[k]))
        return CallResult(elapsed, reply, copies, changed, late, tuple(forbidden))

    def add(self, request: Mapping[str, Any], timeout_s: float = math.inf) -> dict:
        """Hand a generation engine a request (GenerationRequest's fields); its answer (`added` or `raised`)."""
        return self._ask({"op": "add", "request": dict(request)}, timeout_s)

    def step(self, timeout_s: float = math.inf, steps: int = 1) -> dict:
        """Up to `steps` steps of a generation engine in one exchange; its answer (`stepped` with the `events` of
        them all, or `raised`)."""
        return self._ask({"op": "step", "steps": int(steps)}, timeout_s)

    def abort(self, request_id: int, timeout_s: float = math.inf) -> dict:
        """Drop a request of a generation engine; its answer (`aborted` or `raised`)."""
        return self._ask({"op": "abort", "request_id": int(request_id)}, timeout_s)

    def _ask(self, message: dict, timeout_s: float) -> dict:
        """One message and its answer, the candidate thawed only in between (as for a call)."""
        deadline = time.monotonic() + timeout_s
        self._thaw()
        self._send(ForkingPickler.dumps(message), deadline)
        reply, forbidden = self._receive(deadline)
        self._freeze()
        return {**reply, "forbidden_calls": forbidden}

    def _exchange(self, op: str, inputs: Mapping[str, torch.Tensor | None],
                  outputs: Mapping[str, tuple[Sequence[int], str]], timeout_s: float) -> tuple:
        """Write the inputs, NaN-fill the output slots, send `op`, time it to the answer, copy the
        outputs, freeze the candidate. Returns (seconds, answer, forbidden calls reported, input slots,
        output slots, the outputs copied at the answer or None)."""
        in_slots, in_bytes = arenas.layout({k: None if v is None else (tuple(v.shape), arenas.dtype_name(v.dtype))
                                            for k, v in inputs.items()})
        out_slots, out_bytes = arenas.layout(dict(outputs))
        new = self._ensure_arenas(in_bytes, out_bytes)
        for name, slot in in_slots.items():
            if slot is not None:
                arenas.view(self._in_arena, slot).copy_(inputs[name])
        for slot in out_slots.values():
            out = arenas.view(self._out_arena, slot)
            out.fill_(math.nan) if out.is_floating_point() else out.fill_(0)
        # A new pair travels as two descriptors over this channel (memory files on CPU, allocations of their
        # own on CUDA: `evaluators.sandbox.cuda_memory`), their sizes in the message.
        shared = {"fds": [self._in_arena.numel(), self._out_arena.numel()]} if new else None
        payload = ForkingPickler.dumps({"op": op, "inputs": in_slots, "outputs": out_slots, "arenas": shared})
        deadline = time.monotonic() + timeout_s
        sync(str(self.device))
        self._thaw()
        start = time.perf_counter()
        self._send(payload, deadline)
        if shared is not None:
            self._send_fds(self._arena_fds, deadline)
        reply, forbidden = self._receive(deadline)
        elapsed = time.perf_counter() - start
        copies = None
        if op == "call" and reply.get("op") == "returned" and not reply.get("problem"):
            copies = {k: arenas.view(self._out_arena, s).clone() for k, s in out_slots.items()}
        self._freeze()  # until the next call: nothing runs there while the judge reads and computes
        return elapsed, reply, forbidden, in_slots, out_slots, copies

    def _ensure_arenas(self, in_bytes: int, out_bytes: int) -> bool:
        """This process's pair of arenas (leased from the pool on first use) at least this large; True
        when the engine's process must be sent it (first use, or the pair was grown)."""
        if self._pair is None:
            self._pair = self._pool.lease()
        self._pair.ensure(in_bytes, out_bytes)
        new = self._pair.version != self._sent_version
        self._sent_version = self._pair.version
        return new

    @property
    def _in_arena(self) -> torch.Tensor | None:
        return None if self._pair is None else self._pair.inputs

    @property
    def _out_arena(self) -> torch.Tensor | None:
        return None if self._pair is None else self._pair.outputs

    @property
    def _arena_fds(self) -> tuple[int, ...]:
        return () if self._pair is None else self._pair.fds

    # ------------------------------------------------------------------ transport
    def _send(self, payload: bytes, deadline: float) -> None:
        try:
            with self._watchdog(deadline):
                self.conn.send_bytes(payload)
        except (OSError, EOFError) as exc:
            raise self._lost() from exc

    def _send_fds(self, fds: tuple[int, ...], deadline: float) -> None:
        try:
            with self._watchdog(deadline):
                socket.send_fds(self._sock, [b"A"], list(fds))
        except OSError as exc:
            raise self._lost() from exc

    def _receive(self, deadline: float) -> tuple[dict, list[str]]:
        """The next answer (not a note), and the forbidden calls the engine's process reported before it."""
        forbidden: list[str] = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.conn.poll(None if math.isinf(remaining) else remaining):
                self._kill()
                raise EngineProcessError("timeout", "no answer before the deadline; engine process killed")
            try:
                with self._watchdog(deadline):
                    data = self.conn.recv_bytes(maxlength=_MAX_MESSAGE)
            except (OSError, EOFError) as exc:
                raise self._lost() from exc
            try:
                message = json.loads(data)
                if not isinstance(message, dict):
                    raise ValueError("not an object")
            except ValueError as exc:
                self._kill()
                raise EngineProcessError("protocol", f"engine process sent something other than a JSON object "
                                                     f"({len(data)} bytes)") from exc
            if message.get("op") == "forbidden":
                forbidden.append(str(message.get("label"))[:200])
                continue
            return message, forbidden

    def _watchdog(self, deadline: float) -> _Watchdog:
        return self._guard(deadline)

    def _lost(self) -> EngineProcessError:
        if self._killed:
            return EngineProcessError("timeout", "no answer before the deadline; engine process killed")
        code = self._exit_code()
        if code is not None and code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exit code {code}"
        return EngineProcessError("died", f"engine process died ({how})")

    def _exit_code(self) -> int | None:
        """The engine process's exit code once it ended (killed if it is still running after a grace
        period: it closed its connection, or the judge is done with it)."""
        if not self._reaped:
            if not self._wait_gone(0 if self._killed else 2.0):
                self._kill()
            self._exitcode = self._zygote.exitcode(self._holder)  # blocks until the process is dead
            self._reaped = True
        return self._exitcode

    def _wait_gone(self, seconds: float) -> bool:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            if _state(self.pid) in ("Z", "X", ""):
                return True
            time.sleep(0.005)
        return False

    # ------------------------------------------------------------------ signals
    def _kill(self) -> None:
        """SIGKILL the candidate: its first process (in the strict sandbox the kernel then kills its whole
        PID namespace), its cgroup, its process group."""
        if self.pid is None:
            return
        self._killed = True
        for target in (lambda: os.kill(self.pid, signal.SIGKILL), lambda: os.killpg(self.pid, signal.SIGKILL)):
            try:
                target()
            except (ProcessLookupError, PermissionError):
                pass
        if self._cgroup is not None:
            self._cgroup.kill()

    def _freeze(self) -> None:
        """Stop every process of the candidate and wait until all are stopped (killed if they cannot be)."""
        if self.pid is None:
            return
        if self._cgroup is not None and self._cgroup.can_freeze:
            frozen = self._cgroup.freeze(_FREEZE_WAIT_S)
        else:
            frozen = self._stop_by_signals()
        if not frozen:
            self._kill()
            raise EngineProcessError("timeout", f"the candidate could not be frozen within {_FREEZE_WAIT_S:g} s;"
                                                " engine process killed")

    def _stop_by_signals(self) -> bool:
        """Without a freezer: SIGSTOP to each process of the candidate (its PID namespace, or in the
        'none' sandbox its process group) until all are stopped."""
        until = time.monotonic() + _FREEZE_WAIT_S
        while time.monotonic() < until:
            pids = _members(self._namespace) if self._namespace else {self.pid}
            if not self._namespace:
                try:
                    os.killpg(self.pid, signal.SIGSTOP)
                except (ProcessLookupError, PermissionError):
                    return True
            else:
                _signal_all(pids, signal.SIGSTOP)
            if all(_state(p) in ("T", "t", "Z", "X", "") for p in pids):
                return True
            time.sleep(0)
        return False

    def _thaw(self) -> None:
        if self._cgroup is not None and self._cgroup.can_freeze:
            self._cgroup.thaw()
        elif self._namespace:
            _signal_all(_members(self._namespace), signal.SIGCONT)
        else:
            try:
                os.killpg(self.pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass


class _Watchdog:
    """Kills the engine's process if a blocking read or write outlives its deadline. One thread per engine
    process, armed and disarmed around each blocking step (a timer thread per step cost ~1 ms a call)."""

    def __init__(self, kill: Any) -> None:
        self._kill = kill
        self._deadline = math.inf
        self._closed = False
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def __call__(self, deadline: float) -> _Watchdog:
        with self._wake:
            self._deadline = deadline
            if self._thread is None and math.isfinite(deadline):
                self._thread = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)
                self._thread.start()
            self._wake.notify()
        return self

    def __enter__(self) -> _Watchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._wake:
            self._deadline = math.inf

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()

    def _watch(self) -> None:
        with self._wake:
            while not self._closed:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    self._deadline = math.inf
                    self._kill()
                    continue
                self._wake.wait(None if math.isinf(left) else left)


def _state(pid: int) -> str:
    """The process state letter from /proc (R, S, T, Z, ...), "" if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _namespace_of(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return ""


def _members(namespace: str) -> set[int]:
    """The processes (in the judge's numbering) whose PID namespace is `namespace`."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _namespace_of(int(entry)) == namespace:
            found.add(int(entry))
    return found


def _signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_empty(namespace: str, timeout_s: float = 10.0) -> set[int]:
    """Wait until no process of the PID namespace is left (killing stragglers); those left at the deadline."""
    until = time.monotonic() + timeout_s
    left = {p for p in _members(namespace) if _state(p) not in ("Z", "X", "")}
    while left and time.monotonic() < until:
        _signal_all(left, signal.SIGKILL)
        time.sleep(0.001)
        left = {p for p in _members(namespace) if _state(p) not in ("Z", "X", "")}
    return left


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN equals NaN): did anything write here?"""
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def workload_modules(workload: Any) -> tuple[str, ...]:
    """The modules the engine's process needs to unpickle `workload` (its class's, and those of every
    class or function its pickle names), for the zygote to load before the jail: a test or user
    workload's files are not in an engine's view (`evaluators.sandbox.view`)."""
    names = [type(workload).__module__]
    try:
        data = pickle.dumps(workload)
    except Exception:  # noqa: BLE001 - looked up by name in the engine's process (EngineProcess.configure)
        return tuple(names)
    strings: list[str] = []
    memo: dict[int, Any] = {}
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            strings.append(arg)
        elif op.name == "MEMOIZE" and strings:
            memo[len(memo)] = strings[-1]
        elif op.name in ("BINGET", "LONG_BINGET", "GET") and isinstance(memo.get(arg), str):
            strings.append(memo[arg])
        elif op.name == "GLOBAL":
            names.append(str(arg).split(" ")[0])
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            names.append(strings[-2])
    return tuple(dict.fromkeys(n for n in names if n and n != "builtins"))


def probe_strict(device: str = "cpu") -> str:
    """"" when a strict-sandbox engine process starts and stops cleanly here, else why not (a preflight
    for machines whose kernel or container may refuse part of the jail)."""
    reason = jail.unavailable()
    if reason:
        return reason
    try:
        with EngineProcess(device, sandbox="strict") as process:
            process.launch()
    except (EngineProcessError, OSError) as exc:
        return str(exc)
    return ""
