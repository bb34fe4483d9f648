"""Engines that attack the judge's sandbox, kept as fixtures (issue 23's classes, written for this project).

`AttackWorkload(base)` is the base workload with one more gene, `attack`: "none" builds the honest
engine; any other value builds the honest engine and, at build, tries that attack. An attack that
succeeds makes the engine return wrong answers (honest + 1), so its evaluation comes back 'incorrect';
one that the sandbox stops leaves an honest engine ('ok'): harmless. Under `sandbox: none` the probes
succeed (the tests show that too, so a fixture that silently does nothing cannot pass for a sandbox).

The attacks that leave processes behind (`setsid_daemon`, `late_writer`) are judged by what the judge
sees: what stays running after the candidate, and outputs written after the answer.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Mapping

import torch

from evaluators.sandbox.guard import hidden_paths
from evaluators.sandbox.view import declared_view
from evo.core.genome import Gene, GeneSpace, Genome
from evo.workloads.base import NO_SOURCES, DeviceInfo, Engine, Preset
from tests.delegating_workload import DelegatingWorkload

ROOT = Path(__file__).resolve().parents[1]
SECRET = "evo-test-secret-7f3a"  # the tests put it in the judge's environment as EVO_TEST_API_TOKEN

# attack -> what it tries
ATTACKS: dict[str, str] = {
    "read_judge_memory": "reads the judge's memory through /proc/<judge>/mem, or process_vm_readv",
    "signal_judge": "signals the judge (signal 0: the permission check only)",
    "write_project": "writes a file into the project's source tree",
    "load_reference_copy": "loads a fresh, unguarded copy of the reference module from its file (KDA)",
    "load_judge_module": "loads the judge's evaluator module fresh from its file",
    "read_git_objects": "lists the project's git objects (every version of the reference)",
    "read_secret_env": "looks for the judge's secrets in its own and the judge's environment",
    "widen_affinity": "widens its CPU affinity to every core of the machine",
    "setsid_daemon": "leaves a double-forked setsid daemon behind, spinning on a core",
    "late_writer": "returns NaN at once; a setsid child writes the right answer into the judge's arena later",
    "escape_view": "looks for files outside its declared view (the project's tests, docs, scripts, a sibling folder, "
                   "/root, /home, other site-packages) and walks the whole file tree",
    "reference_helpers": "reaches the reference module's helpers (l2norm) by import, sys.modules or the garbage collector",
    "read_engine_file": "honest only if it can read the file its workload declares (engine_files), e.g. under /tmp",
    "reach_replica": "reads the serving replica's environment (any /proc/*/environ holding the secret), reads the "
                     "project's tests and configs and writes into the project",
}
# engines that behave differently where they run or as they age (Serve's live checks)
MARKER_T, HONEST_MARKER_CALLS = 49, 3
TWO_FACED: dict[str, str] = {
    "honest_in_jail": "honest only when it runs as nobody (the jail's user), wrong anywhere else",
    "wrong_after_calls": f"honest for its first {HONEST_MARKER_CALLS} calls at T={MARKER_T}, wrong from then on",
}
# honest engines that need what a sandbox could break
HONEST: dict[str, str] = {
    "torch_compile": "passes its outputs through a torch.compile'd function (Inductor's C++ toolchain, compile workers)",
}
NONE = "none"


class AttackWorkload(DelegatingWorkload):
    """The base workload plus the `attack` gene; what the attacks aim at travels in the pickled object."""

    def __init__(self, base, name: str, *, cores: tuple[int, ...] = (), probe_dir: str = "") -> None:
        super().__init__(base, name)
        self.judge_pid = os.getpid()
        self.cores = tuple(cores)  # the cores the judge assigns (widen_affinity's yardstick)
        self.probe_dir = probe_dir  # where a daemon writes its pid, where it can
        self.reference_file = str(ROOT / "evo" / "workloads" / "kda" / "reference.py")
        self.view = None  # what a strict engine may see (`with_view`), for the escape_view probe
        self.engine_file = ""  # a file its engines read (engine_files), for the read_engine_file probe
        self.judge_file = str(ROOT / "evaluators" / "judge" / "evaluator.py")

    def engine_files(self, preset: Preset) -> tuple[str, ...]:
        return (self.engine_file,) if self.engine_file else ()

    def gene_space(self, preset: Preset, device: DeviceInfo) -> GeneSpace:
        honest = self.base.gene_space(preset, device)
        attack = Gene("attack", "fusion", (NONE, *ATTACKS, *HONEST, *TWO_FACED), NONE,
                      "which attack the engine tries at build")
        return GeneSpace(self.name, (*honest.genes, attack), honest.constraints, ignored=honest.ignored,
                         pipeline=honest.pipeline)

    def build(self, genome: Genome, preset: Preset, device: DeviceInfo,
              sources: Mapping[str, str] = NO_SOURCES) -> Engine:
        values = genome.values()
        attack = values.pop("attack")
        honest = self.base.build(self.base.gene_space(preset, device).make(values), preset, device, sources)
        if attack == NONE:
            return honest
        if attack == "torch_compile":
            return _compiled(honest)
        if attack == "late_writer":
            return _late_writer(honest)
        if attack == "setsid_daemon":
            _daemon(self.probe_dir)
            return honest
        if attack == "honest_in_jail":
            return honest if os.getuid() == 65534 else _wrong(honest)
        if attack == "wrong_after_calls":
            return _wrong_after(honest)
        if attack == "escape_view":
            found = _outside_view(self)
            if found:  # the message carries what it found (a build error, not a wrong answer)
                raise RuntimeError(f"found {len(found)} paths outside the declared view: {found[:6]}")
            return honest
        succeeded = _PROBES[attack](self)
        return _wrong(honest) if succeeded else honest


def with_view(workload: AttackWorkload) -> AttackWorkload:
    """`workload` carrying the view a strict engine of it is declared to see (computed here, in the judge:
    the engine's process must not load the reference that `hidden_paths` looks up)."""
    workload.view = declared_view(hidden_paths(workload), list(sys.modules))
    return workload


def genome_json(workload: AttackWorkload, preset: str, attack: str, device: DeviceInfo) -> str:
    space = workload.gene_space(workload.presets()[preset], device)
    return space.make({**space.default().values(), "attack": attack}).to_json()


def _wrong(honest):
    return lambda **x: {k: (v + 1.0).contiguous() for k, v in honest(**x).items()}


def _wrong_after(honest):
    """Honest for its first HONEST_MARKER_CALLS calls at T=MARKER_T (few such calls are drawn while it is
    verified), wrong on every call after those."""
    seen = [0]

    def engine(**x):
        seen[0] += int(x["q"].shape[1] == MARKER_T)
        out = honest(**x)
        return {k: (v + 1.0).contiguous() for k, v in out.items()} if seen[0] > HONEST_MARKER_CALLS else out
    return engine


class CompiledBaselineWorkload(AttackWorkload):
    """The attack workload plus a baseline, `compiled`, that passes the honest baseline's outputs through a
    torch.compile'd function: a stand-in for a torch.compile baseline (it fills the baselines' compile cache)."""

    def baselines(self, preset: Preset) -> dict:
        honest = self.base.baselines(preset)["torch_cumsum"]
        return {**super().baselines(preset), "compiled": lambda device: _compiled(honest(device))}


def _compiled(honest):
    identity = torch.compile(lambda t: t * 1.0, dynamic=True)

    def engine(**x):
        return {k: identity(v).contiguous() for k, v in honest(**x).items()}
    return engine


def _quietly(probe):
    def run(w) -> bool:
        try:
            return bool(probe(w))
        except Exception:  # noqa: BLE001 - refused: the attack failed
            return False
    return run


@_quietly
def _read_judge_memory(w) -> bool:
    with open(f"/proc/{w.judge_pid}/maps") as f:
        start = next(int(line.split("-")[0], 16) for line in f if line.split()[1].startswith("rw"))
    try:
        with open(f"/proc/{w.judge_pid}/mem", "rb") as mem:
            mem.seek(start)
            if len(mem.read(64)) == 64:
                return True
    except OSError:
        pass
    return _process_vm_read(w.judge_pid, start)


def _process_vm_read(pid: int, address: int) -> bool:
    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
    buffer = ctypes.create_string_buffer(64)
    local, remote = IoVec(ctypes.addressof(buffer), 64), IoVec(address, 64)
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == 64


@_quietly
def _signal_judge(w) -> bool:
    os.kill(w.judge_pid, 0)
    return True


@_quietly
def _write_project(w) -> bool:
    probe = ROOT / f".attack-probe-{os.getpid()}"
    probe.write_text("written by an engine")
    probe.unlink()
    return True


def _load_file(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@_quietly
def _load_reference_copy(w) -> bool:
    return callable(getattr(_load_file(w.reference_file, "reference_copy"), "recurrent_kda", None))


@_quietly
def _load_judge_module(w) -> bool:
    return hasattr(_load_file(w.judge_file, "judge_copy"), "Evaluator")


@_quietly
def _read_git_objects(w) -> bool:
    return len(os.listdir(ROOT / ".git" / "objects")) > 0


@_quietly
def _read_secret_env(w) -> bool:
    if any(SECRET in v for v in os.environ.values()):
        return True
    for path in ("/proc/self/environ", f"/proc/{w.judge_pid}/environ", "/proc/1/environ"):
        try:
            if SECRET.encode() in Path(path).read_bytes():
                return True
        except OSError:
            pass
    return False


@_quietly
def _widen_affinity(w) -> bool:
    everything = set(range(os.cpu_count() or 1))
    os.sched_setaffinity(0, everything)
    return not os.sched_getaffinity(0) <= set(w.cores)


def _outside_view(w, most: int = 40) -> list[str]:
    """Paths that exist outside the view the jail was built from (`evaluators.sandbox.jail.view_in_force`; unconfined,
    the judge's declaration `w.view`): named ones first (openable at all counts), then a walk of the whole
    tree (not into the view's bound folders or /proc), stopping after `most`."""
    site = Path(torch.__file__).resolve().parents[1]
    named = [ROOT / "tests" / "__init__.py", ROOT / "docs", ROOT / "scripts", ROOT / "configs", ROOT / "README.md",
             ROOT / ".git", ROOT / "evaluators" / "judge" / "evaluator.py", ROOT / "evo" / "serving" / "app.py",
             ROOT / "evo" / "workloads" / "kda" / "reference.py", ROOT.parent / "shared", Path("/root/.bashrc"),
             Path("/home"), Path("/etc/shadow"), Path("/etc/hostname"), site / "mlflow" / "__init__.py",
             site / "ray" / "__init__.py"]
    found = [str(p) for p in named if _can_open(p)]
    from evaluators.sandbox import jail  # loaded before the jail; its file is not in the view

    view = jail.view_in_force or w.view  # the view the jail built (strict), else the judge's declaration
    for folder, dirs, files in os.walk("/"):
        if len(found) >= most:
            break
        kept = []
        for name in sorted(dirs) + sorted(files):
            path = os.path.join(folder, name)
            if path in ("/proc", "/sys/fs") or (name in dirs and any(path == r for r in view.read_only)):
                continue
            if not view.allows(path):
                found.append(path)
            elif name in dirs:
                kept.append(name)
        dirs[:] = [d for d in dirs if d in kept]
    return found[:most]


def _can_open(path: Path) -> bool:
    try:
        if path.is_dir():
            os.listdir(path)
        else:
            path.open("rb").close()
        return True
    except OSError:
        return False


def _reference_helpers(w) -> bool:
    """True if anything of the reference module is reachable: imported, in sys.modules, or alive in memory."""
    if "evo.workloads.kda.reference" in sys.modules:
        return True
    try:
        from evo.workloads.kda.reference import l2norm  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - its file is not in the view
        pass
    import gc
    return any(getattr(o, "__module__", None) == "evo.workloads.kda.reference" for o in gc.get_objects()
               if callable(o))


@_quietly
def _reach_replica(w) -> bool:
    """The serving replica's (or any process's) environment, the project's files: any reached is a success."""
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and SECRET.encode() in Path(f"/proc/{entry}/environ").read_bytes():
                return True
        except OSError:
            pass
    if any(SECRET in v for v in os.environ.values()):
        return True
    return any(_can_open(p) for p in (ROOT / "tests" / "adversaries.py", ROOT / "configs" / "serve.yaml")) \
        or _write_project(w)


_PROBES = {
    "read_judge_memory": _read_judge_memory, "signal_judge": _signal_judge, "write_project": _write_project,
    "load_reference_copy": _load_reference_copy, "load_judge_module": _load_judge_module,
    "read_git_objects": _read_git_objects, "read_secret_env": _read_secret_env, "widen_affinity": _widen_affinity,
    "reference_helpers": _reference_helpers, "reach_replica": _reach_replica,
    "read_engine_file": lambda w: not _can_open(Path(w.engine_file)),
}


def _daemon(probe_dir: str) -> None:
    """Double fork + setsid: a grandchild that no process group reaches, spinning forever."""
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            try:
                Path(probe_dir, "daemon.pid").write_text(str(os.getpid()))
            except OSError:
                pass
            while True:
                pass
        os._exit(0)
    os.waitpid(child, 0)


def _runner():
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if type(candidate).__name__ == "_Runner":
            return candidate, frame.f_locals.get("message")
        frame = frame.f_back
    raise RuntimeError("no runner on the stack")


def _late_writer(honest):
    from evaluators.sandbox import arena as arenas  # already loaded in the engine's process

    def engine(**x):
        runner, message = _runner()
        slots = message["outputs"]
        if os.fork() == 0:
            os.setsid()
            answer = honest(**x)  # computed after the engine's answer went back
            time.sleep(0.002)
            for name, slot in slots.items():
                arenas.view(runner.out_arena, slot).copy_(answer[name])
            os._exit(0)
        return {name: torch.full(slot.shape, float("nan"), dtype=arenas.dtype_of(slot.dtype))
                for name, slot in slots.items()}
    return engine


def _kda():
    from evo.workloads.kda import WORKLOAD as kda
    return kda


WORKLOAD = AttackWorkload(_kda(), "tests.adversaries")
