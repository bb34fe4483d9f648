"""The Llama generation engine in its plainest form, replayed by the judge as a client (evaluators.judge.replay)
and scored on its own tokens against the float64 reference: right, and its metrics are the judge's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from evaluators.judge.replay import Send, replay, score
from evo.core.stream_metrics import serving_metrics
from evo.core.trace import TraceSpec, draw
from evo.workloads import get_workload
from evo.workloads.base import DeviceInfo
from evo.workloads.generation import GenerationRequest
from evo.workloads.llama import inputs as llama_inputs
from evo.workloads.llama.generator import LlamaGenerator
from evo.workloads.llama.reference import generate

W = get_workload("llama")
CPU = DeviceInfo("cpu", "cpu", 1)


def test_the_plainest_generator_decodes_its_own_tokens_as_the_float64_reference_does():
    preset = W.presets()["cpu_small"]
    positions = llama_inputs.max_positions(preset)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = W.build(W.gene_space(preset, CPU).default(), preset, CPU)
        rng = np.random.default_rng(4)
        trace = draw(TraceSpec(arrival="closed", count=3, concurrency=2, prompt_len=(3, 12), output_len=(2, 6)), rng)
        prompts = [rng.integers(0, preset.model.vocab, t.prompt_len).tolist() for t in trace]
        result = replay(LlamaGenerator(engine, positions), trace, prompts, concurrency=2, deadline_s=120)

        def reference(prompt, tokens):  # row i: the float64 logits that predict tokens[i]
            return generate(preset.model, torch.tensor([list(prompt)]), torch.tensor([list(tokens[:-1])]))[0].numpy()

        assert score(result, reference, tolerance=1e-4, vocab=preset.model.vocab) == []
        assert [len(t) for t in result.tokens] == [r.max_tokens for r in result.requests]
        assert serving_metrics(result.timelines, result.duration_s).completed == 3
        with pytest.raises(ValueError, match="positions this engine holds"):
            LlamaGenerator(engine, positions).add(type(result.requests[0])(9, (1,) * positions, 1))
    finally:
        torch.set_num_threads(threads)


def test_the_generator_runs_confined_and_the_judge_scores_it_through_its_channel():
    """The generation contract over the engine's own channel: built in the strict sandbox, requests added
    and steps taken as messages, every answer checked; the same tokens as the reference."""
    from evaluators.machine import device as devices
    from evaluators.sandbox.guard import hidden_paths
    from evaluators.judge.replay import ConfinedGenerator
    from evaluators.sandbox.process import EngineProcess, EngineProcessError, workload_modules

    preset = W.presets()["cpu_small"]
    info = devices.device_info("cpu", 1)
    process = EngineProcess("cpu", threads=1, hidden=hidden_paths(W), readable=W.engine_files(preset))
    try:
        process.launch(preload=workload_modules(W))
        process.configure(W, preset, info, genome_json=W.gene_space(preset, info).default().to_json(),
                          contract="generation")
        built = process.build(timeout_s=120)
        assert built["op"] == "built", built
        rng = np.random.default_rng(8)
        trace = draw(TraceSpec(arrival="burst", count=3, concurrency=0, prompt_len=(2, 10), output_len=(2, 5)), rng)
        prompts = [rng.integers(0, preset.model.vocab, t.prompt_len).tolist() for t in trace]
        result = replay(ConfinedGenerator(process), trace, prompts, deadline_s=120)

        def reference(prompt, tokens):
            return generate(preset.model, torch.tensor([list(prompt)]), torch.tensor([list(tokens[:-1])]))[0].numpy()

        assert score(result, reference, tolerance=1e-4, vocab=preset.model.vocab) == [] and not result.violations

        # four steps per exchange (the gene steps_per_exchange): the same tokens, in bursts, in fewer exchanges
        class Counted(ConfinedGenerator):
            exchanges = 0

            def step(self):
                Counted.exchanges += 1
                return super().step()

        sends = [Send(GenerationRequest(10 + i, tuple(p), 6)) for i, p in enumerate(prompts)]
        burst = replay(Counted(process, steps_per_exchange=4), sends, deadline_s=120)
        assert score(burst, reference, tolerance=1e-4, vocab=preset.model.vocab) == [] and not burst.violations
        assert [len(t) for t in burst.tokens] == [6, 6, 6]
        assert Counted.exchanges <= 3 and any(len(set(t.token_s)) < len(t.token_s) for t in burst.timelines)
        with pytest.raises(EngineProcessError, match="died"):  # no call contract on a generator: it ends
            process.call({}, {}, timeout_s=30)
    finally:
        process.close()
