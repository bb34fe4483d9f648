"""The searched generation engine for a Llama decoder (the generation contract, `evo.workloads.generation`).

Three parts, each blind to the others' insides (vLLM keeps its scheduler, block pool and model runner
apart the same way):
- a KV pool (`SlotPool` or `PagedPool`): rows of positions, one row per admitted request; it writes the
  new keys and values and hands the attention the ones to read;
- the scheduler, shared with every generation engine here (`evo.workloads.generation_core.Scheduler`):
  admits waiting requests (continuous or static batching, at most `max_running`), runs their prefill
  (whole, or a chunk a step), keeps the decoding requests in the pool's first rows (when one ends, the
  last moves into its row) and emits the tokens each request produced (one, or with speculation the draft
  tokens verified and the one after);
- the model runner (`ModelRunner`): the `llama` workload's `LlamaEngine` layers, called once per prefill
  (chunk) and once per step for every decoding request together: B rows at B positions, each rotated at
  its own position, its K/V written at its own position, attending under a per-row mask made by one
  comparison (a single decoding row runs as a one-token chunk, with no mask); or, with decode_step=native, a step
  of up to native_max_rows rows is our C step (`cpu_kernels.LlamaDecodeStep`), the whole forward in one call over
  the same cache. A verify step (speculation)
  is the same with T tokens a row, under a per-row causal mask. Greedy, or each request's seeded sampling
  (`evo.workloads.generation_core.pick_tokens`).

The KV pools and the runner live here, beside each other, because they are this model's; the KV pools
would move to a module of their own as soon as another engine uses them. `BatchedLlamaGenerator` is the
scheduler over them.
"""
from __future__ import annotations

import copy
import math
import warnings
from contextlib import contextmanager
from functools import partial
from typing import Callable, Iterator, Mapping

import torch

from evo.core.genome import Genome
from evo.workloads.base import NO_SOURCES, DeviceInfo
from evo.workloads.generation_core import Pick, Scheduler, SchedulerPolicy, pick_tokens
from evo.workloads.generation_core import cpu_kernels
from evo.workloads.llama import engine as _llama_engine
from evo.workloads.llama.engine import LlamaEngine, interleave_rows
from evo.workloads.llama.int8 import quantise_groups
from evo.workloads.llama.model import inv_freq, layer_weights, lm_head, load_weights
from evo.workloads.llama_serve.genes import ServePlan, gene_space, llama_genome
from evo.workloads.llama_serve.presets import ServePreset

KV = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # _layers' kv(i, k, v)


# ---------------------------------------------------------------------------------------------- KV pools
class SlotPool:
    """Keys and values of `rows` requests x `length` positions, a tensor per layer (K and V), each read as
    [rows, KVH, L, d] (a transposed view for BLHD). Decoding rows are a prefix, so a step reads a view."""

    def __init__(self, layers: int, rows: int, length: int, kv_heads: int, d: int, layout: str, device, dtype) -> None:
        self.bhld = layout == "BHLD"
        shape = (rows, kv_heads, length, d) if self.bhld else (rows, length, kv_heads, d)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]  # zeros: masked stay finite
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.k_read = [self._read(t) for t in self.k]  # [rows, KVH, L, d] views
        self.v_read = [self._read(t) for t in self.v]
        self.k_write = [self._by_position(t) for t in self.k]  # [rows, L, KVH, d] views
        self.v_write = [self._by_position(t) for t in self.v]
        self.row_ids = torch.arange(rows, device=device)

    def _read(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.bhld else t.transpose(1, 2)

    def _by_position(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2) if self.bhld else t

    def reserve(self, row: int, length: int) -> None:
        """Room for positions [0, length) of `row`: a slot always has it."""

    def release(self, row: int) -> None:
        """The row's request ended: nothing to give back (its positions are rewritten before they are read)."""

    def move(self, src: int, dst: int, length: int) -> None:
        """Row src's first `length` positions into row dst (src is then free)."""
        for t in self.k_write + self.v_write:
            t[dst, :length] = t[src, :length]

    def swap(self, a: int, b: int, length: int) -> None:
        for t in self.k_write + self.v_write:
            t[[a, b], :length] = t[[b, a], :length]

    def prefill_kv(self, row: int, pos: int, T: int) -> KV:
        """Writes one request's positions [pos, pos+T); reads its [0, pos+T) as [1, KVH, pos+T, d]."""
        end = pos + T

        def kv(i: int, k: torch.Tensor, v: torch.Tensor):
            self.k_read[i][row, :, pos:end] = k[0]
            self.v_read[i][row, :, pos:end] = v[0]
            return self.k_read[i][row:row + 1, :, :end], self.v_read[i][row:row + 1, :, :end]

        return kv

    def decode_kv(self, n: int, pos: torch.Tensor, S: int) -> KV:
        """Rows [0, n) each write T positions pos[r] (pos [n, T]: T = 1 a decode step, more a verify); they read
        [n, KVH, S, d] views."""
        return self._writer(self.row_ids[:n], pos, lambda t: t[:n, :, :S])

    def rows_kv(self, rows: torch.Tensor, pos: torch.Tensor, S: int) -> KV:
        """As `decode_kv` for any rows [n] (a prefill of several): they read [n, KVH, S, d] copies."""
        return self._writer(rows, pos, lambda t: t[rows, :, :S])

    def _writer(self, rows: torch.Tensor, pos: torch.Tensor, read: Callable[[torch.Tensor], torch.Tensor]) -> KV:
        rows = rows[:, None]

        def kv(i: int, k: torch.Tensor, v: torch.Tensor):  # k, v [n, KVH, T, d]
            # into the layer's own tensor, not a view of it: a compiled step then writes in place. The indexed
            # places are [n, T, KVH, d] in both layouts (BHLD's two index tensors, apart, put their dims first)
            if self.bhld:
                self.k[i][rows, :, pos] = k.transpose(1, 2)
                self.v[i][rows, :, pos] = v.transpose(1, 2)
            else:
                self.k[i][rows, pos] = k.transpose(1, 2)
                self.v[i][rows, pos] = v.transpose(1, 2)
            return read(self.k_read[i]), read(self.v_read[i])

        return kv


class PagedPool:
    """Keys and values in fixed blocks of `block` positions, a tensor per layer [blocks, block, KVH, d]
    (BLHD) or [blocks, KVH, block, d] (BHLD); each row has a block table, takes blocks as it grows and
    frees them when it ends. Attention reads a row's blocks gathered in table order."""

    def __init__(self, layers: int, rows: int, length: int, kv_heads: int, d: int, layout: str, block: int,
                 device, dtype) -> None:
        self.bhld, self.block, self.kv_heads, self.d = layout == "BHLD", block, kv_heads, d
        per_row = math.ceil(length / block)
        blocks = rows * per_row  # room for every row at full length: admission never waits for blocks
        shape = (blocks, kv_heads, block, d) if self.bhld else (blocks, block, kv_heads, d)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.k_write = [t.transpose(1, 2) if self.bhld else t for t in self.k]  # [blocks, block, KVH, d] views
        self.v_write = [t.transpose(1, 2) if self.bhld else t for t in self.v]
        self.table = torch.zeros(rows, per_row, dtype=torch.long, device=device)  # unused entries: block 0 (masked)
        self.owned: list[list[int]] = [[] for _ in range(rows)]
        self.free = list(range(blocks - 1, -1, -1))  # a stack: the lowest block first

    def reserve(self, row: int, length: int) -> None:
        owned = self.owned[row]
        while len(owned) * self.block < length:
            self.table[row, len(owned)] = self.free[-1]
            owned.append(self.free.pop())

    def release(self, row: int) -> None:
        self.free += reversed(self.owned[row])
        self.owned[row] = []

    def move(self, src: int, dst: int, length: int) -> None:
        self.table[dst] = self.table[src]
        self.owned[dst], self.owned[src] = self.owned[src], []

    def swap(self, a: int, b: int, length: int) -> None:
        self.table[[a, b]] = self.table[[b, a]]
        self.owned[a], self.owned[b] = self.owned[b], self.owned[a]

    def _gather(self, t: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """The blocks of table [n, nb] as [n, KVH, nb*block, d]."""
        n, nb = table.shape
        blocks = t.index_select(0, table.reshape(-1))  # [n*nb, block, KVH, d] or [n*nb, KVH, block, d]
        if self.bhld:
            return blocks.view(n, nb, self.kv_heads, self.block, self.d).transpose(1, 2).reshape(
                n, self.kv_heads, nb * self.block, self.d)
        return blocks.view(n, nb * self.block, self.kv_heads, self.d).transpose(1, 2)

    def _where(self, table: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of positions pos [n, T] in the rows of table [n, per_row], each [n, T]."""
        return table.gather(1, pos // self.block), pos % self.block

    def _writer(self, table: torch.Tensor, pos: torch.Tensor, S: int) -> KV:
        """Writes positions pos [n, T] of the rows of table [n, per_row] (their blocks reserved); reads their
        [0, S) as [n, KVH, S, d]."""
        block, offset = self._where(table, pos)
        read = table[:, :math.ceil(S / self.block)]

        def kv(i: int, k: torch.Tensor, v: torch.Tensor):  # k, v [n, KVH, T, d]
            self.k_write[i].index_put_((block, offset), k.transpose(1, 2))
            self.v_write[i].index_put_((block, offset), v.transpose(1, 2))
            return self._gather(self.k[i], read)[:, :, :S], self._gather(self.v[i], read)[:, :, :S]

        return kv

    def prefill_kv(self, row: int, pos: int, T: int) -> KV:
        """Writes one request's positions [pos, pos+T); reads its [0, pos+T) as [1, KVH, pos+T, d]."""
        table = self.table[row:row + 1]
        return self._writer(table, torch.arange(pos, pos + T, device=table.device)[None], pos + T)

    def decode_kv(self, n: int, pos: torch.Tensor, S: int) -> KV:
        """Rows [0, n) each write T positions pos[r] (pos [n, T]); they read [n, KVH, S, d]."""
        return self._writer(self.table[:n], pos, S)

    def rows_kv(self, rows: torch.Tensor, pos: torch.Tensor, S: int) -> KV:
        """As `decode_kv` for any rows [n] (a prefill of several)."""
        return self._writer(self.table[rows], pos, S)


def make_pool(plan: ServePlan, engine: LlamaEngine, max_positions: int) -> SlotPool | PagedPool:
    s = engine.spec
    args = (s.layers, plan.max_running, max_positions, s.kv_heads, s.head_dim, plan.kv_layout)
    if plan.kv_pool == "paged":
        return PagedPool(*args, plan.kv_block, engine.device, engine.kv_dtype)
    return SlotPool(*args, engine.device, engine.kv_dtype)


# ---------------------------------------------------------------------------------------------- the model runner
def grouped_queries(attention: Callable) -> Callable:
    """The attention stage called on one decode position per row with each KV head's G query heads as its query
    axis: q [n, H, 1, d] as [n, KVH, G, d] (a view), so it needs no grouped-query expansion (SDPA on the CPU: 270
    instead of 440 us a layer at 16 rows x 300 keys). The per-row mask broadcasts over that axis alike."""

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, plan) -> torch.Tensor:
        n, H, _, d = q.shape
        KVH = k.shape[1]
        return attention(q.reshape(n, KVH, H // KVH, d), k, v, mask, plan).reshape(n, H, 1, d)

    return call


def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, plan) -> torch.Tensor:
    """A decode step's attention by our C kernel (`cpu_kernels.decode_attention`): q [n, H, 1, d]; k, v the pool's
    [n, KVH, S, d] views; in the mask's place each row's key count [n] (its position + 1), so a row reads its own
    keys only and no mask is built."""
    n, H, _, d = q.shape
    return cpu_kernels.decode_attention(q.view(n, H, d), k, v, lengths, d**-0.5).to(q.dtype).view(n, H, 1, d)


def kernel_norm(x: torch.Tensor, residual, weight: torch.Tensor, eps: float, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm stage's contract (`llama/open_stages/norm.py`) by our C kernel: the add and the norm in one pass."""
    return cpu_kernels.add_rms_norm(x, residual, weight, eps, plan.norm_fused_residual)


def _check_kernel(gene: str, check: Callable, *args, value: str = "kernel", instead: str = "stage") -> None:
    """A clear error at build time where a kernel cannot serve (no compiler, no AVX2, a shape it cannot take)."""
    try:
        check(*args)
    except cpu_kernels.KernelUnavailable as e:
        raise ValueError(f"{gene}={value!r}: {e}; use {gene}={instead}") from None


def native_step(engine: LlamaEngine, pool: SlotPool, tiles: bool = False) -> cpu_kernels.LlamaDecodeStep:
    """decode_step=native: our C step over the engine's weights and the slot pool's caches. Float32 weights the
    engine keeps as [out, in] rows (weight_layout native or native_left, linear_kernel=torch) are read where they
    lie (a fused projection's slices are contiguous rows); otherwise (pretransposed, or a packed linear_kernel,
    whose oneDNN layout is opaque) the checkpoint's are loaded again and kept as [out, in] rows in the step's format:
    bfloat16 rounded to nearest even, as bf16_weights rounds them; int8 in groups as q8_weights quantises them
    (`cpu_kernels.q8_rows`: the values whose dequantised form the engine's other calls multiply). `tiles`
    (native_products=amx): bfloat16 weights as AMX tiles (`cpu_kernels.amx_tiles`)."""
    s, plan = engine.spec, engine.plan
    dtype = {"bf16_weights": torch.bfloat16, "q8_weights": torch.int8}.get(plan.linear_kernel, torch.float32)

    def stored(w: torch.Tensor) -> torch.Tensor:  # a projection [out, in] as the step reads it in `dtype`
        if dtype == torch.int8:
            return cpu_kernels.q8_rows(*quantise_groups(w))
        return cpu_kernels.amx_tiles(w) if tiles else w.to("cpu", dtype).contiguous()

    shape = cpu_kernels.StepShape(s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab,
                                  s.rms_eps)
    _check_kernel("decode_step", cpu_kernels.check_step_supported, shape, dtype, engine.kv_dtype, engine.device,
                  tiles, value="native", instead="eager")
    H, KVH, d, I = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.head_dim, s.intermediate
    norms = [{"input_norm": layer["input_norm"], "post_norm": layer["post_norm"]} for layer in engine.layers]
    if not (engine.packed or engine.quantised or engine.float_layout == "pretransposed"):
        layers = []
        for layer, norm in zip(engine.layers, norms):
            qkv = layer.get("qkv")
            q, k, v = (qkv[:H], qkv[H:H + KVH], qkv[H + KVH:]) if qkv is not None else (layer["q"], layer["k"],
                                                                                          layer["v"])
            mlp = layer["mlp"]
            gate, up = (mlp["gate_up"][:I], mlp["gate_up"][I:]) if "gate_up" in mlp else (mlp["gate"], mlp["up"])
            layers.append({**norm, "q": q, "k": k, "v": v, "o": layer["o"], "gate": gate, "up": up,
                           "down": mlp["down"]})
        head = engine.head
    else:
        weights = load_weights(s)
        layers = []
        for i, norm in enumerate(norms):
            lw = layer_weights(weights, i)
            if engine.interleaved:  # the rows the engine's prefill wrote the cached keys in
                lw["q"], lw["k"] = interleave_rows(lw["q"], s.heads, d), interleave_rows(lw["k"], s.kv_heads, d)
            layers.append({**norm, **{name: stored(lw[name]) for name in ("q", "k", "v", "o", "gate", "up", "down")}})
        head = stored(lm_head(weights))
    return cpu_kernels.LlamaDecodeStep(shape, layers, engine.final_norm, head, inv_freq(s, torch.float64), pool.k,
                                       pool.v, engine.interleaved, pool.bhld, tiles)


class TracedSteps:
    """`step(token, pos)` recorded by torch.jit.trace once per batch size (its first call there) and replayed by
    TorchScript: no Python between the ops. The step must have static shapes for a batch size (the pool's tensors
    it writes are captured by reference, so the recording writes where the step does)."""

    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.step = step
        self.traced: dict[int, Callable] = {}  # batch size -> its recording

    def __call__(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        traced = self.traced.get(len(token))
        if traced is None:
            with warnings.catch_warnings():  # TorchScript is deprecated in torch 2.13; tracing warns of shapes
                warnings.simplefilter("ignore")
                traced = self.traced[len(token)] = torch.jit.trace(self.step, (token, pos), check_trace=False)
        return traced(token, pos)


class ModelRunner:
    """The forwards, blind to requests (the shared scheduler's `evo.workloads.generation_core.ModelRunner`): a
    prompt chunk of one pool row, and one decode step of the pool's first n rows together. Both through
    `engine`'s layers; each token picked by its request (`_pick`)."""

    def __init__(self, engine: LlamaEngine, pool: SlotPool | PagedPool, plan: ServePlan, max_positions: int) -> None:
        self.engine, self.pool, self.max_positions, self.max_rows = engine, pool, max_positions, plan.max_running
        if plan.norm_kernel == "kernel":
            _check_kernel("norm_kernel", cpu_kernels.check_norm_supported, engine.spec.hidden, engine.dtype,
                          engine.device)
            engine.norm = kernel_norm
        self.decoder = copy.copy(engine)  # the same layers and weights, its attention stage called per KV group
        self.decoder.attention = grouped_queries(engine.attention)
        self.kernel = plan.decode_attention == "kernel"
        if self.kernel:
            _check_kernel("decode_attention", cpu_kernels.check_attention_supported, engine.spec.head_dim,
                          engine.kv_dtype, engine.device)
            self.decoder.attention = kernel_attention
        device = engine.device
        self.key_positions = torch.arange(max_positions, device=device)
        self.visible, self.hidden = (torch.tensor(x, dtype=engine.dtype, device=device) for x in (0.0, -math.inf))
        self.compiled = (torch.compile(self._static_step, dynamic=False) if plan.decode_step == "compiled"
                         else TracedSteps(self._static_step) if plan.decode_step == "traced" else None)
        self.native = (native_step(engine, pool, plan.native_products == "amx") if plan.decode_step == "native"
                       else None)
        self.native_max_rows = plan.native_max_rows

    def prefill(self, row: int, tokens: tuple[int, ...], pos: int, pick: Pick | None) -> int | None:
        """Prompt tokens at positions [pos, pos+T) of `row`; with `pick` (they end the prompt), the next token."""
        made = self._chunk(row, tokens, pos, None if pick is None else [pick])
        return made[0] if pick is not None else None

    def _chunk(self, row: int, tokens: tuple[int, ...], pos: int, picks: list[Pick] | None) -> list[int]:
        """Tokens at positions [pos, pos+T) of one row, attending to its keys [0, pos+T) (causal: the attention
        stage's mask=None form); the tokens after the last len(picks) ones (none without `picks`)."""
        engine, T = self.engine, len(tokens)
        x = engine.embed[torch.tensor(tokens, device=engine.device)][None]  # [1, T, D]
        h = engine._layers(x, engine._rotary(pos, T), self.pool.prefill_kv(row, pos, T), None)
        return self._pick(engine._logits(h[0, T - len(picks):]), picks) if picks else []

    def prefill_rows(self, rows: list[int], chunks: list[tuple[int, ...]], positions: list[int],
                     picks: list[Pick | None]) -> list[int | None]:
        """Several rows' prompt chunks in one forward (chunks[i] at positions [positions[i], ...) of rows[i]), padded
        as `verify` pads (`_padded_forward`); per row the next token, or None without its pick."""
        h, T = self._padded_forward(rows, chunks, positions)
        ends = [r for r, pick in enumerate(picks) if pick is not None]
        made: list[int | None] = [None] * len(rows)
        if ends:
            at = torch.tensor([r * T + len(chunks[r]) - 1 for r in ends], device=self.engine.device)
            for r, token_id in zip(ends, self._pick(self.engine._logits(h[at]), [picks[r] for r in ends])):
                made[r] = token_id
        return made

    def decode(self, tokens: list[int], positions: list[int], picks: list[Pick]) -> list[int]:
        """Rows [0, n) each feed tokens[r] at positions[r]; their next tokens, each picked by its request."""
        if self.native is not None and len(tokens) <= self.native_max_rows:
            token = torch.tensor(tokens, device=self.engine.device)
            return self._pick(self.native(self.engine.embed[token], torch.tensor(positions)), picks)
        if self.compiled is None and len(tokens) == 1:  # one row: a one-token chunk, no mask (~10% faster)
            return self._chunk(0, (tokens[0],), positions[0], picks)
        device = self.engine.device
        token, pos = torch.tensor(tokens, device=device), torch.tensor(positions, device=device)
        if self.compiled is not None:
            return self._pick(self._padded_step(token, pos)[:len(tokens)], picks)
        return self._pick(self._eager_step(token, pos, max(positions) + 1), picks)

    def _eager_step(self, token: torch.Tensor, pos: torch.Tensor, S: int) -> torch.Tensor:
        """token, pos [n]: one forward of rows [0, n), attending to keys [0, S); logits [n, V]."""
        engine, pos = self.decoder, pos[:, None]  # [n, 1]: one position a row
        x = engine.embed[token][:, None]  # [n, 1, D]
        mask = pos[:, 0] + 1 if self.kernel else self._row_mask(pos, S)  # the kernel takes each row's key count
        h = engine._layers(x, self._row_rotation(pos), self.pool.decode_kv(len(token), pos, S), mask)
        return engine._logits(h[:, 0])

    def verify(self, fed: list[list[int]], positions: list[int], picks: list[list[Pick]]) -> list[list[int]]:
        """Rows [0, n) each feed fed[r] at positions [positions[r], positions[r] + len(fed[r])) in one forward; per
        row, the token picked after each fed one. One row runs as a chunk (causal, no mask); more as T tokens a
        row (the longest fed), each (row, t) rotated and written at its own position, under a per-row causal mask.

        A shorter row is padded by repeating its last fed token at the positions after its own, clamped to the
        last one. What the pads write is harmless: no real query sees it (the mask shows (r, t) only keys up to
        its own position, and pads sit after the row's real tokens), a position after the ones the row has fed
        is written again by the forward that feeds it before any query can see it, and the last position is
        never fed (a request's last token is not fed back), so nothing reads it. Keys and values of rejected
        draft tokens likewise lie after the row's cached positions, and are rewritten before they are read."""
        if len(fed) == 1:
            return [self._chunk(0, tuple(fed[0]), positions[0], picks[0])]
        h, T = self._padded_forward(None, fed, positions)
        real = torch.tensor([r * T + t for r, tokens in enumerate(fed) for t in range(len(tokens))],
                            device=self.engine.device)
        flat = self._pick(self.engine._logits(h[real]), [pick for row in picks for pick in row])
        starts = [0]
        for tokens in fed:
            starts.append(starts[-1] + len(tokens))
        return [flat[a:b] for a, b in zip(starts, starts[1:])]

    def _padded_forward(self, rows: list[int] | None, fed, positions: list[int]) -> tuple[torch.Tensor, int]:
        """fed[i] at positions [positions[i], ...) of pool row rows[i] (None: rows [0, n), read as views) in one
        forward, as T tokens a row (the longest fed), each (row, t) rotated and written at its own position, under
        a per-row causal mask; a shorter row padded by repeating its last token at the positions after its own,
        clamped to the last (`verify` says why the pads are harmless). The hidden states [n * T, D] (row r's
        token t at r * T + t) and T."""
        engine, device = self.engine, self.engine.device
        n, T, last = len(fed), max(len(tokens) for tokens in fed), self.max_positions - 1
        for row, p in zip(range(n) if rows is None else rows, positions):
            self.pool.reserve(row, min(p + T, last + 1))  # the pads' positions too (a paged row needs their blocks)
        token = torch.tensor([tokens + tokens[-1:] * (T - len(tokens)) for tokens in fed], device=device)  # [n, T]
        pos = torch.tensor([[min(p + t, last) for t in range(T)] for p in positions], device=device)  # [n, T]
        S = min(max(positions) + T, last + 1)
        kv = self.pool.decode_kv(n, pos, S) if rows is None else self.pool.rows_kv(torch.tensor(rows, device=device),
                                                                                   pos, S)
        h = engine._layers(engine.embed[token], self._row_rotation(pos), kv, self._row_mask(pos, S))  # [n, T, D]
        return h.reshape(n * T, -1), T

    def _padded_step(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The compiled static-shape step, its batch padded to the next power of two: pad rows feed token 0 at
        the last position, which no request writes (its last token is never fed back), so they change nothing."""
        n = len(token)
        bucket = min(1 << (n - 1).bit_length(), self.max_rows)
        if bucket > n:
            token = torch.cat([token, token.new_zeros(bucket - n)])
            pos = torch.cat([pos, pos.new_full((bucket - n,), self.max_positions - 1)])
        return self.compiled(token, pos)

    def _static_step(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The eager step over every position of the pool (shapes fixed by the batch alone)."""
        return self._eager_step(token, pos, self.max_positions)

    def _row_rotation(self, pos: torch.Tensor):
        """The rotary factors of rows' tokens at positions pos [n, T], shaped to rotate [n, h, T, d]."""
        n, T = pos.shape
        rot = self.engine._rotary_at(pos.reshape(-1))  # [n*T, d/2]: complex, or (cos, sin)
        return tuple(r.view(n, 1, T, -1) for r in rot) if isinstance(rot, tuple) else rot.view(n, 1, T, -1)

    def _row_mask(self, pos: torch.Tensor, S: int) -> torch.Tensor:
        """Additive mask of rows' tokens at positions pos [n, T] over S keys, by one comparison: 0 up to each
        token's position, -inf after. A decode step (T = 1) against the grouped call's scores (`grouped_queries`):
        [n, 1, 1, S] for SDPA's [n, KVH, G, S], [n, 1, 1, 1, S] for the matmul form's [n, KVH, 1, G, S]; a verify
        against the plain call's: [n, 1, T, S] for SDPA's [n, H, T, S], [n, 1, 1, T, S] for [n, KVH, G, T, S].
        (The attention stage documents a [T, S] mask, which cannot differ per row.)"""
        mask = torch.where(self.key_positions[:S] <= pos[..., None], self.visible, self.hidden)  # [n, T, S]
        return mask[:, None, None] if self.engine.plan.attention == "matmul" else mask[:, None]

    _pick = staticmethod(pick_tokens)


# ---------------------------------------------------------------------------------------------- the generator
@contextmanager
def _inference(sdpa_backend: Callable) -> Iterator[None]:
    """A step's context: no autograd, and the engine's SDPA backend."""
    with torch.inference_mode(), sdpa_backend():
        yield


class BatchedLlamaGenerator(Scheduler):
    """`add`, `step`, `abort` (the generation contract): the shared scheduler over a KV pool and the model runner."""

    def __init__(self, engine: LlamaEngine, plan: ServePlan, max_positions: int) -> None:
        self.plan = plan
        pool = make_pool(plan, engine, max_positions)
        policy = SchedulerPolicy(plan.batching, plan.max_running, plan.prefill, plan.prefill_chunk,
                                 plan.max_prefills_per_step, plan.drafted, plan.spec_min_ngram, plan.spec_max_rows,
                                 plan.prefill_rows == "together")
        super().__init__(ModelRunner(engine, pool, plan, max_positions), pool, policy, max_positions,
                         engine.num_threads, partial(_inference, engine._sdpa_backend))


def build(genome: Genome, preset: ServePreset, device: DeviceInfo,
          sources: Mapping[str, str] = NO_SOURCES) -> BatchedLlamaGenerator:
    """Validate `genome` (GenomeError propagates), load the model's layers (the `llama` engine built from the
    genes the two spaces share, code genes' `sources` included) and compose the generator."""
    genome = gene_space(preset, device).validate(genome)
    engine = _llama_engine.build(llama_genome(genome, preset, device), preset, device, preset.max_positions, sources,
                                 native_step=True)
    return BatchedLlamaGenerator(engine, ServePlan.from_genome(genome), preset.max_positions)
