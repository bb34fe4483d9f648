"""How a step reads the weights: the gene `linear_kernel`, a projection's weight prepacked once at load for a
CPU kernel that streams it once for all the rows of a call.

torch's plain float32 matmul (`F.linear`, `x @ W`) reads a [576, 49152] weight ~4x slower at 4 rows than at
one on this CPU (9.4 / 17.1 / 18.7 ms at 1 / 4 / 16 rows, 2 threads): its small-M path re-reads the weight.
The kernels here pack the weight for the CPU's vector units once and run every row against each packed tile
(measured here, 2 threads, that shape: 3.7 / 3.8 / 6.3 ms packed float32; 1.0 / 1.8 / 5.4 ms float16
weights; 0.3 / 0.6 / 2.8 ms int8, with the weight L3-resident):
- `packed`: oneDNN's float32 inner product over a weight reordered to its blocked layout (lossless);
- `fp16_weights`: fbgemm's float16 weights, float32 activations and accumulation (half the bytes; lossy:
  ~2e-4 relative error of the product);
- `bf16_weights`: oneDNN's bfloat16 inner product over a weight reordered to its blocked layout, the call's rows
  rounded to bfloat16 and its product returned in bfloat16, widened to float32 (half the bytes; lossy: ~3e-3
  relative error of the product, measured on Gaussian rows and weights). Where the CPU has AMX or AVX-512 BF16 (oneDNN's `_is_mkldnn_bf16_supported`)
  its tiles make 16 rows cost what one does: SmolLM2-135M's projections and LM head at 1 / 16 / 32 rows, one
  thread, 28.5 / 31.1 / 37.0 ms against packed float32's 46.6 / 73.5 / 99.2 (Intel Xeon with AMX); without them
  (AVX2 only: torch 2.13's oneDNN refuses a bfloat16 weight there) the same rounding runs on the packed float32
  kernel, and the search will find it no faster;
- `int8_dynamic`: fbgemm's int8 weights, one scale per output channel (absmax / 127), activations quantised
  to 7 bits (`reduce_range`) per call over the call's whole [M, in] (so a row's rounding depends on the batch's
  range), int32 accumulation (a quarter of the bytes; lossy: ~1e-2 relative error of the product);
- `q8_weights`: int8 weights with one float32 scale per 32 inputs (`int8.quantise_groups`, llama.cpp's Q8_0 block).
  Our C decode step reads them as int8 (`cpu_kernels.llama_decode_step`, ~1.1 bytes a weight); here, for the rest of
  the engine's calls (prefill, steps the C step leaves), their dequantised values as `bf16_weights` multiplies
  weights where the CPU multiplies bfloat16 natively (rounded to bfloat16 once more, the rows too: a prefill is
  bound by arithmetic, where AMX's tiles are several times float32's speed), else as `packed`. A generation
  engine's kernel only (`NATIVE_STEP_KERNELS`: it pays off only through the C step).
Each `PackedLinear` is called as W(x): x [..., in] float32 -> [..., out] float32. CPU only. With `one_row` it also
keeps the weight as torch's [in, out] and multiplies a single row by `x @ W` there (the gene `one_row_weights`):
at one row and one thread oneDNN's packed float32 read a weight streamed from memory at 13 GB/s against torch's
17, so a one-row step gains what twice the weights' memory costs.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from evo.workloads.llama.int8 import dequantised_groups, quantise_groups, quantise_rows

KERNELS = ("torch", "packed", "fp16_weights", "bf16_weights", "int8_dynamic")  # torch: the weight_layout / weight_quant path
LOSSY = ("fp16_weights", "bf16_weights", "int8_dynamic", "q8_weights")
NATIVE_STEP_KERNELS = ("q8_weights",)  # kernels whose speed is our C decode step's: a generation engine's genes only
PACK_ROWS_HINT = 16  # oneDNN reorders for a batch-size hint; any row count runs (16 beat 1 at 4-32 rows, tied at 1)


def _packed(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _bf16(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), PACK_ROWS_HINT)
    except RuntimeError:  # "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"
        return _bf16_emulated(w)
    return lambda x: torch.ops.mkldnn._linear_pointwise(
        x.to(torch.bfloat16), packed, None, "none", [], "").to(torch.float32)


def _bf16_emulated(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """`_bf16`'s rounding where oneDNN cannot multiply bfloat16 (torch 2.13 refuses to reorder a bfloat16 weight
    without AVX-512 or AVX-NE-CONVERT): the weight and the rows rounded to bfloat16, multiplied by the packed
    float32 kernel (float32 sums, as oneDNN's), the product rounded to bfloat16. The same loss, no speed."""
    run = _packed(w.to(torch.bfloat16).to(torch.float32))
    return lambda x: run(x.to(torch.bfloat16).to(torch.float32)).to(torch.bfloat16).to(torch.float32)


def _fp16(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = torch.ops.quantized.linear_prepack_fp16(w, None)
    return lambda x: torch.ops.quantized.linear_dynamic_fp16(x, packed)


def _int8(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    q, scale = quantise_rows(w)
    with warnings.catch_warnings():  # torch 2.13 warns that quantized tensors are deprecated; fbgemm takes one
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros(len(q), dtype=torch.long), 0)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    # reduce_range: activations on 7 bits, as torch's x86 default; at 8 bits fbgemm's AVX2 path (vpmaddubsw, no VNNI)
    # saturates its int16 pair sums (measured on an AMD EPYC: 8.4e-2 relative error of a one-row product against
    # 1.4e-2 with it)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)


def _q8(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    held = dequantised_groups(*quantise_groups(w))
    return _bf16(held) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else _packed(held)


def cpu_kernel_order() -> tuple[str, ...]:
    """KERNELS in the order this CPU favours: bf16_weights before fp16_weights where it multiplies bfloat16
    natively (AMX or AVX-512 BF16; SmolLM2-135M's projections and LM head, one thread, Intel Xeon with AMX: 32-37
    against fp16_weights' 40-51 ms at one row, 37-43 against 89-118 ms at 16), fp16 first elsewhere (on AVX2
    oneDNN emulates bfloat16). Only the order differs; a sweep over the values (the `levers` agent's) follows it."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return KERNELS
    rest = [k for k in KERNELS if k != "bf16_weights"]
    rest.insert(rest.index("fp16_weights"), "bf16_weights")
    return tuple(rest)


PACKERS = {"packed": _packed, "fp16_weights": _fp16, "bf16_weights": _bf16, "int8_dynamic": _int8, "q8_weights": _q8}


@dataclass(frozen=True, eq=False)
class PackedLinear:
    """A projection [out, in] packed for `kernel`; W(x): x [..., in] -> [..., out] (float32)."""

    kernel: str
    out_features: int
    run: Callable[[torch.Tensor], torch.Tensor]
    one_row: torch.Tensor | None = None  # [in, out]: torch's x @ W for a single row

    @classmethod
    def of(cls, w: torch.Tensor, kernel: str, one_row: bool = False) -> PackedLinear:
        if kernel not in PACKERS:
            raise ValueError(f"linear_kernel {kernel!r} packs no weight; packed kernels: {sorted(PACKERS)}")
        w = w.detach().to("cpu", torch.float32).contiguous()
        return cls(kernel, w.shape[0], PACKERS[kernel](w), w.t().contiguous() if one_row else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.one_row is not None and rows.shape[0] == 1:
            return torch.mm(rows, self.one_row).view(*x.shape[:-1], self.out_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        return self.run(rows).view(*x.shape[:-1], self.out_features)
