"""What a jailed candidate can reach beyond its own arena and its own files: the probes of the GPU
check's preflight (`scripts/gpu_preflight.py`), run from ordinary engine processes as the evaluator
starts them, each finding one row.

The probe is an ordinary engine (`WORKLOAD`'s baseline "probe") that does what its input `action` says:
- LEAVE: write a marker into its /tmp and /dev/shm and make a System V shared memory segment (its IPC
  namespace's), all named by the input `token`; on CUDA also report its input arena's bounds: the
  address range the driver gives for the arena's pointer, and whether mapping the arena's allocation
  one granule larger is refused;
- LOOK: say which of those markers it can see (a later candidate must see none);
- READ_PAST: read one granule past its input arena with a kernel (CUDA: the read faults and the
  process's CUDA context with it, so this is a candidate's last call).
It answers in its output `report` (JSON bytes). Two candidates run one after the other: the first
leaves, the second looks and then reads past its arena; the judge also looks in its own namespaces.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from evaluators.sandbox import cuda_memory

LEAVE, LOOK, READ_PAST = 0, 1, 2
REPORT_BYTES = 4096
IPC_CREAT, IPC_RMID = 0o1000, 0
TIMEOUT_S = 90.0  # per build or call: a fresh CUDA context in the engine's process takes seconds


class ProbeWorkload:
    """Just enough of a workload for an engine process to build the probe (a baseline, unguarded)."""

    name = "isolation-probe"

    def baselines(self, preset: Any) -> dict[str, Callable[[Any], Callable[..., dict]]]:
        return {"probe": lambda info: probe}


WORKLOAD = ProbeWorkload()


# ====================================================================== in the engine's process
def probe(action: torch.Tensor, token: torch.Tensor) -> dict:
    """The engine: action [1] int64, token [1] int64 (views into its input arena); report [REPORT_BYTES] uint8."""
    what, key = int(action.item()), int(token.item())
    arena = action.untyped_storage()  # the view's whole storage: the input arena
    if what == READ_PAST:
        found = {"read_past": _read_past(arena.data_ptr(), arena.nbytes(), action.device)}
    elif what == LEAVE:
        found = {"left": _leave(key)}
        if action.is_cuda:
            found["bounds"] = _bounds(arena.data_ptr(), arena.nbytes(), action.device)
    else:
        found = {"seen": look(key)}
    data = json.dumps(found).encode()[:REPORT_BYTES]
    report = torch.zeros(REPORT_BYTES, dtype=torch.uint8)
    report[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return {"report": report.to(action.device)}


def markers(key: int) -> dict[str, str]:
    name = f"evo-probe-{key:x}"
    return {"tmp": f"/tmp/{name}", "shm": f"/dev/shm/{name}"}


def _leave(key: int) -> dict[str, Any]:
    """Write every marker; for each, True or why it could not be written."""
    left: dict[str, Any] = {}
    for where, path in markers(key).items():
        left[where] = _attempt(lambda path=path: bool(Path(path).write_text("left by an earlier candidate")))
    segment = _libc().shmget(key, 4096, IPC_CREAT | 0o600)
    left["sysv"] = segment >= 0 or f"shmget: {os.strerror(ctypes.get_errno())}"
    return left


def look(key: int) -> dict[str, bool]:
    """Which markers of `key` this process sees."""
    seen = {where: os.path.exists(path) for where, path in markers(key).items()}
    seen["sysv"] = _libc().shmget(key, 0, 0) >= 0
    return seen


def _bounds(pointer: int, size: int, device: torch.device) -> dict[str, Any]:
    return {"pointer": pointer, "size": size,
            "range": _attempt(lambda: list(cuda_memory.address_range(pointer, device))),
            "map_larger": _attempt(lambda: cuda_memory.map_larger(pointer, size, device) or "allowed")}


def _read_past(pointer: int, size: int, device: torch.device) -> str:
    """Read the granule after the arena with a kernel; returns only if the read succeeded (it must not)."""
    granule = cuda_memory.granularity(cuda_memory.ordinal(device))
    beyond = torch.as_tensor(_Span(pointer, size + granule), device=device)  # the arena and one granule more
    total = int(beyond[size:].sum().item())  # faults: the granule after an arena is reserved, never mapped
    return f"read {granule} bytes past the arena (sum {total})"


class _Span:
    def __init__(self, pointer: int, size: int) -> None:
        self.__cuda_array_interface__ = cuda_memory.cuda_array_interface(pointer, size)


def _attempt(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a probe reports what failed
        return f"{type(exc).__name__}: {exc}"


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    libc.shmctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    return libc


# ====================================================================== the judge's side
@dataclass(frozen=True)
class Findings:
    """What the two candidates reported and the judge saw. `error`: why the probes did not finish."""

    left: dict
    seen: dict
    judge_seen: dict
    bounds: dict | None = None
    read_past: str | None = None  # CUDA: how the read past the arena ended (the engine's error, or its data)
    read_past_returned: bool = False
    error: str = ""


class ProbeFailed(RuntimeError):
    """A probe candidate did not build or answer."""


def run_probes(device: str, sandbox: str = "strict") -> Findings:
    """Two candidates on `device` in `sandbox`, one after the other (see the module's docstring)."""
    key = secrets.randbits(30) | 1
    cuda = torch.device(device).type == "cuda"
    try:
        with candidate(device, sandbox) as first:
            report = ask(first, LEAVE, key)
        with candidate(device, sandbox) as second:
            seen = ask(second, LOOK, key)["seen"]
            read_past, returned = _ask_read_past(second, key) if cuda else (None, False)
    except ProbeFailed as exc:
        return Findings({}, {}, _judge_look(key), error=str(exc))
    return Findings(report["left"], seen, _judge_look(key), report.get("bounds"), read_past, returned)


@contextlib.contextmanager
def candidate(device: str, sandbox: str) -> Iterator[Any]:
    """A built probe engine in its own engine process (killed at the end)."""
    from evaluators.sandbox.process import EngineProcess, EngineProcessError

    try:
        with EngineProcess(device, sandbox=sandbox) as process:
            process.launch(preload=(__name__,))
            process.configure(WORKLOAD, None, None, baseline="probe", guarded=False)
            reply = process.build(TIMEOUT_S)
            if reply.get("op") != "built":
                raise ProbeFailed(f"the probe did not build: {reply.get('type')}: {reply.get('message')}")
            yield process
    except EngineProcessError as exc:
        raise ProbeFailed(f"probe engine process: {exc.kind}: {exc}") from exc


def ask(process: Any, action: int, key: int) -> dict:
    """One call of the probe; its report."""
    result = _call(process, action, key)
    if result.outputs is None:
        reply = result.reply
        raise ProbeFailed(f"the probe's call {action} answered {reply.get('op')}: {reply.get('type', '')}"
                          f" {reply.get('message') or reply.get('problem', '')}".strip())
    data = bytes(result.outputs["report"].cpu().tolist()).rstrip(b"\0")
    return json.loads(data)


def _call(process: Any, action: int, key: int) -> Any:
    device = str(process.device)
    inputs = {"action": torch.tensor([action], device=device), "token": torch.tensor([key], device=device)}
    return process.call(inputs, {"report": ((REPORT_BYTES,), "uint8")}, TIMEOUT_S)


def _ask_read_past(process: Any, key: int) -> tuple[str, bool]:
    """(how the read ended, whether it returned data)."""
    from evaluators.sandbox.process import EngineProcessError

    try:
        result = _call(process, READ_PAST, key)
    except EngineProcessError as exc:
        return f"the engine process {exc.kind}: {exc}", False
    if result.outputs is not None:
        return json.loads(bytes(result.outputs["report"].cpu().tolist()).rstrip(b"\0"))["read_past"], True
    reply = result.reply
    return f"{reply.get('type', reply.get('op'))}: {str(reply.get('message') or reply.get('problem'))[:200]}", False


def _judge_look(key: int) -> dict[str, bool]:
    """The markers as the judge sees them; any found is removed (it means a candidate reached the judge)."""
    seen = look(key)
    for where, path in markers(key).items():
        if seen[where]:
            os.unlink(path)
    if seen["sysv"]:
        _libc().shmctl(_libc().shmget(key, 0, 0), IPC_RMID, None)
    return seen


# ====================================================================== rows
def rows(findings: Findings, cuda: bool, strict: bool) -> list[tuple[str, str, str]]:
    """(item, status, detail) for the arena bounds and the candidate files (`strict`: the candidates ran
    in the strict sandbox; without it they share the judge's files by design)."""
    return [arena_row(findings, cuda), files_row(findings, strict)]


def files_row(f: Findings, strict: bool = True) -> tuple[str, str, str]:
    item = "candidate files"
    if not strict:
        return item, "skipped (no strict sandbox)", "engines run unconfined here: they share the judge's files"
    if f.error:
        return item, "FAIL", f"{f.error}: nothing was checked"
    not_left = {where: why for where, why in f.left.items() if why is not True}
    if not_left:
        return item, "FAIL", f"the first candidate could not leave its markers ({not_left}): the check proves nothing"
    reached = [f"the next candidate's {where}" for where, yes in f.seen.items() if yes]
    reached += [f"the judge's {where}" for where, yes in f.judge_seen.items() if yes]
    if reached:
        return item, "FAIL", f"what a candidate left in its /tmp, /dev/shm or System V IPC reached {', '.join(reached)}"
    return item, "ok", ("a candidate's markers in its /tmp, /dev/shm and System V IPC (ipc namespace) were absent"
                        " for the next candidate and for the judge")


def arena_row(f: Findings, cuda: bool) -> tuple[str, str, str]:
    item = "arena bounds"
    if not cuda:
        return item, "skipped (no CUDA)", "CPU arenas are memory files of their own, mapped whole"
    if f.error or f.bounds is None:
        return item, "FAIL", f"{f.error or 'no bounds reported'}: CUDA arenas were not checked"
    b = f.bounds
    problems = []
    if b["range"] != [b["pointer"], b["size"]]:
        problems.append(f"cuMemGetAddressRange gave {b['range']}, expected [{b['pointer']:#x}, {b['size']}]")
    if not str(b["map_larger"]).startswith("CUDA_ERROR"):  # "allowed", or the attempt itself failed
        problems.append(f"mapping the allocation one granule larger: {b['map_larger']}")
    if f.read_past_returned:
        problems.append(f"a read one granule past the arena returned data: {f.read_past}")
    if problems:
        return item, "FAIL", "; ".join(problems)
    return item, "ok", (f"a jailed engine mapped its arenas from descriptors and answered through them; its arena"
                        f" is exactly its allocation ({b['size']} bytes), mapping it larger was refused"
                        f" ({b['map_larger']}), a read one granule past it failed ({f.read_past})")
