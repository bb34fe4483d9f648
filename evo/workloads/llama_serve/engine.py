"""The searched generation engine for a Llama decoder (the generation contract, `evo.workloads.generation`).

Three parts, each blind to the others' insides (vLLM keeps its scheduler, block pool and model runner
apart the same way):
- a KV pool (`SlotPool` or `PagedPool`): rows of positions, one row per admitted request; it writes the
  new keys and values and hands the attention the ones to read;
- the scheduler (`BatchedLlamaGenerator.step`): admits waiting requests (continuous or static batching,
  at most `max_running`), runs their prefill (whole, or a chunk a step), keeps the decoding requests in
  the pool's first rows (when one ends, the last moves into its row) and emits one token per request
  that produced one;
- the model runner (`ModelRunner`): the `llama` workload's `LlamaEngine` layers, called once per prefill
  (chunk) and once per step for every decoding request together: B rows at B positions, each rotated at
  its own position, its K/V written at its own position, attending under a per-row mask made by one
  comparison (a single decoding row runs as a one-token chunk, with no mask). Greedy, or each request's
  seeded sampling (`evo.workloads.sampling`).

Three parts in one module because this module is the engine; each is one class with one job, and the
KV pools would move to a module of their own as soon as another engine uses them.
"""
from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
import torch

from evo.core.genome import Genome
from evo.workloads import sampling
from evo.workloads.base import NO_SOURCES, DeviceInfo
from evo.workloads.generation import GenerationRequest, TokenEvent, check_fits
from evo.workloads.llama import engine as _llama_engine
from evo.workloads.llama.engine import LlamaEngine
from evo.workloads.llama_serve.genes import ServePlan, gene_space, llama_genome
from evo.workloads.llama_serve.presets import ServePreset

KV = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # _layers' kv(i, k, v)
Pick = tuple[GenerationRequest, int]  # how a row's token is chosen: its request, and the index of the token


def pick_tokens(logits: torch.Tensor, picks: list[Pick]) -> list[int]:
    """Each row's token from logits [n, V]: greedy rows by argmax (the first of equal maxima; on the CPU
    through numpy: torch's argmax over rows is ~20x slower there, 165 us vs 7 us at [16, 4096]), sampled
    rows by `sampling.choose` with their request's temperature, top_p, seed and output index. Every generation
    engine and baseline here picks through it, so a sampled token is the draw the judge checks."""
    rows = logits.float().numpy() if logits.device.type == "cpu" else None
    tokens = np.argmax(rows, 1).tolist() if rows is not None else logits.argmax(-1).tolist()
    for r, (request, index) in enumerate(picks):
        if not request.greedy:
            row = rows[r] if rows is not None else logits[r].float().cpu().numpy()
            tokens[r] = sampling.choose(row, request.temperature, request.top_p, request.seed, index)
    return tokens


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
        """Rows [0, n) each write one position pos[r] (pos [n]); they read [n, KVH, S, d] views."""
        rows = self.row_ids[:n]

        def kv(i: int, k: torch.Tensor, v: torch.Tensor):  # k, v [n, KVH, 1, d]
            # into the layer's own tensor, not a view of it: a compiled step then writes in place
            if self.bhld:
                self.k[i][rows, :, pos] = k[:, :, 0]
                self.v[i][rows, :, pos] = v[:, :, 0]
            else:
                self.k[i][rows, pos] = k[:, :, 0]
                self.v[i][rows, pos] = v[:, :, 0]
            return self.k_read[i][:n, :, :S], self.v_read[i][:n, :, :S]

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
        """(block, offset) of positions pos [n] in the rows of table [n, per_row]."""
        return table.gather(1, (pos // self.block)[:, None])[:, 0], pos % self.block

    def prefill_kv(self, row: int, pos: int, T: int) -> KV:
        end = pos + T
        table = self.table[row:row + 1, :math.ceil(end / self.block)]
        positions = torch.arange(pos, end, device=table.device)
        block, offset = self._where(table.expand(T, -1), positions)

        def kv(i: int, k: torch.Tensor, v: torch.Tensor):  # k, v [1, KVH, T, d]
            self.k_write[i].index_put_((block, offset), k[0].transpose(0, 1))
            self.v_write[i].index_put_((block, offset), v[0].transpose(0, 1))
            return self._gather(self.k[i], table)[:, :, :end], self._gather(self.v[i], table)[:, :, :end]

        return kv

    def decode_kv(self, n: int, pos: torch.Tensor, S: int) -> KV:
        table = self.table[:n, :math.ceil(S / self.block)]
        block, offset = self._where(self.table[:n], pos)

        def kv(i: int, k: torch.Tensor, v: torch.Tensor):  # k, v [n, KVH, 1, d]
            self.k_write[i].index_put_((block, offset), k[:, :, 0])
            self.v_write[i].index_put_((block, offset), v[:, :, 0])
            return self._gather(self.k[i], table)[:, :, :S], self._gather(self.v[i], table)[:, :, :S]

        return kv


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


class ModelRunner:
    """The forwards, blind to requests: a prompt chunk of one pool row, and one decode step of the pool's first
    n rows together. Both through `engine`'s layers; both return greedy tokens."""

    def __init__(self, engine: LlamaEngine, pool: SlotPool | PagedPool, plan: ServePlan, max_positions: int) -> None:
        self.engine, self.pool, self.max_positions, self.max_rows = engine, pool, max_positions, plan.max_running
        self.decoder = copy.copy(engine)  # the same layers and weights, its attention stage called per KV group
        self.decoder.attention = grouped_queries(engine.attention)
        device = engine.device
        self.key_positions = torch.arange(max_positions, device=device)
        self.visible, self.hidden = (torch.tensor(x, dtype=engine.dtype, device=device) for x in (0.0, -math.inf))
        self.compiled = torch.compile(self._static_step, dynamic=False) if plan.decode_step == "compiled" else None

    def prefill(self, row: int, tokens: tuple[int, ...], pos: int, pick: Pick | None) -> int | None:
        """Prompt tokens at positions [pos, pos+T) of `row`; with `pick` (they end the prompt), the next token."""
        made = self._chunk(row, tokens, pos, None if pick is None else [pick])
        return made[0] if pick is not None else None

    def _chunk(self, row: int, tokens: tuple[int, ...], pos: int, picks: list[Pick] | None) -> list[int]:
        """Tokens at positions [pos, pos+T) of one row, attending to its keys [0, pos+T) (causal: the attention
        stage's mask=None form); the token after the last one (none without `picks`)."""
        engine, T = self.engine, len(tokens)
        x = engine.embed[torch.tensor(tokens, device=engine.device)][None]  # [1, T, D]
        h = engine._layers(x, engine._rotary(pos, T), self.pool.prefill_kv(row, pos, T), None)
        return self._pick(engine._logits(h[:, -1]), picks) if picks else []

    def decode(self, tokens: list[int], positions: list[int], picks: list[Pick]) -> list[int]:
        """Rows [0, n) each feed tokens[r] at positions[r]; their next tokens, each picked by its request."""
        if self.compiled is None and len(tokens) == 1:  # one row: a one-token chunk, no mask (~10% faster)
            return self._chunk(0, (tokens[0],), positions[0], picks)
        device = self.engine.device
        token, pos = torch.tensor(tokens, device=device), torch.tensor(positions, device=device)
        if self.compiled is not None:
            return self._pick(self._padded_step(token, pos)[:len(tokens)], picks)
        return self._pick(self._eager_step(token, pos, max(positions) + 1), picks)

    def _eager_step(self, token: torch.Tensor, pos: torch.Tensor, S: int) -> torch.Tensor:
        """token, pos [n]: one forward of rows [0, n), attending to keys [0, S); logits [n, V]."""
        engine = self.decoder
        x = engine.embed[token][:, None]  # [n, 1, D]
        h = engine._layers(x, self._row_rotation(pos), self.pool.decode_kv(len(token), pos, S), self._row_mask(pos, S))
        return engine._logits(h[:, 0])

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
        """The rotary factors of rows at positions pos [n], shaped to rotate [n, h, 1, d]."""
        rot = self.engine._rotary_at(pos)  # [n, d/2]: complex, or (cos, sin)
        return tuple(r[:, None, None] for r in rot) if isinstance(rot, tuple) else rot[:, None, None]

    def _row_mask(self, pos: torch.Tensor, S: int) -> torch.Tensor:
        """Additive mask of rows at positions pos [n] over S keys, by one comparison: 0 up to each row's position,
        -inf after. Against the grouped call's scores (`grouped_queries`): [n, 1, 1, S] for SDPA's [n, KVH, G, S],
        [n, 1, 1, 1, S] for the matmul form's [n, KVH, 1, G, S]. (The attention stage documents a [T, S] mask,
        which cannot differ per row.)"""
        mask = torch.where(self.key_positions[:S] <= pos[:, None], self.visible, self.hidden)  # [n, S]
        return mask[:, None, None, None] if self.engine.plan.attention == "matmul" else mask[:, None, None]

    _pick = staticmethod(pick_tokens)


# ---------------------------------------------------------------------------------------------- the scheduler
@dataclass(eq=False)
class _Run:
    """An admitted request: its pool row, how much of its prompt is prefilled, the tokens it made."""

    request: GenerationRequest
    row: int
    prefilled: int = 0
    made: list[int] = field(default_factory=list)

    @property
    def cached(self) -> int:
        """Positions whose keys and values are in the pool (the next token to feed sits at this position)."""
        return self.prefilled + max(0, len(self.made) - 1)

    def finished(self) -> bool:
        return len(self.made) >= self.request.max_tokens or self.made[-1] in self.request.stop_ids


class BatchedLlamaGenerator:
    """`add` and `step` (the generation contract): the scheduler, over a KV pool and a model runner."""

    def __init__(self, engine: LlamaEngine, plan: ServePlan, max_positions: int) -> None:
        self.plan, self.max_positions = plan, max_positions
        self.num_threads = engine.num_threads  # its threads gene, as the engine's process reads it
        self._sdpa_backend = engine._sdpa_backend
        self.pool = make_pool(plan, engine, max_positions)
        self.runner = ModelRunner(engine, self.pool, plan, max_positions)
        self.waiting: deque[GenerationRequest] = deque()
        self.prefilling: list[_Run] = []  # admission order
        self.decoding: list[_Run] = []  # decoding[r].row == r: the pool's first rows
        self.free_rows = set(range(plan.max_running))

    def add(self, request: GenerationRequest) -> None:
        check_fits(request, self.max_positions)
        self.waiting.append(request)

    def step(self) -> list[TokenEvent]:
        """Decode every decoding request by one token, then admit and prefill (first tokens come from there)."""
        with torch.inference_mode(), self._sdpa_backend():
            events = self._decode() if self.decoding else []
            self._admit()
            return events + self._prefill()

    def abort(self, request_id: int) -> None:
        """Drop the request wherever it is: out of the queue, or its row freed (decoding rows compacted)."""
        self.waiting = deque(r for r in self.waiting if r.id != request_id)
        run = next((r for r in self.prefilling if r.request.id == request_id), None)
        if run is not None:
            self.prefilling.remove(run)
            self._free(run.row)
        run = next((r for r in self.decoding if r.request.id == request_id), None)
        if run is not None:
            self._end([run])

    @property
    def held(self) -> int:
        """Requests this engine holds (queued, prefilling or decoding)."""
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)

    def _admit(self) -> None:
        if self.plan.batching == "static" and (self.decoding or self.prefilling):
            return  # a new batch only once the whole running batch has finished
        while self.waiting and self.free_rows:
            row = min(self.free_rows)  # the lowest: the row it will decode in, so it seldom moves
            self.free_rows.remove(row)
            self.prefilling.append(_Run(self.waiting.popleft(), row))

    def _prefill(self) -> list[TokenEvent]:
        """A prefill forward (the whole prompt, or its next chunk) for the oldest admitted requests."""
        events = []
        for run in self.prefilling[:self.plan.max_prefills_per_step]:
            prompt, pos = run.request.prompt, run.prefilled
            T = len(prompt) - pos if self.plan.prefill == "whole" else min(self.plan.prefill_chunk, len(prompt) - pos)
            self.pool.reserve(run.row, pos + T)
            last = pos + T == len(prompt)
            token = self.runner.prefill(run.row, prompt[pos:pos + T], pos, (run.request, 0) if last else None)
            run.prefilled += T
            if token is None:
                continue
            run.made.append(token)
            self.prefilling.remove(run)
            events.append(TokenEvent(run.request.id, token, run.finished()))
            if run.finished():
                self._free(run.row)
            else:
                self._start_decoding(run)
        return events

    def _decode(self) -> list[TokenEvent]:
        """One batched forward of every decoding request; those that finish leave their rows."""
        runs = self.decoding
        positions = [run.cached for run in runs]
        for run, p in zip(runs, positions):
            self.pool.reserve(run.row, p + 1)
        made = self.runner.decode([run.made[-1] for run in runs], positions, [(run.request, len(run.made)) for run in runs])
        events, ended = [], []
        for run, token in zip(runs, made):
            run.made.append(token)
            events.append(TokenEvent(run.request.id, token, run.finished()))
            if events[-1].finished:
                ended.append(run)
        if ended:
            self._end(ended)
        return events

    # ------------------------------------------------------------------ rows: the decoding ones first
    def _free(self, row: int) -> None:
        self.pool.release(row)
        self.free_rows.add(row)

    def _move(self, run: _Run, row: int) -> None:
        """`run` into the free `row` (its own row freed)."""
        self.pool.move(run.row, row, run.cached)
        self.free_rows.remove(row)
        self.free_rows.add(run.row)
        run.row = row

    def _start_decoding(self, run: _Run) -> None:
        """A prefilled request joins the decoding rows: into the row after them (swapping with a prefilling
        request that holds it)."""
        target = len(self.decoding)
        holder = next((r for r in self.prefilling if r.row == target), None)
        if holder is not None:
            self.pool.swap(run.row, target, max(run.cached, holder.cached))
            holder.row, run.row = run.row, target
        elif run.row != target:
            self._move(run, target)
        self.decoding.append(run)

    def _end(self, ended: list[_Run]) -> None:
        """Free the ended requests' rows; the decoding requests beyond the new count move into the holes."""
        for run in ended:
            self._free(run.row)
        keep = [run for run in self.decoding if all(run is not e for e in ended)]
        holes = sorted(row for row in self.free_rows if row < len(keep))
        for run, hole in zip([r for r in keep if r.row >= len(keep)], holes):
            self._move(run, hole)
        self.decoding = sorted(keep, key=lambda r: r.row)


def build(genome: Genome, preset: ServePreset, device: DeviceInfo,
          sources: Mapping[str, str] = NO_SOURCES) -> BatchedLlamaGenerator:
    """Validate `genome` (GenomeError propagates), load the model's layers (the `llama` engine built from the
    genes the two spaces share, code genes' `sources` included) and compose the generator."""
    genome = gene_space(preset, device).validate(genome)
    engine = _llama_engine.build(llama_genome(genome, preset, device), preset, device, preset.max_positions, sources)
    return BatchedLlamaGenerator(engine, ServePlan.from_genome(genome), preset.max_positions)
