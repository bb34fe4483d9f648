"""The llama_serve workload with a `cheat` gene for the accuracy contract (tests/test_accuracy_contract.py): engines
that pick their own tokens from the model's float32 logits (one forward of the `llama` call engine over the prompt
and the tokens so far, per token), by a rule that is honest, steers near ties or is wrong on one class of prompts.
For the judge's full path: `Evaluator("tests.accuracy_cheats", "cpu_small", ...)`.

- `picker`: the rule's pick on its own logits (greedy, or `evo.workloads.sampling.choose`'s seeded draw);
- `steer`: the runner-up wherever it lies within STEER of the pick (the near-tie tolerance a bfloat16 preset had):
  what an engine that chooses its outputs inside a tie tolerance does;
- `class_wrong`: the runner-up at every step of a request whose first prompt token is a multiple of CLASS_EVERY,
  honest elsewhere: a trigger, a prompt class.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from evo.workloads import sampling
from evo.workloads.base import DeviceInfo, Preset
from evo.workloads.generation import GenerationRequest, TokenEvent
from tests.serve_cheats import CheatWorkload

STEER = 0.15
CLASS_EVERY = 4
CHEATS = ("picker", "steer", "class_wrong")


class _Picker:
    """Holds requests and gives each held one a token per step, chosen by `rule` from float32 logits."""

    def __init__(self, engine, rule: str) -> None:
        self.engine, self.rule = engine, rule
        self.num_threads = None
        self.held: dict[int, tuple[GenerationRequest, list[int]]] = {}

    def add(self, request: GenerationRequest) -> None:
        self.held[request.id] = (request, [])

    def abort(self, request_id: int) -> None:
        self.held.pop(request_id, None)

    def step(self) -> list[TokenEvent]:
        events = []
        for rid, (request, made) in list(self.held.items()):
            token = self._pick(request, made, self._logits(request, made))
            made.append(token)
            finished = len(made) >= request.max_tokens or token in request.stop_ids
            events.append(TokenEvent(rid, token, finished))
            if finished:
                del self.held[rid]
        return events

    def _logits(self, request: GenerationRequest, made: list[int]) -> np.ndarray:
        with torch.inference_mode():
            out = self.engine(prompt=torch.tensor([list(request.prompt)]),
                              continuation=torch.tensor([made], dtype=torch.long).reshape(1, len(made)))
        return out["logits"][0, -1].double().numpy()

    def _pick(self, request: GenerationRequest, made: list[int], row: np.ndarray) -> int:
        index = len(made)
        if request.temperature == 0:
            scores = row.copy()
        else:
            scores = row / request.temperature + sampling.gumbel(request.seed, index, len(row))
            if request.top_p < 1:
                scores = np.where(sampling.preceding_mass(row / request.temperature) < request.top_p, scores, -math.inf)
        first, second = np.argsort(-scores, kind="stable")[:2]
        gap = (scores[first] - scores[second]) * (request.temperature or 1.0)
        wrong = (self.rule == "steer" and gap < STEER) or (
            self.rule == "class_wrong" and request.prompt[0] % CLASS_EVERY == 0 and math.isfinite(scores[second]))
        return int(second if wrong else first)


class AccuracyCheats(CheatWorkload):
    name = "accuracy_cheats"
    cheats = CHEATS

    def wrap(self, cheat: str, honest, preset: Preset, device: DeviceInfo):
        from evo.workloads import get_workload
        from evo.workloads.llama.engine import build

        llama = get_workload("llama")
        return _Picker(build(llama.gene_space(preset, device).default(), preset, device, preset.max_positions),
                       cheat)


WORKLOAD = AccuracyCheats()
