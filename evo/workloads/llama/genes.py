"""The Llama engine's gene space and the plan an engine is built from.

Fusion: packed projections (QKV, gate-up), RMSNorm fused with the residual add, rotary by table or on
the fly, on interleaved pairs (one complex multiply) or Llama's halves, attention by
scaled_dot_product_attention (each backend on CUDA) or an explicit matmul form.
Scheduling: prefill whole or in chunks, the decode step eager, torch.compile'd or (CUDA) a CUDA graph,
threads. Memory: the KV cache's layout, allocation and dtype; the weights' dtype, layout and int8 quantisation
(bfloat16 at a float32 preset, and int8, are lossy values: `Gene.lossy`), and the CPU kernel the projections
run on (`linear_kernels`: packed float32, float16 or int8 weights). The open
stages (attention, mlp, norm) are code genes (`open_code`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from evo.core.genome import Constraint, Gene, GeneSpace, Genome, Ignored, Scalar
from evo.workloads.base import DeviceInfo, Preset
from evo.workloads.llama import open_code as _open_code
from evo.workloads.llama.linear_kernels import LOSSY as LOSSY_KERNELS, NATIVE_STEP_KERNELS, cpu_kernel_order

CPU_THREADS = (1, 2, 4, 8, 16)
PREFILL_CHUNKS = (16, 32, 64, 128)
SDPA_BACKENDS = ("default", "math", "flash", "efficient", "cudnn")  # on CUDA; "default": torch picks


def _fusion_genes(device: DeviceInfo) -> list[Gene]:
    genes = [
        Gene("fused_qkv", "fusion", (True, False), True, "one packed QKV projection (else three matmuls)"),
        Gene("fused_gate_up", "fusion", (True, False), True, "one packed gate-up projection (else two matmuls)"),
        Gene("norm_fused_residual", "fusion", (True, False), True,
             "add the residual in place inside the norm stage (else a separate add and a new tensor)"),
        Gene("rotary", "fusion", ("table", "on_the_fly"), "table",
             "table: cos/sin precomputed for every verified position; on_the_fly: computed per call from the positions"),
        Gene("rotary_pairs", "fusion", ("interleaved", "halves"), "interleaved",
             "interleaved: q and k projection rows reordered at load so each rotary pair sits side by side, rotated "
             "by one complex multiply (scores unchanged); halves: Llama's (i, i + d/2) pairs, rotated by slices and a cat"),
        Gene("attention", "fusion", ("sdpa", "matmul"), "sdpa",
             "scaled_dot_product_attention, or the explicit grouped matmul-softmax-matmul form"),
    ]
    if device.kind == "cuda":
        genes.append(Gene("sdpa_backend", "fusion", SDPA_BACKENDS, "default",
                          "the SDPA kernel on CUDA (default: torch's choice); ignored with attention=matmul"))
    return genes


def _scheduling_genes(device: DeviceInfo) -> list[Gene]:
    threads = tuple(t for t in CPU_THREADS if t <= max(1, device.threads)) if device.kind == "cpu" else (1,)
    steps = ("eager", "compiled", "cuda_graph") if device.kind == "cuda" else ("eager", "compiled")
    return [
        Gene("prefill", "scheduling", ("whole", "chunked"), "whole", "the prompt in one forward, or in chunks"),
        Gene("prefill_chunk", "scheduling", PREFILL_CHUNKS, 32, "tokens per prefill chunk (prefill=chunked)"),
        Gene("decode_step", "scheduling", steps, "eager",
             "one decode step as eager torch, torch.compile'd (static shapes over the preallocated cache; builds "
             "take seconds to minutes) or captured once per shape in a CUDA graph (CUDA only)"),
        Gene("threads", "scheduling", threads, threads[-1] if device.kind == "cpu" else 1,
             "CPU threads the evaluator sets around calls"),
    ]


def _memory_genes(preset: Preset) -> list[Gene]:
    # at a float32 preset bfloat16 weights or KV trade precision (lossy: budget mode only); at a bfloat16 preset
    # bfloat16 is the model's own dtype and float32 the wider choice
    if preset.dtype == "bfloat16":
        dtypes, lossy = ("bfloat16", "float32"), ()
    else:
        dtypes, lossy = ("float32", "bfloat16"), ("bfloat16",)
    return [
        Gene("kv_layout", "memory", ("BHLD", "BLHD"), "BHLD", "KV cache as [B, H, L, d] or [B, L, H, d]"),
        Gene("kv_alloc", "memory", ("preallocated", "grown"), "preallocated",
             "the cache allocated once for P+N positions, or grown by concatenation each step"),
        Gene("kv_dtype", "memory", dtypes, dtypes[0], "dtype of the KV cache", lossy),
        Gene("weight_dtype", "memory", dtypes, dtypes[0], "dtype of the weights and activations", lossy),
        Gene("weight_layout", "memory", ("pretransposed", "native", "native_left"), "pretransposed",
             "weights stored [in, out] for x @ W; or as in the checkpoint [out, in], for F.linear (native) or "
             "multiplied from the left, (W @ x^T)^T (native_left: BLAS's kernel over the weight's rows)"),
        Gene("weight_quant", "memory", ("none", "int8"), "none",
             "int8: the decoder's projections (q, k, v, o, gate, up, down; packed ones as packed) held as int8 rows "
             "with one scale per output row (absmax/127, round to nearest), multiplied by an int8 weight-only "
             "kernel, activations in weight_dtype; the LM head (tied to the embedding in some models) and the "
             "embedding stay in weight_dtype, pretransposed (weight_layout is not read)", ("int8",)),
    ]


def kernel_genes(device: DeviceInfo, native_step: bool = False) -> list[Gene]:
    """How the projections and the LM head read their weights (`linear_kernels`): CPU kernels over weights
    packed once at load; elsewhere torch's matmul only. `native_step`: also the kernels only our C decode step
    reads fast (a generation engine's)."""
    if device.kind == "cpu":
        kernels = cpu_kernel_order() + (NATIVE_STEP_KERNELS if native_step else ())
    else:
        kernels = ("torch",)
    return [Gene("linear_kernel", "memory", kernels, "torch",
                 "torch: the projections and LM head by torch's matmul in weight_layout (int8 rows by weight_quant); "
                 "packed: weights reordered once for oneDNN's float32 kernel, which streams each weight once for "
                 "all rows of a step; fp16_weights: fbgemm float16 weights, float32 activations (half the bytes); "
                 "bf16_weights: oneDNN bfloat16 weights, each projection's rows rounded to bfloat16 (half the "
                 "bytes; on AMX or AVX-512 BF16 16 rows cost about what one does); "
                 "int8_dynamic: fbgemm int8 weights per output channel, activations quantised per call (a quarter "
                 "of the bytes); q8_weights (generation engines): int8 weights with a float32 scale per 32 inputs "
                 "(llama.cpp's Q8_0 block), read as int8 by our C decode step (decode_step=native), their "
                 "dequantised values elsewhere (prefill) as bf16_weights reads weights where bfloat16 is native, "
                 "else as packed. Non-torch kernels take float32 weights (weight_dtype=float32, "
                 "weight_quant=none)",
                 tuple(k for k in kernels if k in LOSSY_KERNELS)),
            Gene("one_row_weights", "memory", (False, True), False,
                 "with a packed linear_kernel, also keep every projection and the LM head as torch's [in, out] and "
                 "multiply a single row there (a one-row decode step reads that copy: torch's one-row product "
                 "streams weights faster than the packed kernels; twice the weights' memory)")]


def _packed_kernel_needs_float32(values: Mapping[str, Scalar]) -> str | None:
    kernel = values.get("linear_kernel", "torch")
    if kernel != "torch" and (values.get("weight_dtype") != "float32" or values.get("weight_quant") != "none"):
        return (f"linear_kernel={kernel!r} packs float32 weights itself; it needs weight_dtype='float32' and "
                f"weight_quant='none' (got {values.get('weight_dtype')!r}, {values.get('weight_quant')!r}); "
                f"set linear_kernel=torch to use those")
    return None


# packed kernels store their weights one way
PACKED_IGNORES_LAYOUT = Ignored(("weight_layout",), lambda v: v.get("linear_kernel", "torch") != "torch",
                                "a packed linear_kernel stores its weights one way")
TORCH_KERNEL_HAS_ONE_WAY = Ignored(("one_row_weights",), lambda v: v.get("linear_kernel", "torch") == "torch",
                                   "linear_kernel=torch multiplies every row count the same way")


def _static_step_needs_preallocated_cache(values: Mapping[str, Scalar]) -> str | None:
    step = values.get("decode_step")
    if step in ("compiled", "cuda_graph") and values.get("kv_alloc") != "preallocated":
        return (f"decode_step={step!r} runs one static-shape step over the whole cache, which needs "
                f"kv_alloc='preallocated' (got {values.get('kv_alloc')!r}); set kv_alloc=preallocated or "
                f"decode_step=eager")
    return None


def _kv_no_wider_than_weights(values: Mapping[str, Scalar]) -> str | None:
    if values.get("kv_dtype") == "float32" and values.get("weight_dtype") == "bfloat16":
        return ("kv_dtype='float32' with weight_dtype='bfloat16' keeps bfloat16 keys in float32 (no accuracy, twice "
                "the bytes); set kv_dtype=bfloat16 or weight_dtype=float32")
    return None


# int8 rows are [out, in] for their own kernel; the float LM head is then kept pretransposed
INT8_IGNORES_LAYOUT = Ignored(("weight_layout",), lambda v: v.get("weight_quant") == "int8",
                              "weight_quant=int8 stores and multiplies its weights one way")


def gene_space(preset: Preset, device: DeviceInfo, native_step: bool = False) -> GeneSpace:
    """Genes legal for `preset` on `device` (names are a contract with operators and configs); `native_step`: as
    a generation engine's layers, with the kernels only its C decode step reads (`kernel_genes`)."""
    genes = _fusion_genes(device) + _scheduling_genes(device) + _memory_genes(preset) + kernel_genes(device, native_step)
    constraints = (
        Constraint("decode_step compiled or cuda_graph needs kv_alloc preallocated",
                   _static_step_needs_preallocated_cache),
        Constraint("kv_dtype no wider than weight_dtype", _kv_no_wider_than_weights),
        Constraint("a packed linear_kernel needs float32 weights", _packed_kernel_needs_float32),
    )
    ignored = [Ignored(("prefill_chunk",), lambda v: v.get("prefill") == "whole", "prefill=whole has no chunks"),
               INT8_IGNORES_LAYOUT, PACKED_IGNORES_LAYOUT, TORCH_KERNEL_HAS_ONE_WAY]
    if device.kind == "cuda":
        ignored.append(Ignored(("sdpa_backend",), lambda v: v.get("attention") == "matmul",
                               "attention=matmul calls no SDPA kernel"))
    return GeneSpace("llama", tuple(genes), constraints, _open_code.code_genes(preset, device), tuple(ignored))


@dataclass(frozen=True)
class Plan:
    """A validated genome as typed fields: what the engine and its stages read."""

    fused_qkv: bool
    fused_gate_up: bool
    norm_fused_residual: bool
    rotary: str
    rotary_pairs: str
    attention: str
    sdpa_backend: str
    prefill: str
    prefill_chunk: int
    decode_step: str
    threads: int
    kv_layout: str
    kv_alloc: str
    kv_dtype: str
    weight_dtype: str
    weight_layout: str
    weight_quant: str
    linear_kernel: str = "torch"
    one_row_weights: bool = False

    @classmethod
    def from_genome(cls, genome: Genome) -> Plan:
        v = genome.values()
        return cls(
            fused_qkv=bool(v["fused_qkv"]), fused_gate_up=bool(v["fused_gate_up"]),
            norm_fused_residual=bool(v["norm_fused_residual"]), rotary=str(v["rotary"]),
            rotary_pairs=str(v["rotary_pairs"]),
            attention=str(v["attention"]), sdpa_backend=str(v.get("sdpa_backend", "default")),
            prefill=str(v["prefill"]), prefill_chunk=int(v["prefill_chunk"]), decode_step=str(v["decode_step"]),
            threads=int(v["threads"]), kv_layout=str(v["kv_layout"]), kv_alloc=str(v["kv_alloc"]),
            kv_dtype=str(v["kv_dtype"]), weight_dtype=str(v["weight_dtype"]), weight_layout=str(v["weight_layout"]),
            weight_quant=str(v["weight_quant"]), linear_kernel=str(v.get("linear_kernel", "torch")),
            one_row_weights=bool(v.get("one_row_weights", False)))
