"""The GPU check's preflight part (run by scripts/gpu_check.py in a child process, first, in seconds):
versions; the CUDA device and its compute mode; a trivial Triton kernel compiled and run
(TRITON_CACHE_DIR inside the output folder; the C compiler Triton needs); free device memory; whether
fla's KDA kernels import; the strict sandbox probe; then, from jailed engine processes
(`evaluators.sandbox.isolation_probe`), what a candidate reaches beyond its own arena (CUDA: the arena's
address range, mapping its allocation larger, a read one granule past it) and beyond its own files
(what the previous candidate left in its /tmp, /dev/shm and System V IPC). Each item is one line
(ok, warn, FAIL or skipped: the cause and what it skips), recorded in OUT/preflight.json as it
finishes, so a preflight stopped at its budget still says what it saw. On CPU the CUDA items are
"skipped (no CUDA)" and the Triton kernel runs in the interpreter; the files probe runs on CPU too."""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

def preflight(args: argparse.Namespace) -> int:
    """Run every item in order (see the module's docstring)."""
    out = Path(args.out)
    record: list[dict] = []

    def say(item: str, status: str, detail: str, **extra) -> None:
        record.append({"item": item, "status": status, "detail": detail, **extra})
        print(f"preflight {item}: {status}: {detail}", flush=True)
        tmp = out / "preflight.json.tmp"  # replaced whole: a preflight stopped mid-write leaves the last record
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, out / "preflight.json")

    import torch

    say("versions", "ok", _versions(torch))
    cuda = torch.cuda.is_available()
    exclusive = False
    if cuda:
        exclusive = _device_item(torch, say)
    else:
        say("device", "skipped (no CUDA)", "CUDA items skipped; engines run on the CPU")
    _triton_item(say, out, cuda)
    if cuda:
        free, total = torch.cuda.mem_get_info()
        status = "ok" if free > 0.5 * total else "warn"
        say("memory", status, f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free on the device"
            + ("" if status == "ok" else ": another process holds the rest; large engines may run out of memory"))
    else:
        say("memory", "skipped (no CUDA)", f"host: {_host_available_gib():.1f} GiB available")
    _fla_item(say)
    strict = _sandbox_item(say, "cuda" if cuda else "cpu")
    _isolation_items(say, "cuda" if cuda else "cpu", strict, exclusive)
    return 0


def _versions(torch) -> str:
    import importlib.util
    import platform

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    for name in ("triton", "numpy", "pynvml", "ray", "mlflow", "fla"):
        spec = importlib.util.find_spec(name)
        version = ""
        if spec is not None and name in ("triton", "numpy"):
            version = " " + getattr(__import__(name), "__version__", "?")
        parts.append(f"{name} {'yes' + version if spec else 'no'}")
    return ", ".join(parts)


PREFLIGHT_ITEMS = ("versions", "device", "triton", "memory", "fla", "sandbox", "arena bounds", "candidate files")
ISOLATION_ITEMS = ("arena bounds", "candidate files")  # a FAIL here fails the check
COMPUTE_MODES = {0: "DEFAULT", 1: "EXCLUSIVE_THREAD", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}


def _device_item(torch, say) -> bool:
    """The device line; True when the compute mode refuses a second process's context."""
    props = torch.cuda.get_device_properties(0)
    mode, how = _compute_mode(props)
    detail = (f"{props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
              f"{props.multi_processor_count} SMs, CUDA {torch.version.cuda}, compute mode {mode} ({how})")
    if mode == "EXCLUSIVE_PROCESS" or mode == "PROHIBITED":
        say("device", "warn", detail + ": every engine runs in a process of its own beside the judge's CUDA context,"
            " which this mode refuses: skipped: the isolation probes and every engine evaluation", skips_engines=True)
        return True
    say("device", "ok", detail)
    return False


def _compute_mode(props) -> tuple[str, str]:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            uuid = getattr(props, "uuid", None)
            handle = (pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}") if uuid is not None
                      else pynvml.nvmlDeviceGetHandleByIndex(0))
            return COMPUTE_MODES.get(pynvml.nvmlDeviceGetComputeMode(handle), "?"), "NVML"
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - no NVML: ask nvidia-smi
        try:
            text = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader", "-i", "0"],
                                  capture_output=True, text=True, timeout=20).stdout.strip()
            return text.upper().replace(" ", "_") or "unknown", "nvidia-smi"
        except (OSError, subprocess.SubprocessError):
            return "unknown", f"neither NVML ({type(exc).__name__}) nor nvidia-smi answered"


def _triton_item(say, out: Path, cuda: bool) -> None:
    compiler = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), "")
    cache = Path(os.environ.get("TRITON_CACHE_DIR", out / "triton-cache"))
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    start = time.perf_counter()
    try:
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def add_one(x_ptr, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

        x = torch.zeros(1000, device="cuda" if cuda and not interpret else "cpu")
        add_one[(triton.cdiv(1000, 256),)](x, 1000, BLOCK=256)
        ok = bool((x == 1).all())
    except Exception as exc:  # noqa: BLE001
        text = str(exc).strip().splitlines()
        say("triton", "FAIL", f"{type(exc).__name__}: {text[0] if text else ''} (C compiler: {compiler or 'none'}):"
            " skipped: every Triton genome (they fail to build)")
        return
    where = "interpreter" if interpret else f"compiled, cache {cache} ({_count_files(cache)} files)"
    say("triton", "ok" if ok else "FAIL", f"a trivial kernel ran ({where}, {time.perf_counter() - start:.1f} s),"
        f" C compiler: {compiler or 'NONE (Triton needs one to build its launcher on a GPU)'}")


def _count_files(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def _host_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return math.nan


def _fla_item(say) -> None:
    from evo.workloads.kda.gpu_baselines import fla_import_error

    start = time.perf_counter()
    error = fla_import_error()
    if error:
        say("fla", "warn", f"no ({error}): the fla baselines fail loudly where named; wheels: scripts/fetch_wheels.sh")
        return
    import importlib.metadata as md

    try:
        version = md.version("fla-core")
    except md.PackageNotFoundError:
        version = "?"
    say("fla", "ok", f"yes (fla-core {version}; fla.ops.kda imports, {time.perf_counter() - start:.1f} s)")


def _sandbox_item(say, device: str) -> bool:
    """The sandbox line; True when the strict sandbox works here."""
    from evaluators.sandbox.process import probe_strict

    start = time.perf_counter()
    why = probe_strict()
    if why:
        say("sandbox", "warn", f"NONE: engines run UNCONFINED on this machine ({why})")
        return False
    say("sandbox", "ok", f"strict (namespaces, seccomp, cgroups; probe {time.perf_counter() - start:.1f} s)")
    return True


def _isolation_items(say, device: str, strict: bool, exclusive: bool) -> None:
    """'arena bounds' and 'candidate files': two probe candidates on `device`, one after the other."""
    from evaluators.sandbox import isolation_probe as probes

    cuda = device == "cuda"
    if exclusive or not (cuda or strict):
        why = ("EXCLUSIVE_PROCESS: an engine process cannot open a CUDA context" if exclusive
               else "no strict sandbox here: engines share the judge's files")
        for item in ISOLATION_ITEMS:
            say(item, "skipped (no CUDA)" if item == "arena bounds" and not cuda else "skipped", why)
        return
    start = time.perf_counter()
    try:
        findings = probes.run_probes(device, "strict" if strict else "none")
    except Exception as exc:  # noqa: BLE001 - a preflight item reports, never raises
        findings = probes.Findings({}, {}, {}, error=f"{type(exc).__name__}: {exc}")
    took = f" ({time.perf_counter() - start:.1f} s)"
    for item, status, detail in probes.rows(findings, cuda, strict):
        say(item, status, detail + ("" if status.startswith("skipped") else took))


