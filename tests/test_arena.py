"""The judge's shared arenas belong to the evaluator: one pair per live engine process, reused across
candidates, grown only when too small, freed at close, so candidates killed by SIGKILL leave nothing
behind in the judge (on CUDA the arenas are allocations of their own, `evaluators.sandbox.cuda_memory`, outside
torch's caching allocator: the device's free memory is what shows them)."""
from __future__ import annotations

import gc
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from evaluators.judge.evaluator import Evaluator
from evaluators.sandbox import jail
from evaluators.sandbox.arena import ArenaPool
from evaluators.settings import EvaluatorSettings
from tests import fake_workload as fw

CANDIDATES = 20
SANDBOX = "none" if jail.unavailable() else "strict"
KILLED = EvaluatorSettings(warmup=0, repeats=1, sandbox=SANDBOX)


def _judge_memory() -> dict[str, int]:
    """The judge's arena mappings, open descriptors and resident bytes, as /proc shows them."""
    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    rss_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return {"arena_maps": maps.count("memfd:evo-arena"), "fds": len(os.listdir("/proc/self/fd")),
            "rss": rss_pages * os.sysconf("SC_PAGE_SIZE")}


def _killed_candidates(ev: Evaluator, n: int) -> None:
    """n candidates of the evaluator's (its `engine_process`, as an evaluation starts them), each
    SIGKILLed once it has mapped the judge's arenas (after its echo calls), as the judge kills a hung
    engine at its deadline."""
    case = ev._timing_case
    for _ in range(n):
        with ev.engine_process() as process:
            process.launch(preload=(fw.__name__,))
            process.configure(ev.workload, ev.preset, ev.device_info(), genome_json=fw.genome_json("cumsum"))
            process.calibrate(ev._draw(case), ev._specs(case), repeats=1)
            os.kill(process.pid, signal.SIGKILL)


def test_sigkilled_candidates_leave_the_judges_shared_memory_bounded(fake):
    ev = Evaluator(fake, "cpu", KILLED, seed=1, name="arena-test")
    _killed_candidates(ev, 1)  # the first allocates the pool's pair
    before, pool_bytes = _judge_memory(), ev._arenas.nbytes
    assert before["arena_maps"] >= 2 and ev._arenas.pairs == 1
    _killed_candidates(ev, CANDIDATES)
    after = _judge_memory()
    assert ev._arenas.pairs == 1 and ev._arenas.nbytes == pool_bytes  # reused, never re-allocated
    assert after["arena_maps"] == before["arena_maps"], (before, after)
    assert after["fds"] <= before["fds"], (before, after)
    assert after["rss"] - before["rss"] < 64 << 20, (before, after)
    ev.close()
    assert _judge_memory()["arena_maps"] == 0 and ev._arenas.pairs == 0


def test_the_pool_lends_one_pair_per_live_process_and_grows_only_when_needed():
    pool = ArenaPool("cpu")
    a, b = pool.lease(), pool.lease()  # two engines alive at once (a paired re-timing)
    assert a is not b
    assert a.ensure(1000, 10) and a.version == 1 and not a.ensure(1000, 10)
    assert a.ensure(3 << 20, 10) and a.version == 2 and a.inputs.numel() >= 3 << 20  # grown: sent again
    b.ensure(10, 10)
    pool.give_back(a)
    pool.give_back(b)
    assert pool.lease() is a  # the larger free pair first: no growth for the next candidate
    assert pool.lease() is b and pool.pairs == 2
    pool.discard(b)  # a process of its candidate outlived the kill: never lent again
    assert pool.pairs == 1 and b.inputs is None
    pool.close()
    assert pool.pairs == 0 and a.inputs is None and a.fds == ()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sigkilled_candidates_leave_the_judges_cuda_memory_bounded(fake):
    ev = Evaluator(fake, "cuda", KILLED, seed=1, name="arena-test-cuda")
    _killed_candidates(ev, 1)  # the pool's pair allocated
    before, pool_bytes = _settled_free_cuda(), ev._arenas.nbytes
    _killed_candidates(ev, CANDIDATES)
    assert ev._arenas.pairs == 1 and ev._arenas.nbytes == pool_bytes  # reused, never re-allocated
    after = _settled_free_cuda(before)
    assert before - after <= 64 << 20, (before, after)
    ev.close()
    assert _settled_free_cuda(after + pool_bytes) >= after + pool_bytes - (8 << 20)  # the pair freed at close


def _settled_free_cuda(target: int = 0, timeout_s: float = 10.0) -> int:
    """The device's free bytes, once they reach `target` or stop at the timeout (the driver frees a
    SIGKILLed process's context shortly after it dies)."""
    until = time.monotonic() + timeout_s
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    while free < target and time.monotonic() < until:
        time.sleep(0.2)
        free = torch.cuda.mem_get_info()[0]
    return free
