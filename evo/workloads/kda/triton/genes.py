"""The Triton genes of the KDA gene space (added where `runnable(device)`), their constraints, and the
genes each engine ignores.

`engine` picks the implementation: "triton" (this package's kernels) or "torch" (the stage engine).
Genes shared with the torch engine keep their meaning: chunk_size, compute_dtype (plus "tfloat32",
triton only), state_layout, preallocate_outputs, fuse_l2norm_intra (prepare folded into the intra
kernel) and fuse_recurrence_output (output inside the recurrence kernel); cuda_graph wraps either
engine. triton_kernels picks the kernel family: "blocked" (the default, sized by compile facts: see
`compiled` and `model`) or "classic" (the first kernels, kept as a choice); workspace_dtype, state_operands
block_k and output_backend (the output stage in Triton or CUDA C, `cuda_output`) are read by the blocked
kernels only, fuse_l2norm_intra and state_layout by the classic ones.
block_v, num_warps and num_stages only shape Triton launches, so a torch genome ignores them;
the torch-only genes (`TORCH_ONLY` and the pipeline's backends) do nothing for a Triton genome, whose
engine has no CPU thread count either. fuse_gate_l2norm and fuse_intra_recurrence are not read by the
Triton engine but pinned by a constraint (to their defaults), so they need no rule. A canonical genome
(`evo.core.genome.Ignored`) gives every ignored gene its default: one hash per engine built.
"""
from __future__ import annotations

from typing import Mapping

from evo.core.genome import Constraint, Gene, Ignored, Scalar, StagePipeline
from evo.workloads.base import DeviceInfo, Preset

BLOCK_V = (32, 64, 128, 16)
# read by the torch stage engine (its Plan) and not by the Triton engine (its TritonPlan), besides the backends
TORCH_ONLY = ("sub_chunk_size", "intra_algorithm", "exponent_form", "threads", "layout", "intermediates")
TRITON_ONLY = ("block_v", "num_warps", "num_stages", "triton_kernels", "workspace_dtype", "state_operands",
               "block_k", "output_backend")  # read by TritonPlan only
BLOCKED_ONLY = ("workspace_dtype", "state_operands", "block_k", "output_backend")  # read by the blocked kernels only
CLASSIC_ONLY = ("fuse_l2norm_intra", "state_layout")  # the blocked kernels fold prepare in and hold the state [K, V]


def genes(preset: Preset, device: DeviceInfo) -> list[Gene]:
    """Genes only the Triton engine reads (cuda_graph: either engine, CUDA only)."""
    V = preset.shape["V"]
    block_v = tuple(b for b in BLOCK_V if b <= max(16, V))
    out = [
        Gene("engine", "scheduling", ("triton", "torch"), "triton",
             "triton: this project's Triton kernels; torch: the stage functions on eager/compile backends"),
        Gene("block_v", "scheduling", block_v, block_v[0],
             "triton: V columns per recurrence/output program (programs = B*H*ceil(V/block_v))"),
        # sm_90 compiles at h200 (`python -m evo kernels`): the blocked kernels at C=64 spill nothing with 8 warps,
        # block_v=32 and 2 stages (4 warps spill 520-644 B in intra and the recurrence)
        Gene("num_warps", "scheduling", (8, 4, 2), 8, "triton: warps per program"),
        # classic kernels: the fused recurrence needs 90 KB of shared memory at C=64, block_v=64 with 1 stage,
        # 270 KB with 2 (over the 227 KB a block may have); blocked: 24-41 KB at C=64: see the constraint
        Gene("num_stages", "scheduling", (2, 1, 3), 2, "triton: software-pipelining stages of the chunk loops"),
        Gene("triton_kernels", "scheduling", ("blocked", "classic"), "blocked",
             "triton: blocked (intra by 16-row blocks and K tiles with a blocked solve, Qg recomputed, K-split"
             " pipelined recurrence, bf16-able workspaces) or classic (the first kernels: whole-chunk intra,"
             " row-by-row inverse, float32 workspaces)"),
        Gene("workspace_dtype", "memory", workspace_dtypes(preset), workspace_dtypes(preset)[0],
             "triton blocked: dtype of W, Kd, U0, U and the chunk states between kernels"),
        Gene("state_operands", "memory", ("tfloat32", "bfloat16"), "tfloat32",
             "triton blocked, bfloat16 compute: operands of the products with the float32 state (W S, Kd^T U, Qg S)"),
        Gene("block_k", "scheduling", (32, 64), 32, "triton blocked: K (and V) tile of intra and output"),
        Gene("output_backend", "scheduling", output_backends(device), "triton",
             "triton blocked, output not fused: the output stage as the Triton kernel or as CUDA C (NVRTC"
             " through CuPy, CUDA devices with cupy only)"),
    ]
    if device.kind == "cuda":
        out.append(Gene("cuda_graph", "scheduling", (False, True), False,
                        "capture the whole engine call in a CUDA graph per input shape (static buffers,"
                        " re-captured for a new shape); inputs copied in, outputs copied out unless"
                        " preallocate_outputs"))
    return out


def output_backends(device: DeviceInfo) -> tuple[str, ...]:
    """The output stage's backends: CUDA C joins on CUDA devices where cupy is installed."""
    import importlib.util

    return ("triton", "cuda") if device.kind == "cuda" and importlib.util.find_spec("cupy") else ("triton",)


def workspace_dtypes(preset: Preset) -> tuple[str, ...]:
    """Workspace dtypes of the blocked kernels: bfloat16 joins on bf16 presets (float32 presets need float32)."""
    return ("bfloat16", "float32") if preset.dtype == "bfloat16" else ("float32",)


def compute_dtypes(preset: Preset) -> tuple[str, ...]:
    """compute_dtype values where Triton runs: tfloat32 joins on bf16 presets (fp32 presets need ieee)."""
    return ("float32", "bfloat16", "tfloat32") if preset.dtype == "bfloat16" else ("float32",)


def default_compute_dtype(preset: Preset) -> str:
    """bfloat16 operands on bf16 presets (the tensor cores' fastest), else float32."""
    return "bfloat16" if preset.dtype == "bfloat16" else "float32"


def _triton_fusion(values: Mapping[str, Scalar]) -> str | None:
    if values.get("engine") != "triton":
        return None
    if values.get("fuse_intra_recurrence") is not False:
        return ("engine='triton' runs intra (whole K and V per chunk) and the recurrence (per V tile) as"
                " separate kernels: set fuse_intra_recurrence=False (allowed with triton: [False])")
    if values.get("fuse_gate_l2norm") is not True:
        return ("engine='triton' computes gate and l2norm in one prepare step: set fuse_gate_l2norm=True"
                " (allowed with triton: [True])")
    return None


SHARED_MEMORY_BYTES = 232448  # what one block may use on sm_90 (227 KB)


def _stages_fit_shared_memory(values: Mapping[str, Scalar]) -> str | None:
    # sm_90 compiles (Triton 3.9, K=V=128, `python -m evo kernels`): classic kernels with 2-3 stages fit for
    # every C <= 32 tile (at most 213 KB), C=64 does not (238-385 KB); with 1 stage everything fits.
    # Blocked: the recurrence buffers W, Kd halves and U0 per stage; fp32 workspaces at C=64, block_v=32,
    # 2 stages took 152 KB, at block_v=64 with 3 stages too much: `_blocked_shared_estimate` bounds it
    stages, C = values.get("num_stages"), values.get("chunk_size")
    if values.get("engine") != "triton" or not (isinstance(stages, int) and stages > 1 and isinstance(C, int)):
        return None
    blocked = values.get("triton_kernels") == "blocked"
    largest = 64 if blocked else 32
    if C > largest:
        sizes = [c for c in (16, 32, 64) if c <= largest]
        return (f"num_stages={stages} with chunk_size={C} ({values.get('triton_kernels')} kernels) needs more than the"
                f" {SHARED_MEMORY_BYTES} bytes of shared memory a block may have on sm_90; use num_stages=1 or"
                f" chunk_size in {sizes}")
    estimate = _blocked_shared_estimate(values) if blocked else 0
    if estimate > SHARED_MEMORY_BYTES:
        return (f"num_stages={stages} with chunk_size={C}, block_v={values.get('block_v')} and"
                f" workspace_dtype={values.get('workspace_dtype')!r} needs ~{estimate} bytes of shared memory (blocked"
                f" recurrence at K=128), over the {SHARED_MEMORY_BYTES} a block may have on sm_90; use fewer stages,"
                " a smaller block_v or bfloat16 workspaces")
    return None


def _blocked_shared_estimate(values: Mapping[str, Scalar]) -> int:
    """A bound on the blocked recurrence's shared memory at K=128: per stage W and Kd ([C, 128] each) and
    U0 ([C, block_v]) in the workspace dtype, plus 16 KB of layout conversions."""
    C, BV, stages = int(values["chunk_size"]), int(values["block_v"]), int(values["num_stages"])
    item = 2 if values.get("workspace_dtype") == "bfloat16" else 4
    return stages * (2 * C * 128 + C * BV) * item + 16 * 1024


def _tf32_needs_triton(values: Mapping[str, Scalar]) -> str | None:
    if values.get("compute_dtype") == "tfloat32" and values.get("engine") != "triton":
        return (f"compute_dtype='tfloat32' is only implemented by engine='triton', got engine={values.get('engine')!r};"
                " allowed with torch: ['float32', 'bfloat16']")
    return None


def constraints() -> tuple[Constraint, ...]:
    return (
        Constraint("triton fuses prepare, never intra with the recurrence", _triton_fusion),
        Constraint("tfloat32 operands need the triton engine", _tf32_needs_triton),
        Constraint("pipelined stages fit shared memory", _stages_fit_shared_memory),
    )


def ignored(pipeline: StagePipeline) -> tuple[Ignored, ...]:
    """What each engine does not read: the torch stage engine's genes (its backends from `pipeline`)
    under engine='triton', the Triton launch genes under engine='torch'."""
    backends = tuple(pipeline.backend_gene(s) for s in pipeline.stages)
    return (
        Ignored(backends + TORCH_ONLY, _triton_engine,
                "the Triton engine reads neither backends nor the torch stage engine's algorithm and layout genes"),
        Ignored(TRITON_ONLY, _torch_engine, "the torch stage engine does not launch Triton kernels"),
        Ignored(BLOCKED_ONLY, _classic_kernels, "the classic kernels keep float32 workspaces and whole-K tiles"),
        Ignored(CLASSIC_ONLY, _blocked_kernels,
                "the blocked kernels fold prepare into intra and hold the state [K, V]"),
        Ignored(("state_operands",), _no_bf16_compute, "state products follow compute_dtype unless it is bfloat16"),
        Ignored(("output_backend",), _fused_output, "a fused output runs inside the recurrence kernel"),
    )


def _fused_output(values: Mapping[str, Scalar]) -> bool:
    return values.get("engine") == "triton" and values.get("fuse_recurrence_output") is True


def _classic_kernels(values: Mapping[str, Scalar]) -> bool:
    return values.get("engine") == "triton" and values.get("triton_kernels") == "classic"


def _blocked_kernels(values: Mapping[str, Scalar]) -> bool:
    return values.get("engine") == "triton" and values.get("triton_kernels") == "blocked"


def _no_bf16_compute(values: Mapping[str, Scalar]) -> bool:
    return values.get("engine") == "triton" and values.get("compute_dtype") != "bfloat16"


def _triton_engine(values: Mapping[str, Scalar]) -> bool:
    return values.get("engine") == "triton"


def _torch_engine(values: Mapping[str, Scalar]) -> bool:
    return values.get("engine") == "torch"
