"""A Llama-family decoder's whole decode step in C (`llama_decode_step.c`) over weights and a KV cache held as torch
tensors: `LlamaDecodeStep(...)(embedded [n, D], pos [n]) -> logits [n, V]`, no Python between the step's ops."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from evo.workloads.generation_core.cpu_kernels.build import (FLOAT, INT, PTR, KernelUnavailable, kernel_function,
                                                             kernel_library, require_cpu)

LAYER_WEIGHTS = ("input_norm", "post_norm", "q", "k", "v", "o", "gate", "up", "down")  # the C side's P_ order
# the C side's W_ formats, by the projections' dtype: float32, bfloat16, int8 in groups (`q8_rows`)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
CACHE_DTYPES = (torch.float32, torch.bfloat16)
Q8_GROUP = 32  # the C side's Q8_GROUP: inputs per scale of an int8 weight
AMX_FORMAT = 3  # the C side's W_AMX: bfloat16 weights as AMX tiles (`amx_tiles`)
AMX_SLICE, AMX_OUTPUTS = 32, 16  # a tile's inputs (16 pairs) and outputs
STEP_DIMS = 16  # the C side's DIM_COUNT: the shape, three flags, the k and v caches' strides (`LlamaDecodeStep.dims`)


@functools.cache
def _kernel():
    lib = kernel_library("llama_decode_step")
    lib.evo_llama_step_dims.restype = lib.evo_llama_step_pointers_per_layer.restype = INT
    if lib.evo_llama_step_pointers_per_layer() != len(LAYER_WEIGHTS) + 2 or lib.evo_llama_step_dims() != STEP_DIMS:
        raise KernelUnavailable("llama_decode_step.c and its wrapper disagree on a layer's pointers or the dims")
    return kernel_function("llama_decode_step", "evo_llama_decode_step", INT, (PTR, PTR, FLOAT, PTR, PTR, INT, PTR))


@functools.cache
def amx_bf16_available() -> bool:
    """Whether this process can multiply on AMX-BF16 tiles: the CPU has them, the OS keeps their state and grants
    this process their use (asked once, by the C side), and our compiler built them."""
    try:
        lib = kernel_library("llama_decode_step")
    except KernelUnavailable:
        return False
    lib.evo_amx_bf16_ready.restype = INT
    return bool(lib.evo_amx_bf16_ready())


def amx_tiles(w: torch.Tensor) -> torch.Tensor:
    """A weight [out, in] as the step's AMX tiles read it, bfloat16 (rounded to nearest even) [out, in32] (in rounded
    up to 32, zeros after): per group of 64 outputs (the last group: the rest, a multiple of 16), per 32-input slice,
    one tile per 16 outputs, a tile's rows the 16 input pairs and each row, per output, its pair (VNNI order)."""
    out, inputs = w.shape
    if out % AMX_OUTPUTS:
        raise ValueError(f"amx_tiles: outputs must be a multiple of {AMX_OUTPUTS}, got a weight {tuple(w.shape)}")
    padded = torch.nn.functional.pad(w.to("cpu", torch.bfloat16), (0, -inputs % AMX_SLICE))
    slices = padded.shape[1] // AMX_SLICE
    groups = []
    for start in range(0, out, 4 * AMX_OUTPUTS):
        part = padded[start:start + 4 * AMX_OUTPUTS]
        tiles = part.shape[0] // AMX_OUTPUTS  # [tile, output, slice, pair, 2] -> [slice, tile, pair, output, 2]
        groups.append(part.reshape(tiles, AMX_OUTPUTS, slices, AMX_SLICE // 2, 2).permute(2, 0, 3, 1, 4).reshape(-1))
    return torch.cat(groups).view(out, -1)


def q8_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An int8 weight as the step reads it: q int8 [out, in] and scale float32 [out, groups] (`llama.int8.
    quantise_groups`: a scale per Q8_GROUP inputs, the last group shorter) -> int8 [out, in16 + 4 x groups], each row
    its `in` weights, zeros up to in16 (`in` rounded up to 16: the step reads 16 a load), then its scales' bytes."""
    out, inputs = q.shape
    if q.dtype != torch.int8 or scale.dtype != torch.float32 or tuple(scale.shape) != (out, -(-inputs // Q8_GROUP)):
        raise ValueError(f"q8_rows: q int8 [out, in] and scale float32 [out, ceil(in / {Q8_GROUP})]; got "
                         f"{tuple(q.shape)} {q.dtype} and {tuple(scale.shape)} {scale.dtype}")
    padding = torch.zeros(out, -inputs % 16, dtype=torch.int8)
    return torch.cat([q, padding, scale.contiguous().view(torch.int8)], 1).contiguous()


def _stored(shape: tuple[int, int], dtype: torch.dtype, tiles: bool = False) -> tuple[int, int]:
    """A projection [out, in]'s tensor shape as the step holds it in `dtype` (int8: `q8_rows`; tiles: `amx_tiles`)."""
    out, inputs = shape
    if tiles:
        return out, -(-inputs // AMX_SLICE) * AMX_SLICE
    return (out, -(-inputs // 16) * 16 + 4 * -(-inputs // Q8_GROUP)) if dtype == torch.int8 else shape


@dataclass(frozen=True)
class StepShape:
    """The decoder's shape as the step needs it."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rms_eps: float


def check_step_supported(shape: StepShape, weight_dtype: torch.dtype, kv_dtype: torch.dtype,
                         device: torch.device | str, tiles: bool = False) -> None:
    """Raises KernelUnavailable (what is wrong, what is allowed) unless the step can run this decoder (with `tiles`:
    bfloat16 weights on AMX tiles); builds it."""
    require_cpu(device, "decode step")
    if tiles:
        outputs = {name: size for name, size in (("hidden", shape.hidden), ("intermediate", shape.intermediate),
                                                 ("heads x head_dim", shape.heads * shape.head_dim),
                                                 ("kv_heads x head_dim", shape.kv_heads * shape.head_dim),
                                                 ("vocab", shape.vocab)) if size % AMX_OUTPUTS}
        if weight_dtype != torch.bfloat16 or outputs:
            raise KernelUnavailable(f"the decode step's AMX tiles take bfloat16 weights whose outputs are multiples of "
                                    f"{AMX_OUTPUTS}; got {weight_dtype} weights, sizes {outputs}")
        if not amx_bf16_available():
            raise KernelUnavailable("this CPU (or this OS, or our C compiler) cannot run AMX-BF16 tiles")
    odd = {name: size for name, size in (("hidden", shape.hidden), ("intermediate", shape.intermediate),
                                         ("head_dim", shape.head_dim)) if size % 8}
    wide = {name: size for name, size in (("hidden", shape.hidden), ("intermediate", shape.intermediate),
                                          ("heads x head_dim", shape.heads * shape.head_dim)) if size % 16}
    if odd:
        raise KernelUnavailable(f"the decode step kernel needs sizes that are multiples of 8, got {odd}")
    if weight_dtype == torch.bfloat16 and wide:
        raise KernelUnavailable(f"the decode step kernel reads bfloat16 weights 16 at a time: it needs input sizes "
                                f"that are multiples of 16, got {wide}")
    if shape.heads % shape.kv_heads or shape.heads // shape.kv_heads > 16:
        raise KernelUnavailable(f"the decode step kernel needs heads a multiple of kv_heads by at most 16, got "
                                f"{shape.heads} and {shape.kv_heads}")
    if weight_dtype not in WEIGHT_DTYPES or kv_dtype not in CACHE_DTYPES:
        raise KernelUnavailable(f"the decode step kernel reads float32, bfloat16 or int8 (grouped) weights and a "
                                f"float32 or bfloat16 cache, not {weight_dtype} weights and a {kv_dtype} cache")
    _kernel()


class LlamaDecodeStep:
    """The step over `layers` (per layer the LAYER_WEIGHTS: norms float32 [D], projections [out, in] contiguous in
    one of WEIGHT_DTYPES, int8 ones as `q8_rows`, with `tiles` bfloat16 ones as `amx_tiles`), the final norm, the
    head [V, D], the rotary inverse frequencies (float64 [d/2]) and the pool's per-layer caches k[i], v[i] ([rows, L,
    KVH, d] or [rows, KVH, L, d], d contiguous; written in place). It keeps every tensor it points at alive."""

    def __init__(self, shape: StepShape, layers: list[dict[str, torch.Tensor]], final_norm: torch.Tensor,
                 head: torch.Tensor, inv_freq: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor],
                 interleaved: bool, bhld: bool, tiles: bool = False) -> None:
        s = shape
        wdtype = head.dtype
        projections = [layer[name] for layer in layers for name in LAYER_WEIGHTS[2:]] + [head]
        norms = [layer[name] for layer in layers for name in LAYER_WEIGHTS[:2]] + [final_norm]
        expect = {"q": (s.heads * s.head_dim, s.hidden), "k": (s.kv_heads * s.head_dim, s.hidden),
                  "v": (s.kv_heads * s.head_dim, s.hidden), "o": (s.hidden, s.heads * s.head_dim),
                  "gate": (s.intermediate, s.hidden), "up": (s.intermediate, s.hidden),
                  "down": (s.hidden, s.intermediate), "input_norm": (s.hidden,), "post_norm": (s.hidden,)}
        wrong = [f"layer {i} {name} {tuple(layer[name].shape)} {layer[name].dtype}" for i, layer in enumerate(layers)
                 for name, want in expect.items()
                 if tuple(layer[name].shape) != (want if "norm" in name else _stored(want, wdtype, tiles))
                 or not layer[name].is_contiguous() or layer[name].dtype != (torch.float32 if "norm" in name else wdtype)]
        if len(layers) != s.layers or wrong or tuple(head.shape) != _stored((s.vocab, s.hidden), wdtype, tiles) \
                or wdtype not in WEIGHT_DTYPES or (tiles and wdtype != torch.bfloat16) \
                or any(not t.is_contiguous() for t in projections + norms) or final_norm.dtype != torch.float32:
            raise ValueError(f"LlamaDecodeStep: {s.layers} layers of {expect} (projections contiguous, one of "
                             f"{WEIGHT_DTYPES}, int8 as q8_rows, tiles as amx_tiles, norms float32) and a head "
                             f"{(s.vocab, s.hidden)}; wrong: "
                             f"{wrong[:4] or [f'head {tuple(head.shape)} {wdtype}']}")
        caches = k + v
        kv_dtype = k[0].dtype
        if any(t.dtype != kv_dtype or t.stride() != k[0].stride() or t.stride(-1) != 1 for t in caches):
            raise ValueError("LlamaDecodeStep: every layer's k and v cache needs one dtype and one layout, d contiguous")
        row, a, b = k[0].stride(0), k[0].stride(1), k[0].stride(2)
        head_stride, pos_stride = (a, b) if bhld else (b, a)
        self.shape, self.rows, self.max_positions = s, k[0].shape[0], k[0].shape[2 if bhld else 1]
        self.inv_freq = inv_freq.to("cpu", torch.float64).contiguous()
        weight_format = AMX_FORMAT if tiles else WEIGHT_DTYPES.index(wdtype)
        self.dims = torch.tensor([s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab,
                                  int(interleaved), weight_format, int(kv_dtype == torch.bfloat16),
                                  row, head_stride, pos_stride, row, head_stride, pos_stride], dtype=torch.int64)
        pointers = [t.data_ptr() for i in range(s.layers) for t in
                    [layers[i][name] for name in LAYER_WEIGHTS] + [k[i], v[i]]]
        self.pointers = torch.tensor(pointers + [final_norm.data_ptr(), head.data_ptr(), self.inv_freq.data_ptr()],
                                     dtype=torch.int64)
        if tiles and not amx_bf16_available():
            raise KernelUnavailable("LlamaDecodeStep: this process cannot run AMX-BF16 tiles")
        self._alive = (layers, final_norm, head, caches)
        self._call = _kernel()

    def __call__(self, embedded: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """embedded [n, D] float32 (row r's token), pos [n] int64 (its position; row r of the cache): the logits
        [n, V] float32; each row's key and value written at its position."""
        n = embedded.shape[0]
        pos = pos.to(torch.int64).contiguous()
        if embedded.shape != (n, self.shape.hidden) or embedded.dtype != torch.float32 or pos.shape != (n,) or \
                not 0 < n <= self.rows or (n and not 0 <= int(pos.min()) <= int(pos.max()) < self.max_positions):
            raise ValueError(f"LlamaDecodeStep: embedded [n, {self.shape.hidden}] float32 and pos [n] with n in [1, "
                             f"{self.rows}], each position in [0, {self.max_positions}); got {tuple(embedded.shape)} "
                             f"{embedded.dtype}, positions {pos.tolist()}")
        embedded = embedded.contiguous()
        logits = torch.empty(n, self.shape.vocab, dtype=torch.float32)
        rc = self._call(self.dims.data_ptr(), self.pointers.data_ptr(), self.shape.rms_eps, embedded.data_ptr(),
                        pos.data_ptr(), n, logits.data_ptr())
        if rc != 0:
            raise MemoryError("llama_decode_step: the kernel could not allocate its scratch" if rc == -1 else
                              f"llama_decode_step: the kernel refused the step (code {rc})")
        return logits


__all__ = ["LAYER_WEIGHTS", "LlamaDecodeStep", "StepShape", "amx_bf16_available", "amx_tiles", "check_step_supported",
           "q8_rows"]
