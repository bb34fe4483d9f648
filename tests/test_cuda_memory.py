"""CUDA arenas are allocations of their own (the driver's virtual memory API, `evaluators.sandbox.cuda_memory`),
handed to an engine's process as descriptors over its channel exactly as CPU memory files are, and
every engine process gets its own IPC namespace and /dev/shm on CUDA too.

Without a GPU these check what can be checked: the ctypes structures against cuda.h's layout, the size
rounding, the cleanup order of a mapping (against a fake driver), the error that names a missing
libcuda, the jail plan for a CUDA device, and the one hand-over path (CUDA descriptors stood in for by
memory files). The `gpu` tests map real allocations."""
from __future__ import annotations

import ctypes
import os
import socket
from multiprocessing.connection import Connection

import pytest
import torch

from evaluators.sandbox import arena as arenas
from evaluators.sandbox import cuda_memory as cm
from evaluators.sandbox import engine_process
from evaluators.sandbox import jail
from evaluators.sandbox import process as sandbox
from evaluators.sandbox.process import EngineProcess, EngineProcessError
from evaluators.sandbox.view import declared_view
from evaluators.sandbox.zygote import Spawned

MiB = 1 << 20
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_driver_structures_have_cuda_h_layout():
    # CUmemAllocationProp: type, requestedHandleTypes, location {type, id}, win32HandleMetaData, allocFlags (8 bytes)
    assert ctypes.sizeof(cm._AllocationProp) == 32
    assert (cm._AllocationProp.location.offset, cm._AllocationProp.win32HandleMetaData.offset,
            cm._AllocationProp.compressionType.offset) == (8, 16, 24)
    assert ctypes.sizeof(cm._AccessDesc) == 12 and cm._AccessDesc.flags.offset == 8  # CUmemAccessDesc
    assert (cm.HANDLE_POSIX_FD, cm.ALLOCATION_PINNED, cm.LOCATION_DEVICE, cm.ACCESS_READWRITE) == (1, 1, 1, 3)
    assert "cuMemGetAddressRange_v2" in cm._SIGNATURES  # the unversioned symbol takes 32-bit sizes


def test_sizes_round_up_to_whole_granules():
    granule = 2 * MiB
    assert [cm.round_up(n, granule) for n in (0, 1, granule, granule + 1, 5 * granule - 1)] == [
        granule, granule, granule, 2 * granule, 5 * granule]


def test_without_the_driver_a_cuda_arena_names_the_missing_library(monkeypatch):
    assert cm.LIBRARY == "libcuda.so.1"
    monkeypatch.setattr(cm, "LIBRARY", "libcuda-absent.so.1")  # absent on any machine, a GPU one included
    monkeypatch.setattr(cm, "_driver", None)
    for attempt in (lambda: arenas.allocate(10, "cuda"), lambda: arenas.attach(3, MiB, "cuda:0")):
        with pytest.raises(cm.CudaUnavailable, match="the CUDA driver library libcuda-absent.so.1 cannot be loaded"):
            attempt()


def test_a_failed_driver_call_names_the_call_and_its_curesult():
    assert str(cm.CudaError("cuMemMap", 1)) == "cuMemMap failed: CUDA_ERROR_INVALID_VALUE (1)"
    assert str(cm.CudaError("cuMemCreate", 2)) == "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (2)"


class FakeDriver:
    """Stands in for libcuda: records the calls, fills the out-parameters, fails the call named `fail`."""

    def __init__(self, fail: str = "") -> None:
        self.fail, self.calls = fail, []

    def __getattr__(self, name: str):
        def call(*args):
            self.calls.append(name)
            if name == self.fail:
                return 1  # CUDA_ERROR_INVALID_VALUE
            outputs = {"cuMemAddressReserve": 0x7F0000000000, "cuMemGetAllocationGranularity": 2 * MiB,
                       "cuDevicePrimaryCtxRetain": 0xC0, "cuCtxGetCurrent": 0xC0}
            if name in outputs:
                args[0]._obj.value = outputs[name]
            return 0
        return call


@pytest.fixture
def fake_driver(monkeypatch):
    def install(fail: str = "") -> FakeDriver:
        fake = FakeDriver(fail)
        monkeypatch.setattr(cm, "_driver", fake)
        monkeypatch.setattr(cm, "_contexts", {})
        monkeypatch.setattr(cm, "_granularity", {})
        monkeypatch.setattr(torch.cuda, "init", lambda: None)
        return fake
    return install


def test_a_mapping_is_freed_once_in_order(fake_driver):
    fake = fake_driver()
    mapping = cm.DeviceMapping(handle=7, size=4 * MiB, index=0)
    assert (mapping.pointer, mapping.guard) == (0x7F0000000000, 2 * MiB)
    made = [c for c in fake.calls if c.startswith("cuMem")]
    assert made[-3:] == ["cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"]
    fake.calls.clear()
    mapping.free()
    assert [c for c in fake.calls if c.startswith("cuMem")] == ["cuMemUnmap", "cuMemRelease", "cuMemAddressFree"]
    assert fake.calls.index("cuCtxSynchronize") < fake.calls.index("cuMemUnmap")  # queued kernels first
    fake.calls.clear()
    mapping.free()
    assert not [c for c in fake.calls if c.startswith("cuMem")]  # nothing freed twice


def test_a_mapping_that_fails_releases_what_it_made(fake_driver):
    fake = fake_driver(fail="cuMemMap")
    with pytest.raises(cm.CudaError, match="cuMemMap failed: CUDA_ERROR_INVALID_VALUE"):
        cm.DeviceMapping(handle=7, size=4 * MiB, index=0)
    made = [c for c in fake.calls if c.startswith("cuMem") and c != "cuMemGetAllocationGranularity"]
    assert made == ["cuMemAddressReserve", "cuMemMap", "cuMemRelease", "cuMemAddressFree"]  # nothing was mapped


class _NoZygote:
    """Captures the jail plan of a launch and refuses to start anything."""

    plans: list = []

    def spawn(self, preload, plan, *args, **kwargs):
        _NoZygote.plans.append(plan)
        ours, theirs = socket.socketpair()
        theirs.close()
        return Spawned(None, 0, Connection(ours.detach()), "captured by the test")


class _NoCgroup:
    def __init__(self, *args, **kwargs) -> None:
        self.procs_files = ()

    def remove(self) -> set:
        return set()

    def kill(self) -> None:
        pass


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cpu"])
def test_every_engine_process_gets_its_own_ipc_namespace_and_shm(monkeypatch, device):
    monkeypatch.setattr(sandbox.Zygote, "shared", classmethod(lambda cls, preload=(): _NoZygote()))
    monkeypatch.setattr(sandbox, "CandidateCgroup", _NoCgroup)
    _NoZygote.plans.clear()
    with pytest.raises(EngineProcessError, match="captured by the test"):
        EngineProcess(device, sandbox="strict").launch()
    plan = jail.JailPlan.from_json(_NoZygote.plans[-1])
    assert jail.namespace_flags(plan) & jail.CLONE_NEWIPC and plan.cuda == (device != "cpu"), plan
    assert "/dev/shm" in declared_view(plan.hidden, (), plan.cuda).private


def _memfd_arena(nbytes: int, device: str) -> tuple[torch.Tensor, int]:
    return arenas.allocate(nbytes, "cpu")


def test_cuda_arenas_travel_as_descriptors_like_cpu_ones(monkeypatch):
    """The judge's pair and the engine's `_inputs` take one path for both kinds: memory files stand in
    for CUDA allocations here (same calls, same descriptors on the same channel)."""
    attached = []
    monkeypatch.setattr(cm, "allocate", _memfd_arena)
    monkeypatch.setattr(cm, "attach", lambda fd, size, device: attached.append(device) or arenas.attach(fd, size))
    pair = arenas.ArenaPool("cuda").lease()
    assert pair.ensure(100, 100) and len(pair.fds) == 2
    slots, _ = arenas.layout({"x": ((4,), "float32")})
    arenas.view(pair.inputs, slots["x"]).copy_(torch.arange(4.0))

    received, recv_fds = [], socket.recv_fds

    def recording(*args):  # the descriptors the engine's side receives
        answer = recv_fds(*args)
        received.extend(answer[1])
        return answer

    monkeypatch.setattr(socket, "recv_fds", recording)
    judge, engine = socket.socketpair()
    runner = engine_process._Runner(Connection(engine.detach()), {"device": "cuda"})
    socket.send_fds(judge, [b"A"], list(pair.fds))
    inputs = runner._inputs({"arenas": {"fds": [pair.inputs.numel(), pair.outputs.numel()]}, "inputs": slots})
    assert attached == ["cuda", "cuda"]  # through the CUDA attach, for the runner's device
    assert torch.equal(inputs["x"], torch.arange(4.0))
    assert len(received) == 2
    for fd in received:  # closed once mapped
        with pytest.raises(OSError):
            os.fstat(fd)
    pair.release()
    assert pair.fds == ()
    for end in (judge, runner.sock, runner.conn):
        end.close()


# ---------------------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@needs_cuda
def test_an_arena_is_its_own_allocation_and_maps_from_its_descriptor():
    judge_tensor = torch.randn(1024, device="cuda")  # from torch's caching allocator
    arena, fd = arenas.allocate(3 * MiB + 5, "cuda")
    granule = cm.granularity(torch.cuda.current_device())
    try:
        assert arena.numel() == cm.round_up(4 * MiB, granule) and arena.is_cuda
        assert cm.address_range(arena.data_ptr(), "cuda") == (arena.data_ptr(), arena.numel())
        assert not arena.data_ptr() <= judge_tensor.data_ptr() < arena.data_ptr() + arena.numel() + granule
        assert cm.map_larger(arena.data_ptr(), arena.numel(), "cuda").startswith("CUDA_ERROR")
        other = arenas.attach(os.dup(fd), arena.numel(), "cuda")  # as an engine's process maps it
        assert other.data_ptr() != arena.data_ptr()
        arena[:8].copy_(torch.arange(8, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        assert other[:8].tolist() == list(range(8))
        del other
    finally:
        os.close(fd)


@pytest.mark.gpu
@needs_cuda
def test_a_freed_arena_returns_its_device_memory():
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    arena, fd = arenas.allocate(256 * MiB, "cuda")
    os.close(fd)
    assert free_before - torch.cuda.mem_get_info()[0] >= 256 * MiB
    del arena  # the last view: unmapped and released
    assert free_before - torch.cuda.mem_get_info()[0] < 8 * MiB
