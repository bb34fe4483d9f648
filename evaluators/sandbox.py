"""The judge's side of an engine's own process: start it, have it build the engine, call it, kill it.

One fresh process per candidate (forked from a clean zygote that only imported torch, never an engine,
see `evaluators.zygote`), so whatever an engine patches or leaks dies with it. The judge:
- sends pickles (it is trusted) and reads only size-capped JSON back (the engine is not);
- writes each call's inputs into a shared arena and NaN-fills the output slots before the call;
- owns the clock: wall time from sending the call to its answer, which comes only after the engine's
  outputs were copied into the judge's arena (and, on CUDA, the device synchronised);
- freezes the engine's process group (SIGSTOP) from each answer until the next call, so nothing the
  engine left running can change its outputs or inputs while the judge reads them, and nothing of it
  competes with the judge's own work between calls; on CUDA, where queued kernels are not stopped by a
  signal, it re-reads the outputs after `settle_s` as well;
- enforces deadlines itself: a call or build that outlives its deadline kills the process group.
"""
from __future__ import annotations

import json
import math
import multiprocessing
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Mapping, Sequence

import torch
import torch.multiprocessing  # noqa: F401 - registers the reductions that share tensors with the child

from evaluators import arena as arenas
from evaluators.timing import sync
from evaluators.zygote import Zygote
from evo.workloads.base import DeviceInfo, Preset

_MAX_MESSAGE = 1 << 20  # bytes: the largest answer the judge reads from an engine's process
_FREEZE_WAIT_S = 0.5


class EngineProcessError(Exception):
    """The engine's process died, hung past its deadline or broke the protocol (`kind` says which)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "died" | "timeout" | "protocol"


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
    """One engine in its own process. Use as a context manager; `close()` kills the process group."""

    def __init__(self, device: str, *, threads: int | None = None, settle_s: float = 0.0, poison: bool = False,
                 memory_bytes: int | None = None, network: bool = True) -> None:
        self.device = torch.device(device)
        self.threads = threads or torch.get_num_threads()
        self.settle_s = settle_s
        self.poison = poison
        self.memory_bytes = memory_bytes  # RLIMIT_AS of the engine's process (CPU engines), None: unlimited
        self.network = network
        self.pid: int | None = None
        self.conn: Any = None
        self._zygote: Zygote | None = None
        self._exitcode: int | None = None
        self._reaped = False
        self._killed = False
        self._in_arena: torch.Tensor | None = None
        self._out_arena: torch.Tensor | None = None

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ lifecycle
    def launch(self, preload: tuple[str, ...] = ()) -> None:
        """Fork the engine's process from the zygote (waits for the zygote to be ready on first use);
        `preload` names modules (the workload's) the zygote imports once for every later fork."""
        self._zygote = Zygote.shared()
        self.pid, self.conn = self._zygote.spawn(preload)

    def configure(self, workload: Any, preset: Preset, info: DeviceInfo, *, genome_json: str | None = None,
                  baseline: str | None = None, guarded: bool = True, sources: Mapping[str, str] | None = None) -> None:
        """Tell the launched process its environment, cores, threads and which engine it will build."""
        if self.pid is None:
            self.launch()
        try:
            workload_bytes, workload_name = pickle.dumps(workload), None
        except Exception:  # a workload object that does not pickle is looked up by name there
            workload_bytes, workload_name = None, workload.name
        spec = {
            "env": dict(os.environ), "authkey": bytes(multiprocessing.current_process().authkey),
            "cores": sorted(os.sched_getaffinity(0)),
            "threads": self.threads, "device": str(self.device), "poison": self.poison,
            "memory_bytes": self.memory_bytes if self.device.type == "cpu" else None, "network": self.network,
            "workload": workload_bytes, "workload_name": workload_name, "preset": preset, "info": info,
            "genome": genome_json, "baseline": baseline, "guarded": guarded, "sources": dict(sources or {}),
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
            elapsed, reply, _, _, _ = self._exchange("echo", inputs, outputs, timeout_s)
            if reply.get("op") != "echoed":
                raise EngineProcessError("protocol", f"engine process answered {str(reply.get('op'))[:40]!r} to an echo")
            samples.append(elapsed)
        return min(samples)

    def build(self, timeout_s: float = math.inf) -> dict:
        """Build the engine in the configured process; the build's answer (`op` built or raised)."""
        deadline = time.monotonic() + timeout_s
        self._thaw()
        self._send(ForkingPickler.dumps({"op": "build"}), deadline)
        reply, forbidden = self._receive(deadline)
        self._freeze()
        return {**reply, "forbidden_calls": forbidden}

    def start(self, workload: Any, preset: Preset, info: DeviceInfo, *, genome_json: str | None = None,
              baseline: str | None = None, guarded: bool = True, sources: Mapping[str, str] | None = None,
              timeout_s: float = math.inf) -> dict:
        """`configure` then `build` (no calibration)."""
        self.configure(workload, preset, info, genome_json=genome_json, baseline=baseline, guarded=guarded,
                       sources=sources)
        return self.build(timeout_s)

    def close(self) -> None:
        """Kill the engine's process group and reap the process."""
        if self.pid is None:
            return
        self._kill()
        self._exit_code()
        self.conn.close()
        self.pid = None

    # ------------------------------------------------------------------ one call
    def call(self, inputs: Mapping[str, torch.Tensor | None], outputs: Mapping[str, tuple[Sequence[int], str]],
             timeout_s: float = math.inf) -> CallResult:
        """Call the engine on `inputs` (the judge keeps them; the engine gets copies in the arena);
        `outputs` names the expected (shape, dtype) of each output."""
        elapsed, reply, forbidden, in_slots, out_slots = self._exchange("call", inputs, outputs, timeout_s)
        copies = None
        if reply.get("op") == "returned" and not reply.get("problem"):
            copies = {k: arenas.view(self._out_arena, s).clone() for k, s in out_slots.items()}
        changed = tuple(k for k, s in in_slots.items()
                        if s is not None and not torch.equal(arenas.view(self._in_arena, s), inputs[k]))
        late: tuple[str, ...] = ()
        if copies is not None and self.device.type == "cuda" and self.settle_s > 0:
            time.sleep(self.settle_s)
            sync(str(self.device))
            late = tuple(k for k, s in out_slots.items()
                         if not torch.equal(arenas.view(self._out_arena, s), copies[k]))
        return CallResult(elapsed, reply, copies, changed, late, tuple(forbidden))

    def _exchange(self, op: str, inputs: Mapping[str, torch.Tensor | None],
                  outputs: Mapping[str, tuple[Sequence[int], str]], timeout_s: float) -> tuple:
        """Write the inputs, NaN-fill the output slots, send `op`, time it to the answer, freeze the
        process. Returns (seconds, answer, forbidden calls reported, input slots, output slots)."""
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
        message = {"op": op, "inputs": in_slots, "outputs": out_slots,
                   "arenas": (self._in_arena, self._out_arena) if new else None}
        payload = ForkingPickler.dumps(message)
        deadline = time.monotonic() + timeout_s
        sync(str(self.device))
        self._thaw()
        start = time.perf_counter()
        self._send(payload, deadline)
        reply, forbidden = self._receive(deadline)
        elapsed = time.perf_counter() - start
        self._freeze()  # until the next call: nothing runs there while the judge reads and computes
        return elapsed, reply, forbidden, in_slots, out_slots

    def _ensure_arenas(self, in_bytes: int, out_bytes: int) -> bool:
        grown = False
        if self._in_arena is None or self._in_arena.numel() < in_bytes:
            self._in_arena, grown = arenas.allocate(in_bytes, str(self.device)), True
        if self._out_arena is None or self._out_arena.numel() < out_bytes:
            self._out_arena, grown = arenas.allocate(out_bytes, str(self.device)), True
        return grown

    # ------------------------------------------------------------------ transport
    def _send(self, payload: bytes, deadline: float) -> None:
        try:
            with self._watchdog(deadline):
                self.conn.send_bytes(payload)
        except (OSError, EOFError) as exc:
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
        return _Watchdog(deadline - time.monotonic(), self._kill)

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
            self._exitcode = self._zygote.exitcode(self.pid)  # blocks until the process is dead
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
        if self.pid is None:
            return
        self._killed = True
        for target in (lambda: os.killpg(self.pid, signal.SIGKILL),
                       lambda: os.kill(self.pid, signal.SIGKILL)):
            try:
                target()
            except (ProcessLookupError, PermissionError):
                pass

    def _freeze(self) -> None:
        """Stop every process of the engine's group and wait until the engine's process is stopped."""
        try:
            os.killpg(self.pid, signal.SIGSTOP)
        except (ProcessLookupError, PermissionError):
            return
        until = time.monotonic() + _FREEZE_WAIT_S
        while time.monotonic() < until and _state(self.pid) not in ("T", "t", "Z", "X", ""):
            time.sleep(0)

    def _thaw(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass


class _Watchdog:
    """Kills the engine's process if a blocking read or write outlives the deadline."""

    def __init__(self, seconds: float, kill: Any) -> None:
        self._timer = threading.Timer(max(seconds, 0.0), kill) if math.isfinite(seconds) else None

    def __enter__(self) -> _Watchdog:
        if self._timer is not None:
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _state(pid: int) -> str:
    """The process state letter from /proc (R, S, T, Z, ...), "" if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
