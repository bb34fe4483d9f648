"""The kimi_linear generation engine, replayed by the judge's own client (evaluators.judge.replay) on the cpu_small
trace and scored on its own tokens against the float64 reference: every gene value decodes the reference's
tokens from logits within float32 rounding of it, batch mates change no request's tokens, an abort frees its
row, seeded sampling is the draw the judge checks; the baselines are right on the same trace; and one
evaluation through the real judge in the strict sandbox is ok."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from evaluators.judge.replay import replay, request_problems, score
from evo.core.genome import GenomeError
from evo.core.trace import TraceRequest
from evo.workloads import get_workload
from evo.workloads.base import DeviceInfo
from evo.workloads.generation import GenerationRequest
from evo.workloads.generation_core import cpu_kernels
from evo.workloads.kimi_linear import engine as kimi_engine
from evo.workloads.kimi_linear import reference
from evo.workloads.kimi_linear.genes import gene_space
from evo.workloads.kimi_linear.presets import PRESETS
from tests.generation_driver import TRACE, drive, trace_prompts
from tests.models import KIMI_VARIANT as VARIANT  # every branch cpu_small leaves out

CPU = DeviceInfo("cpu", "cpu", 1)
PRESET = PRESETS["cpu_small"]
V = PRESET.model.vocab
SPACE = gene_space(PRESET, CPU)
WORKLOAD = get_workload("kimi_linear")


def _prompts(seed: int) -> list[list[int]]:
    return trace_prompts(V, seed)


PROMPTS = _prompts(12)


@functools.lru_cache(maxsize=None)
def _reference(prompt: tuple[int, ...], tokens: tuple[int, ...]) -> np.ndarray:
    return reference.continuation_logits(PRESET, prompt, tokens)


def _ref(prompt, tokens) -> np.ndarray:
    return _reference(tuple(prompt), tuple(tokens))


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def _record(monkeypatch) -> dict[int, list[torch.Tensor]]:
    """From now on, request id -> the logits rows its tokens were picked from, in order (a right token alone
    could hide a wrong state: the logits show it)."""
    seen: dict[int, list[torch.Tensor]] = {}
    pick = kimi_engine.pick_tokens.__wrapped__ if hasattr(kimi_engine.pick_tokens, "__wrapped__") else kimi_engine.pick_tokens

    def keep(logits, picks):
        for row, (request, index) in zip(logits, picks):
            assert len(seen.setdefault(request.id, [])) == index
            seen[request.id].append(row.clone())
        return pick(logits, picks)

    keep.__wrapped__ = pick
    monkeypatch.setattr(kimi_engine, "pick_tokens", keep)
    return seen


@pytest.fixture
def logits_seen(monkeypatch) -> dict[int, list[torch.Tensor]]:
    return _record(monkeypatch)


def _replay(generator, prompts=PROMPTS, stop_ids: tuple[int, ...] = ()):
    return replay(generator, TRACE, prompts, concurrency=4, stop_ids=stop_ids, deadline_s=120)


def _assert_logits_match(result, seen, rel: float = 1e-5, reference_logits=_ref) -> None:
    for request, tokens in zip(result.requests, result.tokens):
        ours = torch.stack(seen[request.id]).double().numpy()
        ref = reference_logits(request.prompt, tokens)
        assert np.abs(ours - ref).max() / np.abs(ref).max() < rel, request.id


# every value of every gene (threads has one value on a 1-thread device), and a queue with them together
DESIGNS = {
    "default": {},
    "compressed": {"mla_cache": "compressed"},
    "grouped": {"moe_dispatch": "grouped"},
    "dense": {"moe_dispatch": "dense"},
    "fused": {"fused_projections": True},
    "chunked": {"kda_prefill": "chunked"},
    "chunked_c32_forward": {"kda_prefill": "chunked", "chunk_size": 32, "intra_algorithm": "forward_substitution"},
    "chunked_c64_triangular": {"kda_prefill": "chunked", "chunk_size": 64, "intra_algorithm": "triangular_solve"},
    "chunked_c128": {"kda_prefill": "chunked", "chunk_size": 128},
    "one_running": {"max_running": 1},
    "ring": {"conv_window": "ring"},
    "vk": {"state_layout": "vk"},
    "ring_vk_chunked": {"conv_window": "ring", "state_layout": "vk", "kda_prefill": "chunked"},
    "shared_fused": {"shared_expert": "fused"},
    "shared_fused_grouped": {"shared_expert": "fused", "moe_dispatch": "grouped"},
    "shared_fused_dense": {"shared_expert": "fused", "moe_dispatch": "dense"},
    "together": {"prefill_rows": "together"},
    "together_chunked_ring_vk": {"prefill_rows": "together", "kda_prefill": "chunked", "conv_window": "ring",
                                 "state_layout": "vk", "mla_cache": "compressed"},
    "queue_all": {"max_running": 2, "mla_cache": "compressed", "moe_dispatch": "grouped", "kda_prefill": "chunked",
                  "fused_projections": True, "conv_window": "ring", "state_layout": "vk", "shared_expert": "fused",
                  "prefill_rows": "together"},
    "eight_running": {"max_running": 8},
    "native": {"kda_kernel": "native"},
    "native_together_ring_grouped": {"kda_kernel": "native", "prefill_rows": "together", "conv_window": "ring",
                                     "mla_cache": "compressed", "moe_dispatch": "grouped"},
    "native_together": {"kda_kernel": "native", "prefill_rows": "together"},
    "native_step": {"decode_step": "native", "mla_cache": "compressed"},
    "native_step_queue": {"decode_step": "native", "mla_cache": "compressed", "max_running": 2, "kda_kernel": "native",
                          "prefill_rows": "together", "moe_dispatch": "grouped"},
    "native_prefill": {"prefill_step": "native", "mla_cache": "compressed"},  # the C forward's states, torch's steps
    "native_forward_queue": {"prefill_step": "native", "decode_step": "native", "mla_cache": "compressed",
                             "max_running": 2, "prefill_rows": "together"},
    # a step's decode rows in its prefill's forward (two running: requests join while the other decodes)
    "native_forward_with_decode": {"prefill_step": "with_decode", "decode_step": "native", "mla_cache": "compressed",
                                   "max_running": 2},
}


def test_every_gene_value_is_exercised():
    for gene in SPACE.genes:
        if gene.name == "steps_per_exchange":  # read by the judge and Serve, not the engine (test_llama_generation)
            continue
        used = {DESIGNS[d].get(gene.name, gene.default) for d in DESIGNS}
        assert set(gene.values) <= used | ({1, 2, 4, 8} if gene.name == "max_running" else set()), gene.name


@pytest.mark.parametrize("design", sorted(DESIGNS))
def test_each_design_decodes_its_own_tokens_as_the_float64_reference_does(design, logits_seen):
    generator = kimi_engine.build(SPACE.make(DESIGNS[design]), PRESET, CPU)
    result = _replay(generator)
    assert score(result, _ref, tolerance=1e-4, vocab=V) == []
    assert [len(t) for t in result.tokens] == [r.max_tokens for r in result.requests]
    _assert_logits_match(result, logits_seen)
    assert generator.held == 0 and not generator.running


def test_the_chunked_prefill_is_exact_under_the_models_strong_decay():
    """kda_prefill=chunked reuses the KDA workload's engine; this model's log decays reach -40, where that
    workload's factored exponent forms overflow: the form it is built with stays within float32 rounding."""
    from evo.workloads.kda.reference import recurrent_kda

    gen = torch.Generator().manual_seed(3)
    H, K, T = PRESET.model.kda_heads, PRESET.model.kda_head_dim, 40
    q, k, v = torch.randn(3, 1, T, H, K, generator=gen).unbind(0)
    g, beta = -40 * torch.rand(1, T, H, K, generator=gen), torch.rand(1, T, H, generator=gen)
    ours = kimi_engine._chunked_kda(PRESET, CPU)(q, k, v, g, beta)
    ref = recurrent_kda({"q": q, "k": k, "v": v, "g": g, "beta": beta}, torch.float64)
    for name in ("o", "final_state"):
        assert (ours[name].double() - ref[name]).abs().max() < 1e-4 * ref[name].abs().max(), name


BF16_DESIGNS = {
    "bf16_state_compressed": {"state_dtype": "bfloat16", "mla_cache": "compressed"},
    "f32_cache_compressed": {"mla_cache": "compressed", "mla_cache_dtype": "float32"},
    "bf16_state_native": {"state_dtype": "bfloat16", "kda_kernel": "native", "prefill_rows": "together"},
    "f32_cache_expanded_vk_ring_fused": {"state_dtype": "bfloat16", "mla_cache_dtype": "float32",
                                         "state_layout": "vk", "conv_window": "ring", "shared_expert": "fused"},
}


@pytest.mark.parametrize("design", sorted(BF16_DESIGNS))
def test_bfloat16_presets_offer_a_bfloat16_state_and_a_float32_cache_and_run_within_bfloat16_rounding(design):
    """cpu_small in bfloat16 (its weights stored in bfloat16, so the reference reads the same ones): a bfloat16
    state, and a float32 MLA cache beside the bfloat16 default, are offered there only; the engine serves a
    replay and its first tokens' logits lie within bfloat16 rounding of the float64 reference (~2% of the
    largest logit: bfloat16 activations through four layers)."""
    preset = dataclasses.replace(PRESET, dtype="bfloat16",
                                 model=dataclasses.replace(PRESET.model, storage_dtype="bfloat16"))
    space = gene_space(preset, CPU)
    assert space.gene("state_dtype").values == ("float32", "bfloat16")
    assert SPACE.gene("state_dtype").values == ("float32",)  # a float32 preset keeps a float32 state
    cache_dtype = space.gene("mla_cache_dtype")
    assert cache_dtype.values == ("bfloat16", "float32") and cache_dtype.default == "bfloat16"  # today's cache
    assert SPACE.gene("mla_cache_dtype").values == ("float32",)  # a bfloat16 cache would break float32 accuracy
    genes = BF16_DESIGNS[design]
    generator = kimi_engine.build(space.make(genes), preset, CPU)
    kda_state, mla_cache = generator.pool.tensors[0][0], generator.pool.tensors[3][0]  # layers 0 KDA, 3 MLA
    assert kda_state.dtype == getattr(torch, genes.get("state_dtype", "float32"))
    assert mla_cache.dtype == getattr(torch, genes.get("mla_cache_dtype", "bfloat16"))
    result = _replay(generator)
    assert not result.violations and [len(t) for t in result.tokens] == [r.max_tokens for r in result.requests]
    for prompt in PROMPTS[:4]:
        with torch.inference_mode():
            ours = generator.model.prefill(0, tuple(prompt))[0].double().numpy()
        ref = reference.continuation_logits(preset, prompt, [0])[0]
        assert np.abs(ours - ref).max() / np.abs(ref).max() < 5e-2


def test_the_native_kda_kernel_needs_kv_states_and_the_cpu():
    with pytest.raises(GenomeError, match="kda_kernel='native' updates KDA states kept as \\[K, V\\]"):
        SPACE.make({"kda_kernel": "native", "state_layout": "vk"})
    assert "kda_kernel" not in {g.name for g in gene_space(PRESET, DeviceInfo("cuda", "H200", 1)).genes}
    assert SPACE.levers[:3] == ("decode_step", "prefill_step", "kda_kernel")


def test_the_native_decode_step_needs_what_it_reads_and_a_float32_cpu_preset():
    with pytest.raises(GenomeError, match="decode_step='native' reads the compressed MLA cache.*mla_cache='expanded'"):
        SPACE.make({"decode_step": "native"})
    with pytest.raises(GenomeError, match="conv_window='ring'.*set conv_window=shifted"):
        SPACE.make({"decode_step": "native", "mla_cache": "compressed", "conv_window": "ring"})
    with pytest.raises(GenomeError, match="prefill_step='native' reads.*state_layout='vk'.*or prefill_step=torch"):
        SPACE.make({"prefill_step": "native", "mla_cache": "compressed", "state_layout": "vk"})
    with pytest.raises(GenomeError, match="prefill_step='with_decode' runs the decode rows.*decode_step='eager'"):
        SPACE.make({"prefill_step": "with_decode", "mla_cache": "compressed"})
    bf16 = dataclasses.replace(PRESET, dtype="bfloat16",
                               model=dataclasses.replace(PRESET.model, storage_dtype="bfloat16"))
    for preset, device in ((PRESET, DeviceInfo("cuda", "H200", 1)), (bf16, CPU)):
        assert not {"decode_step", "prefill_step"} & {g.name for g in gene_space(preset, device).genes}
    with pytest.raises(cpu_kernels.KernelUnavailable, match="float32 weights.*multiples of 8.*'hidden': 44"):
        cpu_kernels.check_kimi_step_supported(dataclasses.replace(PRESET.model, hidden=44), torch.bfloat16, "cpu")


def test_the_c_forward_refuses_segments_that_would_race_or_overrun_before_touching_a_row():
    step = kimi_engine.build(SPACE.make(DESIGNS["native_prefill"]), PRESET, CPU).model.native_step
    before = [t.clone() for layer in step._memory for t in layer]
    x = torch.zeros(4, PRESET.model.hidden)
    for rows, starts, lengths, why in (([0, 0], [0, 0], [2, 2], "one row twice"), ([0], [0], [3], "3 of 4 tokens"),
                                       ([0, 1], [0, PRESET.max_positions - 1], [2, 2], "past the last position"),
                                       ([0, 99], [0, 0], [2, 2], "no such row")):
        with pytest.raises(ValueError, match="distinct rows.*adding up to N"):
            step.forward(x, rows, starts, lengths)
    assert all(torch.equal(a, b) for a, b in zip(before, (t for layer in step._memory for t in layer))), why


@pytest.mark.parametrize("genes", [
    {"shared_expert": "fused", "conv_window": "ring", "state_layout": "vk", "moe_dispatch": "grouped"},
    {"decode_step": "native", "mla_cache": "compressed", "kda_kernel": "native", "prefill_rows": "together"},
    {"decode_step": "native", "prefill_step": "native", "mla_cache": "compressed", "prefill_rows": "together"}],
    ids=["layouts", "native_step", "native_forward"])
def test_the_new_layouts_serve_a_model_with_two_shared_experts_and_a_three_tap_convolution(genes, logits_seen,
                                                                                         monkeypatch):
    """The reference tests' VARIANT model (2 shared experts, 3 taps, q low rank, expert groups, MLA first) with
    the shared experts fused into a grouped dispatch, ring windows and [V, K] states, or through our C decode
    step (every branch of it cpu_small leaves out), or its forward prefilling too, 7 tokens a call (prompts split
    across calls): the reference's tokens, from logits within float32 rounding of it."""
    monkeypatch.setattr(kimi_engine, "PREFILL_CHUNK", 7)
    preset = dataclasses.replace(PRESET, name="cpu_small:variant", model=VARIANT,
                                 shape={**PRESET.shape, "V": VARIANT.vocab})
    generator = kimi_engine.build(gene_space(preset, CPU).make(genes), preset, CPU)
    if genes.get("shared_expert") == "fused":
        assert generator.model.layers[0][4].experts == VARIANT.experts + VARIANT.shared_experts

    def variant_ref(prompt, tokens):
        return reference.continuation_logits(preset, prompt, tokens)

    result = _replay(generator, trace_prompts(VARIANT.vocab, 5))
    assert score(result, variant_ref, tolerance=1e-4, vocab=VARIANT.vocab) == []
    _assert_logits_match(result, logits_seen, reference_logits=variant_ref)


def test_a_requests_tokens_do_not_depend_on_its_batch_mates(monkeypatch):
    """The same requests one at a time and four together: the same tokens, from the same logits."""
    runs = {}
    for m in (1, 4):
        seen = _record(monkeypatch)
        runs[m] = (_replay(kimi_engine.build(SPACE.make({"max_running": m}), PRESET, CPU), _prompts(13)).tokens, seen)
    assert runs[1][0] == runs[4][0]
    for request_id, rows in runs[1][1].items():
        a, b = torch.stack(rows), torch.stack(runs[4][1][request_id])
        assert (a - b).abs().max() <= 1e-5 * a.abs().max(), request_id


@pytest.mark.parametrize("design", ["default", "queue_all"])
def test_an_aborted_request_gets_no_token_and_frees_its_row(design):
    """Abort a request before its first step, one after its first token and one mid-decode: none gets a token
    after, the others' tokens are unchanged (their rows moved into the freed ones), and every row is free."""
    requests = [GenerationRequest(i, tuple(p), 12) for i, p in enumerate(PROMPTS[:6])]
    alone = drive(kimi_engine.build(SPACE.make(DESIGNS[design]), PRESET, CPU), requests)
    generator = kimi_engine.build(SPACE.make(DESIGNS[design]), PRESET, CPU)
    made = drive(generator, requests, abort_after={1: 3, 4: 0, 5: 1})
    assert made[4] == [] and made[1] == alone[1][:3] and made[5] == alone[5][:1]
    assert all(made[i] == alone[i] for i in (0, 2, 3))
    assert generator.held == 0 and not generator.running


def test_a_stop_id_ends_its_request_and_a_request_too_long_is_refused():
    prompts = PROMPTS[:4]
    trace = [TraceRequest(i, 0.0, len(p), 12) for i, p in enumerate(prompts)]
    plain = replay(kimi_engine.build(SPACE.default(), PRESET, CPU), trace, prompts, deadline_s=120)
    stops = (plain.tokens[0][0], plain.tokens[1][5])
    result = replay(kimi_engine.build(SPACE.default(), PRESET, CPU), trace, prompts, stop_ids=stops, deadline_s=120)
    assert score(result, _ref, tolerance=1e-4, vocab=V) == [] and not result.violations
    for tokens, stopped in zip(plain.tokens, result.tokens):
        first = next((i for i, t in enumerate(tokens) if t in stops), len(tokens) - 1)
        assert stopped == tokens[:first + 1]
    generator = kimi_engine.build(SPACE.default(), PRESET, CPU)
    bound = PRESET.max_positions
    generator.add(GenerationRequest(0, (1,) * (bound - 1), 1))  # exactly fits
    with pytest.raises(ValueError, match=f"over the {bound} positions"):
        generator.add(GenerationRequest(1, (1,) * bound, 1))


def test_sampled_requests_are_the_seeded_draw_the_judge_checks():
    rng = np.random.default_rng(21)
    prompts = [tuple(rng.integers(0, V, n).tolist()) for n in (5, 17, 1, 9)]
    settings = [(1.0, 1.0, 3), (0.7, 0.9, 4), (1.5, 0.5, 5), (0.0, 1.0, 0)]
    requests = [GenerationRequest(i, p, 12, (), t, top_p, seed) for i, (p, (t, top_p, seed)) in
                enumerate(zip(prompts, settings))]
    made = drive(kimi_engine.build(SPACE.make(DESIGNS["queue_all"]), PRESET, CPU), requests)
    for request in requests:
        assert request_problems(request, made[request.id], _ref, 1e-4, V) == []
    assert drive(kimi_engine.build(SPACE.make({"max_running": 1}), PRESET, CPU), requests) == made
    reseeded = [dataclasses.replace(r, seed=r.seed + 100) for r in requests]
    other = drive(kimi_engine.build(SPACE.default(), PRESET, CPU), reseeded)
    assert all(other[i] != made[i] for i in range(3)) and other[3] == made[3]


def test_the_baselines_decode_the_references_tokens():
    baselines = WORKLOAD.baselines(PRESET)
    assert "one_at_a_time" in baselines
    for name, make in baselines.items():
        assert score(_replay(make(CPU)), _ref, tolerance=1e-3, vocab=V) == [], name


def test_the_workload_hooks():
    assert WORKLOAD.contract == "generation" and WORKLOAD.presets()["cpu_small"] is PRESET
    assert SPACE.default().values()["max_running"] >= PRESET.shape["R"]
    assert {g.name for g in SPACE.genes} == {"max_running", "prefill_rows", "kda_prefill", "threads", "mla_cache",
                                             "mla_cache_dtype", "state_dtype", "state_layout", "conv_window",
                                             "moe_dispatch", "shared_expert", "fused_projections", "chunk_size",
                                             "intra_algorithm", "steps_per_exchange", "kda_kernel", "decode_step",
                                             "prefill_step"}
    assert WORKLOAD.exchange_steps(SPACE.make({"steps_per_exchange": 4})) == 4
    with pytest.raises(TypeError, match="build_generator"):
        WORKLOAD.build(SPACE.default(), PRESET, CPU)
    with pytest.raises(TypeError):
        WORKLOAD.make_inputs(WORKLOAD.timing_case(PRESET), "float32", "cpu", 0)
    assert WORKLOAD.with_trace(PRESET, {"concurrency": 2}).trace.concurrency == 2
    with pytest.raises(ValueError, match="unknown trace key"):
        WORKLOAD.with_trace(PRESET, {"nope": 1})
    from evo.workloads.base import MachineRates
    roof = WORKLOAD.roofline(PRESETS["cpu"], MachineRates(145e9, 4e9))
    assert roof.floor_ms > 0 and roof.flops == 2 * PRESETS["cpu"].model.active_parameters()
    assert "kimi_linear" in WORKLOAD.label(SPACE.default()) and WORKLOAD.engine_files(PRESET) == ()


def test_one_evaluation_through_the_judge_in_the_strict_sandbox_is_ok():
    from evaluators.judge.evaluator import Evaluator
    from evaluators.settings import EvaluatorSettings
    from evo.core.records import OK

    evaluator = Evaluator("kimi_linear", "cpu_small", EvaluatorSettings(replays=1, build_timeout_s=120,
                                                                        eval_timeout_s=240), seed=30, name="kimi-judge")
    try:
        genome = evaluator.workload.gene_space(evaluator.preset, evaluator.device_info()).default()
        result = evaluator.evaluate(genome.to_json())
    finally:
        evaluator.close()
    assert result.status == OK, result.message
    assert result.serving["completed"] == PRESET.trace.count


def test_the_prefill_recurrence_is_scripted_and_bit_identical_to_its_python_loop():
    """TorchScript runs the KDA prefill loop (torch 2.13 has it); its results are the Python loop's, bit for bit,
    and the delta rule's (float64, step by step)."""
    scripted = kimi_engine._recurrent_prefill
    assert isinstance(scripted, torch.jit.ScriptFunction)
    gen = torch.Generator().manual_seed(0)
    T, H, K = 9, 3, 8
    q, k, v = (torch.randn(T, H, K, generator=gen) for _ in range(3))
    decay, beta = torch.rand(T, H, K, generator=gen), torch.rand(T, H, generator=gen)
    got, python = scripted(q, k, v, decay, beta), kimi_engine._recurrence(q, k, v, decay, beta)
    S = torch.zeros(H, K, K, dtype=torch.float64)
    out = []
    for t in range(T):
        S = S * decay[t, :, :, None].double()
        residual = v[t].double() - torch.einsum("hk,hkv->hv", k[t].double(), S)
        S = S + beta[t, :, None, None].double() * k[t].double()[..., None] * residual[:, None]
        out.append(torch.einsum("hk,hkv->hv", q[t].double(), S))
    for ours, plain, exact in zip(got, python, (torch.stack(out), S)):
        assert torch.equal(ours, plain)
        assert (ours.double() - exact).abs().max() < 1e-5
