"""Baselines a user would pick for serving a Llama model, as generation engines (`evo.workloads.generation`):

- `one_at_a_time`: our plainest generator (`LlamaGenerator` over the llama workload's default genome),
  admitting the next request only when the previous one finished (FIFO, one in flight).
- `hf_static`: transformers' `LlamaForCausalLM` with static batching, what most people write: up to R
  waiting requests left-padded into one batch, one forward of the whole batch per step, finished rows
  riding along until the batch's last request is done; then the next batch.
- `hf_continuous`: transformers' own continuous batching (its manager, a paged KV cache, its FIFO
  scheduler, a background thread), streamed token by token.

All ignore the model's eos (a request ends at max_tokens or at one of its stop ids), run under
`torch.inference_mode()` and carry `num_threads` (the device's threads on CPU, None on CUDA) for the engine's
process to set. `one_at_a_time` and `hf_static` decode greedily or draw each request's seeded samples
(`evo.workloads.sampling.choose`, as the judge checks them); `hf_continuous` decodes greedily only (its manager
samples with its own generator, not the seeded draw), so it is declared `greedy_only` and the judge sends it
greedy requests only. The hf_* ones are offered only when transformers is importable.
"""
from __future__ import annotations

import math
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from evo.workloads.base import DeviceInfo, greedy_only
from evo.workloads.generation import GenerationEngine, GenerationRequest, TokenEvent, check_fits
from evo.workloads.llama.baselines import _Transformers, transformers_available
from evo.workloads.llama.engine import build as build_llama
from evo.workloads.llama.generator import LlamaGenerator
from evo.workloads.llama.genes import gene_space
from evo.workloads.llama_serve.engine import pick_tokens
from evo.workloads.llama_serve.presets import ServePreset


def _threads(device: DeviceInfo) -> int | None:
    return device.threads if device.kind == "cpu" else None


def _is_last(request: GenerationRequest, made: int, token: int) -> bool:
    return made >= request.max_tokens or token in request.stop_ids


def hf_model(preset: ServePreset, device: DeviceInfo):
    """transformers' LlamaForCausalLM on our weights, SDPA attention (built as the llama workload's baselines do)."""
    return _Transformers(preset, device, "sdpa").model


class OneAtATime:
    """`generator` (any generation engine) fed one request at a time, in arrival order."""

    def __init__(self, generator, max_positions: int, num_threads: int | None) -> None:
        self.generator, self.max_positions, self.num_threads = generator, max_positions, num_threads
        self.waiting: deque[GenerationRequest] = deque()
        self.current: int | None = None  # the id of the request in the generator

    def add(self, request: GenerationRequest) -> None:
        check_fits(request, self.max_positions)
        self.waiting.append(request)

    def step(self) -> list[TokenEvent]:
        if self.current is None:
            if not self.waiting:
                return []
            request = self.waiting.popleft()
            self.generator.add(request)
            self.current = request.id
        events = self.generator.step()
        if any(e.finished and e.request_id == self.current for e in events):
            self.current = None
        return events

    def abort(self, request_id: int) -> None:
        self.waiting = deque(r for r in self.waiting if r.id != request_id)
        if request_id == self.current:
            self.generator.abort(request_id)
            self.current = None


def one_at_a_time(preset: ServePreset, device: DeviceInfo) -> OneAtATime:
    """`LlamaGenerator` over the llama workload's default genome (its gene space, as `get_workload("llama")` has it)."""
    engine = build_llama(gene_space(preset, device).default(), preset, device, preset.max_positions)
    return OneAtATime(LlamaGenerator(engine, preset.max_positions), preset.max_positions, _threads(device))


@dataclass
class _Batch:
    """A static batch in flight: its requests (rows), the tokens each made, and the model's state."""

    requests: list[GenerationRequest]
    cache: object  # transformers' DynamicCache
    inputs: torch.Tensor  # [B, T] token ids of the next forward (the left-padded prompts first, then [B, 1])
    positions: torch.Tensor  # [B, T] their positions (left padding: each row's own count from its first token)
    mask: torch.Tensor  # [B, S] 1 for every real token seen or fed so far, 0 for padding
    made: list[list[int]] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)


class HFStatic:
    """Static batching over a transformers causal LM (see the module): `batch_size` requests at most a batch."""

    def __init__(self, model, batch_size: int, max_positions: int, num_threads: int | None) -> None:
        self.model, self.batch_size, self.max_positions = model, batch_size, max_positions
        self.num_threads = num_threads
        self.device = model.device
        self.waiting: deque[GenerationRequest] = deque()
        self.batch: _Batch | None = None

    def add(self, request: GenerationRequest) -> None:
        check_fits(request, self.max_positions)
        self.waiting.append(request)

    def step(self) -> list[TokenEvent]:
        if self.batch is None:
            if not self.waiting:
                return []
            self.batch = self._open([self.waiting.popleft() for _ in range(min(self.batch_size, len(self.waiting)))])
        batch = self.batch
        with torch.inference_mode():
            out = self.model(input_ids=batch.inputs, attention_mask=batch.mask, position_ids=batch.positions,
                             cache=batch.cache, use_cache=True, logits_to_keep=1)
            picks = [(request, len(made)) for request, made in zip(batch.requests, batch.made)]
            tokens = torch.tensor(pick_tokens(out.logits[:, -1], picks), device=batch.inputs.device)  # [B]
        events = []
        for row, (request, token) in enumerate(zip(batch.requests, tokens.tolist())):
            if batch.done[row]:
                continue  # a finished row rides along: static batching's cost
            batch.made[row].append(token)
            batch.done[row] = _is_last(request, len(batch.made[row]), token)
            events.append(TokenEvent(request.id, token, batch.done[row]))
        if all(batch.done):
            self.batch = None
        else:  # every row decodes its last token next, finished or not
            batch.inputs = tokens[:, None]
            batch.positions = batch.positions[:, -1:] + 1
            batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.requests), 1)], 1)
        return events

    def abort(self, request_id: int) -> None:
        """Out of the queue; in the running batch its row rides along to the batch's end (static batching)."""
        self.waiting = deque(r for r in self.waiting if r.id != request_id)
        if self.batch is not None:
            for row, request in enumerate(self.batch.requests):
                if request.id == request_id:
                    self.batch.done[row] = True
            if all(self.batch.done):
                self.batch = None

    def _open(self, requests: list[GenerationRequest]) -> _Batch:
        """The batch's prefill inputs: prompts left-padded (token 0, masked) to the longest."""
        from transformers import DynamicCache

        longest = max(len(r.prompt) for r in requests)
        ids = torch.zeros(len(requests), longest, dtype=torch.long)
        mask = torch.zeros(len(requests), longest, dtype=torch.long)
        for row, request in enumerate(requests):
            ids[row, longest - len(request.prompt):] = torch.tensor(request.prompt)
            mask[row, longest - len(request.prompt):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, positions = ids.to(self.device), mask.to(self.device), positions.to(self.device)
        return _Batch(requests, DynamicCache(config=self.model.config), ids, positions, mask,
                      [[] for _ in requests], [False] * len(requests))


def hf_static(preset: ServePreset, device: DeviceInfo) -> HFStatic:
    return HFStatic(hf_model(preset, device), preset.shape["R"], preset.max_positions, _threads(device))


class HFContinuous:
    """transformers' continuous batching manager behind `add` and `step` (see the module).

    Streaming is per token: the manager delivers, after every forward, one output per streaming request that
    got a token, holding all its tokens so far; `step` waits for the first output (at most `timeout_s`) and
    turns every output available then into the tokens not yet handed over, in delivery order. A request's
    stop ids are its eos in the manager (so it stops computing it), and the wrapper ends it there too.
    """

    def __init__(self, manager, max_positions: int, num_threads: int | None, timeout_s: float = 60.0) -> None:
        self.manager, self.max_positions, self.num_threads = manager, max_positions, num_threads
        self.timeout_s = timeout_s
        self.running: dict[str, tuple[GenerationRequest, int]] = {}  # manager id -> (request, tokens handed over)
        # The manager's thread is not a daemon: a process whose engine is never closed would wait for it forever.
        # threading's own exit hook (as concurrent.futures uses) runs before such threads are joined.
        threading._register_atexit(_close_if_alive, weakref.ref(self))

    def add(self, request: GenerationRequest) -> None:
        check_fits(request, self.max_positions)
        rid = str(request.id)
        self.running[rid] = (request, 0)
        with torch.inference_mode():
            self.manager.add_request(list(request.prompt), request_id=rid, max_new_tokens=request.max_tokens,
                                     streaming=True, eos_token_id=list(request.stop_ids) or -1)

    def step(self) -> list[TokenEvent]:
        if not self.running:
            return []
        output = self.manager.get_result(timeout=self.timeout_s)
        if output is None:
            raise RuntimeError(f"transformers' continuous batching gave no token in {self.timeout_s:g} s "
                               f"(its thread {'runs' if self.manager.is_running() else 'stopped'})")
        events = []
        while output is not None:
            events += self._new_tokens(output)
            output = self.manager.get_result(timeout=0)
        return events

    def abort(self, request_id: int) -> None:
        if self.running.pop(str(request_id), None) is not None:
            self.manager.cancel_request(str(request_id))

    def _new_tokens(self, output) -> list[TokenEvent]:
        if output.request_id not in self.running:
            return []  # already ended here (at a stop id)
        if output.error is not None:
            raise RuntimeError(f"transformers' continuous batching failed request {output.request_id}: {output.error}")
        request, handed = self.running[output.request_id]
        events = []
        for token in output.generated_tokens[handed:]:
            handed += 1
            last = _is_last(request, handed, token)
            events.append(TokenEvent(request.id, token, last))
            if last:
                del self.running[output.request_id]
                if not output.is_finished():
                    self.manager.cancel_request(output.request_id)
                return events
        self.running[output.request_id] = (request, handed)
        return events

    def close(self) -> None:
        """Stop the manager's thread (at once, failing what it still runs)."""
        if self.manager.is_running():
            self.manager.stop(block=True, timeout=10, hard_stop=True)
        self.manager.destroy()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter teardown: nothing left to report to
            pass


def _close_if_alive(engine: weakref.ref) -> None:
    if engine() is not None:
        engine().close()


def continuous_settings(preset: ServePreset, page_size: int = 32):
    """A paged cache sized for R requests of P + N positions (beyond the FIFO scheduler's 15% safety margin),
    up to R whole prompts in a forward (capped at transformers' default 8192 tokens), R requests a batch.
    Left to its defaults, the manager sizes the cache to most of the machine's memory."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    R, positions = preset.shape["R"], preset.max_positions
    blocks = R * (math.ceil(positions / page_size) + 1)
    return ContinuousBatchingConfig(page_size=page_size, num_blocks=math.ceil(blocks / 0.85) + 1,
                                    max_batch_tokens=min(R * (preset.shape["P"] + 1), 8192),
                                    max_requests_per_batch=R, allow_block_sharing=False, scheduler_type="fifo")


def hf_continuous(preset: ServePreset, device: DeviceInfo) -> HFContinuous:
    """The manager built, its paged cache allocated and its thread started here, not in the first step."""
    from transformers import GenerationConfig

    model = hf_model(preset, device)
    greedy = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=preset.shape["N"])
    with torch.inference_mode():  # the manager's thread takes the caller's inference mode
        manager = model.init_continuous_batching(generation_config=greedy,
                                                 continuous_batching_config=continuous_settings(preset))
        manager.warmup()  # allocates the paged cache (no graphs to capture on CPU)
        manager.start()
    return HFContinuous(manager, preset.max_positions, _threads(device))


def baselines(preset: ServePreset) -> dict[str, Callable[[DeviceInfo], GenerationEngine]]:
    """Name -> builder(DeviceInfo) -> generation engine, for each baseline available here."""
    out: dict[str, Callable[[DeviceInfo], GenerationEngine]] = {"one_at_a_time": lambda d: one_at_a_time(preset, d)}
    if transformers_available():
        out["hf_static"] = lambda d: hf_static(preset, d)
        out["hf_continuous"] = greedy_only(lambda d: hf_continuous(preset, d))
    return out
