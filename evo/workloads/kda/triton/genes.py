"""The Triton genes of the KDA gene space (added where `runnable(device)`), their constraints, and the
genes each engine ignores.

`engine` picks the implementation: "triton" (this package's kernels) or "torch" (the stage engine).
Genes shared with the torch engine keep their meaning: chunk_size, compute_dtype (plus "tfloat32",
triton only), state_layout, preallocate_outputs, fuse_l2norm_intra (prepare folded into the intra
kernel) and fuse_recurrence_output (output inside the recurrence kernel); cuda_graph wraps either
engine. block_v, num_warps and num_stages only shape Triton launches, so a torch genome ignores them;
the torch-only genes (`TORCH_ONLY` and the pipeline's backends) do nothing for a Triton genome, whose
engine has no CPU thread count either. fuse_gate_l2norm and fuse_intra_recurrence are not read by the
Triton engine but pinned by a constraint (to their defaults), so they need no rule. A canonical genome
(`evo.core.genome.Ignored`) gives every ignored gene its default: one hash per engine built.
"""
from __future__ import annotations

from typing import Mapping

from evo.core.genome import Constraint, Gene, Ignored, Scalar, StagePipeline
from evo.workloads.base import DeviceInfo, Preset

BLOCK_V = (64, 32, 128, 16)
# read by the torch stage engine (its Plan) and not by the Triton engine (its TritonPlan), besides the backends
TORCH_ONLY = ("sub_chunk_size", "intra_algorithm", "exponent_form", "threads", "layout", "intermediates")
TRITON_ONLY = ("block_v", "num_warps", "num_stages")  # read by TritonPlan only


def genes(preset: Preset, device: DeviceInfo) -> list[Gene]:
    """Genes only the Triton engine reads (cuda_graph: either engine, CUDA only)."""
    V = preset.shape["V"]
    block_v = tuple(b for b in BLOCK_V if b <= max(16, V))
    out = [
        Gene("engine", "scheduling", ("triton", "torch"), "triton",
             "triton: this project's Triton kernels; torch: the stage functions on eager/compile backends"),
        Gene("block_v", "scheduling", block_v, block_v[0],
             "triton: V columns per recurrence/output program (programs = B*H*ceil(V/block_v))"),
        Gene("num_warps", "scheduling", (4, 8, 2), 4, "triton: warps per program"),
        # sm_90 compiles (Triton 3.9, K=V=128, bf16): the fused recurrence needs 90 KB of shared memory at
        # C=64, block_v=64 with 1 stage, 270 KB with 2 (over the 227 KB a block may have): see the constraint
        Gene("num_stages", "scheduling", (1, 2, 3), 1, "triton: software-pipelining stages of the chunk loops"),
    ]
    if device.kind == "cuda":
        out.append(Gene("cuda_graph", "scheduling", (False, True), False,
                        "capture the whole engine call in a CUDA graph per input shape (static buffers,"
                        " re-captured for a new shape); inputs copied in, outputs copied out unless"
                        " preallocate_outputs"))
    return out


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
    # sm_90 compiles (Triton 3.9, K=V=128, tests/kda_triton_sm90.py): with 2-3 stages every C <= 32 tile
    # fits (at most 213 KB), C=64 does not (238-385 KB); with 1 stage everything fits (at most 224 KB)
    stages, C = values.get("num_stages"), values.get("chunk_size")
    if values.get("engine") == "triton" and isinstance(stages, int) and stages > 1 and isinstance(C, int) and C > 32:
        return (f"num_stages={stages} with chunk_size={C} needs more than the {SHARED_MEMORY_BYTES} bytes of shared"
                " memory a block may have on sm_90; use num_stages=1 or chunk_size in [16, 32]")
    return None


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
    )


def _triton_engine(values: Mapping[str, Scalar]) -> bool:
    return values.get("engine") == "triton"


def _torch_engine(values: Mapping[str, Scalar]) -> bool:
    return values.get("engine") == "torch"
