"""The engine's own process: builds one engine and answers the judge's calls. Nothing else runs here.

Everything in this module runs in the untrusted process (see `evaluators.sandbox.process` for the judge's
side). It holds no reference outputs, no comparison and no timer that matters: the judge draws the
inputs, owns the clock and compares. What this process is told, it is told in pickles from the judge;
what it says back is JSON, so nothing it sends can run code in the judge.

Set up once, before any workload code is imported or the engine is built, and the same for every
call afterwards (so a check and a timed call look alike from inside), after the zygote confined the
process (`evaluators.sandbox.jail`):
- its own session and death with its parent;
- the environment the judge gives engines (`evaluators.sandbox.zygote.engine_environment`), its cores and
  thread count;
- memory poisoning always on (torch.empty & co. return NaN-filled memory), if the judge asks for it;
- guards on the workload's reference and baselines (`evaluators.sandbox.guard`), for genome engines.
Each call: read the inputs from the judge's arena, call the engine, require plain contiguous tensors of
the expected shape/dtype/device that alias neither an input nor each other, copy them into the judge's
arena, synchronise the device, answer.
"""
from __future__ import annotations

import ctypes
import json
import os
import pickle
import resource
import signal
import socket
import traceback
import warnings
from typing import Any, Mapping

import torch

from evaluators.sandbox import arena as arenas
from evaluators.sandbox.guard import ForbiddenCall, install_guards

_PR_SET_PDEATHSIG = 1
_CLONE_NEWNET = 0x40000000
_TEXT_CHARS = 2000
_TRACEBACK_CHARS = 4000


def main(conn: Any) -> None:
    """Entry point of the engine's process (started by `evaluators.sandbox.process.EngineProcess`)."""
    os.setsid()
    die_with_parent()
    spec = conn.recv()
    _configure(spec)
    runner = _Runner(conn, spec)
    runner.serve()


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send this process `sig` (default SIGKILL) when its parent dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):  # not Linux: the judge still kills us by process group
        pass


def cut_network() -> str:
    """No network for this process: a network namespace of its own, which has no interfaces (the judge's
    pipe and shared memory are not network); where the OS refuses that, Python-level sockets refuse to
    connect, bind or send. Returns which of the two is in effect."""
    if ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWNET) == 0:
        return "namespace"

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise PermissionError("engines may not use the network (evaluator setting engine_network is false)")

    for name in ("connect", "connect_ex", "bind", "sendto", "sendmsg"):
        setattr(socket.socket, name, refuse)
    socket.create_connection = refuse
    return "python"


def _configure(spec: dict) -> None:
    from evo.core.code import allow_engine_code

    allow_engine_code()  # this confined process is where code genes may run (evo.core.code.load_module)
    os.environ.clear()
    os.environ.update(spec["env"])
    if spec["cores"]:
        os.sched_setaffinity(0, spec["cores"])
    if spec.get("memory_bytes"):
        resource.setrlimit(resource.RLIMIT_AS, (spec["memory_bytes"], spec["memory_bytes"]))
    if not spec.get("network", True):
        cut_network()
    torch.set_num_threads(spec["threads"])
    if spec["poison"]:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")


class _Runner:
    def __init__(self, conn: Any, spec: dict) -> None:
        self.conn = conn
        self.sock = socket.socket(fileno=os.dup(conn.fileno()))  # arenas' descriptors arrive on it
        self.spec = spec
        self.device = torch.device(spec["device"])
        self.in_arena: torch.Tensor | None = None
        self.out_arena: torch.Tensor | None = None
        self.engine = None
        self.scratch: dict[str, torch.Tensor] = {}  # echo calls' stand-ins for an engine's outputs

    def send(self, **fields: Any) -> None:
        self.conn.send_bytes(json.dumps(fields, default=str).encode())

    def serve(self) -> None:
        """Answer the judge: echo calls (before the build: the judge's calibration), the build, calls."""
        while True:
            message = self.conn.recv()
            op = message.get("op")
            if op == "echo" and self.engine is None:
                self.echo(message)
            elif op == "build" and self.engine is None:
                if not self.build():
                    return
            elif op == "call" and self.engine is not None and self.spec.get("contract", "call") == "call":
                self.call(message)
            elif op == "add" and self.engine is not None and self.spec.get("contract") == "generation":
                self.add(message)
            elif op == "step" and self.engine is not None and self.spec.get("contract") == "generation":
                self.step(message)
            elif op == "abort" and self.engine is not None and self.spec.get("contract") == "generation":
                self.abort(message)
            else:
                return

    # ------------------------------------------------------------------ build
    def build(self) -> bool:
        """Build the engine (guards first for genome engines); answer `built` or `raised`."""
        spec = self.spec
        try:
            workload = pickle.loads(spec["workload"]) if spec["workload"] is not None else _named(spec["workload_name"])
            if spec["guarded"]:
                from evaluators.sandbox.guard import forbidden_targets

                install_guards(forbidden_targets(workload, load=False), self._report_forbidden)
            self.engine = self._construct(workload, spec)
            threads = _engine_threads(self.engine)
        except ForbiddenCall as exc:
            self.send(op="raised", forbidden=True, type="ForbiddenCall", message=str(exc), traceback="")
            return False
        except BaseException as exc:  # noqa: BLE001 - any failure of the build is the engine's
            self.send(op="raised", **_describe(exc))
            return False
        if threads is not None and self.device.type == "cpu":
            torch.set_num_threads(threads)
        self.send(op="built", threads=threads or torch.get_num_threads())
        return True

    @staticmethod
    def _construct(workload: Any, spec: dict) -> Any:
        if spec["baseline"] is not None:
            return workload.baselines(spec["preset"])[spec["baseline"]](spec["info"])
        from evo.core.genome import Genome

        genome = Genome.from_json(spec["genome"])
        space = workload.gene_space(spec["preset"], spec["info"])
        # engine code (evo.core.code) is loaded here, in the isolated process, and nowhere else in an evaluation
        build = workload.build_generator if spec.get("contract") == "generation" else workload.build
        return build(space.validate(genome), spec["preset"], spec["info"], dict(spec.get("sources") or {}))

    def _report_forbidden(self, label: str) -> None:
        self.send(op="forbidden", label=label)

    # ------------------------------------------------------------------ one call
    def _inputs(self, message: dict) -> dict:
        shared = message.get("arenas")
        if shared is not None:  # a new pair: two descriptors (memory files, or CUDA allocations) on the channel
            _, fds, _, _ = socket.recv_fds(self.sock, 1, 2)
            try:
                self.in_arena, self.out_arena = (arenas.attach(fd, size, str(self.device))
                                                 for fd, size in zip(fds, shared["fds"], strict=True))
            except BaseException as exc:  # the judge hears why (e.g. a CUresult) before this process ends
                self.send(op="raised", **_describe(exc))
                raise
            finally:
                for fd in fds:
                    os.close(fd)
        return {name: None if slot is None else arenas.view(self.in_arena, slot)
                for name, slot in message["inputs"].items()}

    def echo(self, message: dict) -> None:
        """What a call costs the judge without an engine: the same views, copies and synchronisation."""
        self._inputs(message)
        for name, slot in message["outputs"].items():
            out = arenas.view(self.out_arena, slot)
            if name not in self.scratch or self.scratch[name].shape != out.shape:
                self.scratch[name] = torch.zeros_like(out)
            out.copy_(self.scratch[name])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.send(op="echoed")

    def call(self, message: dict) -> None:
        inputs = self._inputs(message)
        try:
            with torch.no_grad():
                outputs = self.engine(**inputs)
                problem = self._deliver(outputs, message["outputs"])
                del outputs
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
        except BaseException as exc:  # noqa: BLE001 - reported, the judge decides
            self.send(op="raised", **_describe(exc))
            return
        self.send(op="returned", problem=problem)

    # ------------------------------------------------------------------ the generation contract
    def add(self, message: dict) -> None:
        """Admit a request (`evo.workloads.generation.GenerationRequest`, sent by the judge as a dict)."""
        from evo.workloads.generation import GenerationRequest

        try:
            self.engine.add(GenerationRequest(**message["request"]))
        except BaseException as exc:  # noqa: BLE001 - reported, the judge decides
            self.send(op="raised", **_describe(exc))
            return
        self.send(op="added")

    def step(self, message: dict) -> None:
        """Up to `steps` scheduling steps (1 unless asked; fewer once a step makes no token); their tokens in order
        as [request id, token, finished] triples (the judge checks them)."""
        events: list[list] = []
        try:
            with torch.no_grad():
                for _ in range(max(1, int(message.get("steps", 1)))):
                    made = [[int(e.request_id), int(e.token), bool(e.finished)] for e in self.engine.step()]
                    events += made
                    if not made:
                        break
        except BaseException as exc:  # noqa: BLE001 - reported, the judge decides
            self.send(op="raised", **_describe(exc))
            return
        self.send(op="stepped", events=events)

    def abort(self, message: dict) -> None:
        """Drop a request whose client went away (`GenerationEngine.abort`)."""
        try:
            self.engine.abort(int(message["request_id"]))
        except BaseException as exc:  # noqa: BLE001 - reported, the judge decides
            self.send(op="raised", **_describe(exc))
            return
        self.send(op="aborted")

    def _deliver(self, outputs: Any, slots: dict) -> str:
        """Copy the engine's outputs into the judge's arena; the problem with them, or ""."""
        if not isinstance(outputs, Mapping):
            return f"engine must return a dict of outputs {sorted(slots)}, got {type(outputs).__name__}"
        inputs = _span(self.in_arena)
        seen: list[tuple[str, tuple[int, int]]] = []
        for name, slot in slots.items():
            if name not in outputs:
                return f"output {name!r} missing; got outputs {sorted(map(str, outputs))}"
            out = outputs[name]
            if type(out) is not torch.Tensor:
                return f"output {name!r} is a {type(out).__name__}, expected a plain torch.Tensor (no subclass)"
            if tuple(out.shape) != slot.shape:
                return f"output {name!r} has shape {tuple(out.shape)}, expected {slot.shape}"
            if arenas.dtype_name(out.dtype) != slot.dtype:
                return f"output {name!r} has dtype {out.dtype}, expected {slot.dtype}"
            if out.device != self.device:
                return f"output {name!r} is on {out.device}, expected {self.device}"
            if not out.is_contiguous():
                return f"output {name!r} is not contiguous (strides {out.stride()}): outputs must be dense row-major"
            span = _span(out)
            if _overlap(span, inputs):
                return f"output {name!r} aliases the engine's inputs: outputs must own their memory"
            for other, other_span in seen:
                if _overlap(span, other_span):
                    return f"outputs {other!r} and {name!r} share memory: outputs must own their memory"
            seen.append((name, span))
            arenas.view(self.out_arena, slot).copy_(out)
        return ""


def _named(name: str) -> Any:
    from evo.workloads import get_workload

    return get_workload(name)


def _span(tensor: torch.Tensor | None) -> tuple[int, int]:
    if tensor is None:
        return (0, 0)
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] != a[1] and b[0] != b[1]


def _engine_threads(engine: Any) -> int | None:
    threads = getattr(engine, "num_threads", None)
    if threads is None:
        return None
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"engine.num_threads must be a positive int or None, got {threads!r}")
    return threads


def _describe(exc: BaseException) -> dict:
    module = type(exc).__module__ or ""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-8))
    return {
        "type": type(exc).__name__,
        "message": str(exc)[:_TEXT_CHARS],
        "traceback": text[-_TRACEBACK_CHARS:],
        "oom": isinstance(exc, (torch.OutOfMemoryError, MemoryError)),
        "compile_error": module.startswith(("torch._dynamo", "torch._inductor")),
        "forbidden": isinstance(exc, ForbiddenCall),
        "genome_error": type(exc).__name__ == "GenomeError",
    }
