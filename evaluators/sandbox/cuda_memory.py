"""CUDA memory for the judge's arenas, apart from torch's caching allocator: each arena is an allocation
of its own, made with the driver's virtual memory management API (`cuMemCreate`, through ctypes on
`libcuda.so.1`: no new dependency), and shared with an engine's process as a file descriptor.

Why not torch tensors over CUDA IPC: `cudaIpcGetMemHandle` exposes the whole `cudaMalloc` block a
tensor lies in, and the caching allocator packs many tensors into one block, the judge's own inputs
and expected outputs among them. An allocation made here holds one arena and nothing else, and the
judge's tensors (from the caching allocator) never lie in one, so the descriptor an engine imports
reaches exactly its arena. The descriptor travels over the engine's own channel (SCM_RIGHTS), as a CPU
arena's memory file does: no key is handed out, and the engine needs neither the judge's IPC namespace
nor its /dev/shm.

Each mapping reserves one granule more address space than it maps (a guard), so a read one granule
past an arena faults instead of landing on other memory of the same process. A mapping is freed
(unmapped, released, its addresses returned) when the last tensor viewing it is gone, or by `free()`.

Not yet run on a GPU (see docs/gpu.md); the CPU tests check the structures, sizes and error paths.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Iterator

import torch

LIBRARY = "libcuda.so.1"
HANDLE_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
ALLOCATION_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
ACCESS_READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
GRANULARITY_MINIMUM = 0  # CU_MEM_ALLOC_GRANULARITY_MINIMUM
# CUresult names, for messages where the driver cannot name a code itself (it is not loaded)
RESULT_NAMES = {0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
                3: "CUDA_ERROR_NOT_INITIALIZED", 4: "CUDA_ERROR_DEINITIALIZED", 100: "CUDA_ERROR_NO_DEVICE",
                101: "CUDA_ERROR_INVALID_DEVICE", 201: "CUDA_ERROR_INVALID_CONTEXT",
                400: "CUDA_ERROR_INVALID_HANDLE", 700: "CUDA_ERROR_ILLEGAL_ADDRESS", 801: "CUDA_ERROR_NOT_SUPPORTED",
                999: "CUDA_ERROR_UNKNOWN"}


class CudaError(RuntimeError):
    """A driver call failed; the message names the call and its CUresult."""

    def __init__(self, call: str, result: int) -> None:
        super().__init__(f"{call} failed: {result_name(result)} ({result})")
        self.call, self.result = call, result


class CudaUnavailable(RuntimeError):
    """The CUDA driver library cannot be loaded here."""


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("compressionType", ctypes.c_ubyte),
                ("gpuDirectRDMACapable", ctypes.c_ubyte), ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 4)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_u64, _size, _ptr = ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_void_p
_SIGNATURES = {  # argument types of every driver call made here
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_ptr), ctypes.c_int],
    "cuCtxGetCurrent": [ctypes.POINTER(_ptr)],
    "cuCtxSetCurrent": [_ptr],
    "cuCtxSynchronize": [],
    "cuMemGetAllocationGranularity": [ctypes.POINTER(_size), ctypes.POINTER(_AllocationProp), ctypes.c_int],
    "cuMemCreate": [ctypes.POINTER(_u64), _size, ctypes.POINTER(_AllocationProp), _u64],
    "cuMemRelease": [_u64],
    "cuMemRetainAllocationHandle": [ctypes.POINTER(_u64), _ptr],
    "cuMemAddressReserve": [ctypes.POINTER(_u64), _size, _size, _u64, _u64],
    "cuMemAddressFree": [_u64, _size],
    "cuMemMap": [_u64, _size, _size, _u64, _u64],
    "cuMemUnmap": [_u64, _size],
    "cuMemSetAccess": [_u64, _size, ctypes.POINTER(_AccessDesc), _size],
    "cuMemExportToShareableHandle": [_ptr, _u64, ctypes.c_int, _u64],
    "cuMemImportFromShareableHandle": [ctypes.POINTER(_u64), _ptr, ctypes.c_int],
    "cuMemGetAddressRange_v2": [ctypes.POINTER(_u64), ctypes.POINTER(_size), _u64],
}
_driver: ctypes.CDLL | None = None
_contexts: dict[int, int] = {}  # device ordinal -> its primary context, retained once per process
_granularity: dict[int, int] = {}  # device ordinal -> bytes
_lock = threading.Lock()


def result_name(result: int) -> str:
    """The CUresult's name (the driver's own when it is loaded)."""
    if _driver is not None:
        name = ctypes.c_char_p()
        if _driver.cuGetErrorName(result, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
    return RESULT_NAMES.get(result, "CUresult")


def check(result: int, call: str) -> None:
    if result != 0:
        raise CudaError(call, result)


def driver() -> ctypes.CDLL:
    """The CUDA driver library, loaded once (`CudaUnavailable`, naming it, where it cannot be)."""
    global _driver
    with _lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL(LIBRARY)
            except OSError as exc:
                raise CudaUnavailable(f"the CUDA driver library {LIBRARY} cannot be loaded ({exc}): CUDA arenas"
                                      " need NVIDIA's driver; on a machine without one use a CPU preset") from exc
            for name, argtypes in _SIGNATURES.items():
                getattr(lib, name).argtypes = argtypes
                getattr(lib, name).restype = ctypes.c_int
            _driver = lib
    return _driver


def round_up(nbytes: int, granularity: int) -> int:
    """`nbytes` rounded up to a whole number of granules (at least one)."""
    return max(1, -(-int(nbytes) // granularity)) * granularity


def ordinal(device: str | torch.device) -> int:
    """The CUDA device's index ("cuda" alone: torch's current device). The driver is loaded first, so a
    machine without one hears that, by name, before torch says anything vaguer."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device}")
    driver()
    return torch.cuda.current_device() if device.index is None else device.index


@contextlib.contextmanager
def primary_context(index: int) -> Iterator[ctypes.CDLL]:
    """The driver, with the device's primary context (the one torch's runtime uses) current on this
    thread for the block; the thread's previous context is restored after it."""
    lib = driver()
    torch.cuda.init()  # torch's runtime first, so the primary context retained here is torch's own
    with _lock:
        if index not in _contexts:
            check(lib.cuInit(0), "cuInit")
            dev, ctx = ctypes.c_int(), _ptr()
            check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
            check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            _contexts[index] = ctx.value
    previous = _ptr()
    check(lib.cuCtxGetCurrent(ctypes.byref(previous)), "cuCtxGetCurrent")
    check(lib.cuCtxSetCurrent(_contexts[index]), "cuCtxSetCurrent")
    try:
        yield lib
    finally:
        if previous.value and previous.value != _contexts[index]:
            lib.cuCtxSetCurrent(previous)


def _properties(index: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type, prop.requestedHandleTypes = ALLOCATION_PINNED, HANDLE_POSIX_FD
    prop.location = _Location(LOCATION_DEVICE, index)
    return prop


def granularity(index: int) -> int:
    """The device's allocation granularity in bytes (2 MiB on current GPUs), asked once per device."""
    if index not in _granularity:
        with primary_context(index) as lib:
            size = _size()
            check(lib.cuMemGetAllocationGranularity(ctypes.byref(size), ctypes.byref(_properties(index)),
                                                    GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")
            _granularity[index] = size.value
    return _granularity[index]


class DeviceMapping:
    """One allocation mapped read/write at `pointer` (`size` bytes) in this process, with a guard granule
    reserved after it. It owns `handle` from construction on (released if mapping fails). Torch wraps it
    through `__cuda_array_interface__` (`tensor()`); the tensor keeps the mapping alive, and the mapping
    is freed once no tensor views it (or by `free()`)."""

    def __init__(self, handle: int, size: int, index: int) -> None:
        self.size, self.index = size, index
        self.guard = granularity(index)
        self.pointer, self._handle, self._mapped = 0, handle, False
        try:
            with primary_context(index) as lib:
                address = _u64()
                check(lib.cuMemAddressReserve(ctypes.byref(address), size + self.guard, 0, 0, 0),
                      "cuMemAddressReserve")
                self.pointer = address.value
                check(lib.cuMemMap(self.pointer, size, 0, handle, 0), "cuMemMap")
                self._mapped = True
                access = _AccessDesc(_Location(LOCATION_DEVICE, index), ACCESS_READWRITE)
                check(lib.cuMemSetAccess(self.pointer, size, ctypes.byref(access), 1), "cuMemSetAccess")
        except BaseException:
            self.free()
            raise

    @property
    def __cuda_array_interface__(self) -> dict:
        return cuda_array_interface(self.pointer, self.size)

    def tensor(self) -> torch.Tensor:
        """The mapping as a flat uint8 tensor on its device (no copy: checked)."""
        flat = torch.as_tensor(self, device=torch.device("cuda", self.index))
        if flat.data_ptr() != self.pointer or flat.numel() != self.size:
            raise RuntimeError(f"torch copied the arena instead of wrapping it (at {flat.data_ptr():#x},"
                               f" expected {self.pointer:#x})")
        return flat

    def export(self) -> int:
        """A new descriptor another process imports this allocation from (not inherited by children)."""
        fd = ctypes.c_int(-1)
        with primary_context(self.index) as lib:
            check(lib.cuMemExportToShareableHandle(ctypes.byref(fd), self._handle, HANDLE_POSIX_FD, 0),
                  "cuMemExportToShareableHandle")
        os.set_inheritable(fd.value, False)
        return fd.value

    def free(self) -> None:
        """Unmap, release the allocation handle and return the addresses (once; after the device is idle)."""
        if not (self._mapped or self._handle is not None or self.pointer):
            return
        with primary_context(self.index) as lib:
            check(lib.cuCtxSynchronize(), "cuCtxSynchronize")  # no queued kernel may still use it
            if self._mapped:
                self._mapped = False
                check(lib.cuMemUnmap(self.pointer, self.size), "cuMemUnmap")
            if self._handle is not None:
                handle, self._handle = self._handle, None
                check(lib.cuMemRelease(handle), "cuMemRelease")
            if self.pointer:
                pointer, self.pointer = self.pointer, 0
                check(lib.cuMemAddressFree(pointer, self.size + self.guard), "cuMemAddressFree")

    def __del__(self) -> None:
        try:
            self.free()
        except BaseException:  # noqa: BLE001 - at interpreter exit the driver may be gone; the process frees all
            pass


def cuda_array_interface(pointer: int, size: int) -> dict:
    """`size` bytes at `pointer` as a flat uint8 array (version 3, no stream: the caller synchronises)."""
    return {"shape": (size,), "typestr": "|u1", "data": (pointer, False), "strides": None, "version": 3}


def allocate(nbytes: int, device: str | torch.device) -> tuple[torch.Tensor, int]:
    """A new allocation of at least `nbytes` (rounded up to the granularity) on `device`, holding nothing
    else, mapped here: (its flat uint8 tensor, a descriptor an engine's process imports it from; the
    caller closes the descriptor)."""
    index = ordinal(device)
    size = round_up(nbytes, granularity(index))
    with primary_context(index) as lib:
        handle = _u64()
        check(lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(_properties(index)), 0), "cuMemCreate")
    mapping = DeviceMapping(handle.value, size, index)
    return mapping.tensor(), mapping.export()


def attach(fd: int, size: int, device: str | torch.device) -> torch.Tensor:
    """The allocation behind a descriptor from `allocate`, mapped here as a flat uint8 tensor of `size`
    bytes (the mapping outlives `fd`, which the caller closes)."""
    index = ordinal(device)
    with primary_context(index) as lib:
        handle = _u64()
        check(lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), HANDLE_POSIX_FD),
              "cuMemImportFromShareableHandle")
    return DeviceMapping(handle.value, size, index).tensor()


def address_range(pointer: int, device: str | torch.device) -> tuple[int, int]:
    """(base, size) of the mapped allocation that holds `pointer`, as the driver reports it."""
    with primary_context(ordinal(device)) as lib:
        base, size = _u64(), _size()
        check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), pointer), "cuMemGetAddressRange")
        return base.value, size.value


def map_larger(pointer: int, size: int, device: str | torch.device) -> str:
    """Try to map the allocation at `pointer` one granule larger than `size`, in a fresh address range:
    "" if the driver allowed it (it must not), else the CUresult that refused it."""
    index = ordinal(device)
    extra = granularity(index)
    with primary_context(index) as lib:
        handle, address = _u64(), _u64()
        check(lib.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(pointer)),
              "cuMemRetainAllocationHandle")
        try:
            check(lib.cuMemAddressReserve(ctypes.byref(address), size + extra, 0, 0, 0), "cuMemAddressReserve")
            result = lib.cuMemMap(address.value, size + extra, 0, handle, 0)
            if result == 0:
                lib.cuMemUnmap(address.value, size + extra)
            lib.cuMemAddressFree(address.value, size + extra)
        finally:
            lib.cuMemRelease(handle)
    return "" if result == 0 else result_name(result)
