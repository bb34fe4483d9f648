"""The KDA forward as this project's own Triton kernels, selectable by genes (engine=triton).

kernels (the @triton.jit kernels, classic and blocked), engine (TritonPlan + TritonKdaEngine), genes
(the Triton genes and their constraints), cuda_graph (engine-level CUDA-graph capture, for any engine),
compiled (launches recorded on meta tensors, compiled for sm_90 without a GPU), model (HBM bytes and
time per launch), facts (both, as `Workload.kernel_facts`). Importing this package does not import
triton; `runnable(device)` says whether the kernels can run there.
"""
from __future__ import annotations

import importlib.util
import os

from evo.workloads.base import DeviceInfo


def runnable(device: DeviceInfo) -> bool:
    """Triton is installed and can run kernels here: on a CUDA device, or on the CPU through
    Triton's interpreter (TRITON_INTERPRET=1 in the environment before the kernels are imported)."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device.kind == "cuda":
        return True
    return device.kind == "cpu" and os.environ.get("TRITON_INTERPRET", "") == "1"
