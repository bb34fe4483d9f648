"""The searched generation engine of llama_serve, replayed by the judge's own client (evaluators.judge.replay) on the
cpu_small trace and scored on its own tokens against the float64 reference: each scheduling and memory design
is right, a stop id ends a request, a request too long is refused, and batch mates change no request's tokens."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from evaluators.judge.replay import replay, score
from evo.core.genome import GenomeError
from evo.core.trace import TraceRequest
from evo.workloads.base import DeviceInfo
from evo.workloads.generation import GenerationRequest
from evo.workloads.llama.reference import generate
from evo.workloads.llama_serve import engine as serve_engine
from evo.workloads.llama_serve.genes import gene_space
from evo.workloads.llama_serve.presets import PRESETS
from tests.generation_driver import TRACE, drive, trace_prompts

CPU = DeviceInfo("cpu", "cpu", 1)
PRESET = PRESETS["cpu_small"]
V = PRESET.model.vocab
SPACE = gene_space(PRESET, CPU)


def _prompts(seed: int) -> list[list[int]]:
    return trace_prompts(V, seed)


PROMPTS = _prompts(12)


@functools.lru_cache(maxsize=None)
def _reference(prompt: tuple[int, ...], tokens: tuple[int, ...]) -> np.ndarray:
    """Row i: the float64 logits that predict tokens[i] (shared by every genome that makes the same tokens)."""
    continuation = torch.tensor([list(tokens[:-1])], dtype=torch.long)
    return generate(PRESET.model, torch.tensor([list(prompt)]), continuation)[0].numpy()


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def _replay(generator, prompts=PROMPTS, stop_ids: tuple[int, ...] = ()):
    return replay(generator, TRACE, prompts, concurrency=4, stop_ids=stop_ids, deadline_s=120)


def _record_logits(generator) -> dict[int, dict[int, torch.Tensor]]:
    """Request id -> {output index: the logits row its token was picked from}, recorded as the runner picks (a
    prefill's, a decode step's or a verify's; a later pick of an index, after a rejected draft, replaces it).
    cpu_small's tied-embedding model mostly repeats its last prompt token by a wide margin, so right tokens alone
    would not show a wrong mask or a misplaced row; the logits do."""
    runner, made = generator.runner, {}
    pick = runner._pick

    def keep(logits, picks):
        for row, (request, index) in zip(logits, picks):
            made.setdefault(request.id, {})[index] = row.clone()
        return pick(logits, picks)

    runner._pick = keep
    return made


def _rows(made: dict[int, torch.Tensor], count: int) -> torch.Tensor:
    """The logits rows of a request's first `count` tokens, [count, V]."""
    return torch.stack([made[i] for i in range(count)])


def _assert_logits_match(result, made: dict[int, dict[int, torch.Tensor]]) -> None:
    for request, tokens in zip(result.requests, result.tokens):
        ours = _rows(made[request.id], len(tokens)).double().numpy()
        ref = _reference(request.prompt, tokens)
        assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-5, request.id


def _knowing_drafter(prompts, tokens):
    """A drafter that knows the plain engine's tokens (for each prompt, the tokens it makes): at a context of n
    tokens it drafts the right ones, with one wrong when 3 divides n and none when 5 does. Prompt lookup seldom
    drafts for cpu_small's toy (its tokens rarely repeat); with this one every step verifies rows of drafts
    accepted, cut short and absent, the shorter rows padded."""
    fulls = [tuple(p) + tuple(t) for p, t in zip(prompts, tokens)]

    def draft(context: tuple[int, ...], k: int) -> tuple[int, ...]:
        n = len(context)
        full = next((f for f in fulls if f[:n] == context), None)
        if full is None or n % 5 == 0:
            return ()
        tokens = list(full[n:n + k])
        if n % 3 == 0 and tokens:
            wrong = (n // 3) % len(tokens)
            tokens[wrong] = (tokens[wrong] + 1) % V
        return tuple(tokens)

    return draft


DESIGNS = {
    "default": {},
    "static": {"batching": "static"},
    "chunked16": {"prefill": "chunked", "prefill_chunk": 16},
    "paged16": {"kv_pool": "paged", "kv_block": 16},
    "one_running": {"max_running": 1},
    "blhd": {"kv_layout": "BLHD"},
    "matmul": {"attention": "matmul"},
    # a queue (fewer rows than requests in flight), prompts chunked one request a step, blocks gathered BLHD
    "paged_chunked_queue": {"kv_pool": "paged", "kv_layout": "BLHD", "prefill": "chunked", "prefill_chunk": 16,
                            "max_prefills_per_step": 1, "max_running": 2},
    "halves_on_the_fly": {"rotary": "on_the_fly", "rotary_pairs": "halves", "fused_qkv": False,
                          "fused_gate_up": False, "norm_fused_residual": False, "weight_layout": "native_left"},
    "packed": {"linear_kernel": "packed"},  # oneDNN over weights reordered at load: lossless
    "packed_one_row": {"linear_kernel": "packed", "one_row_weights": True, "max_running": 1},  # one-row steps
    "speculation": {"speculation": "prompt_lookup", "spec_tokens": 4, "spec_min_ngram": 1},
    "together": {"prefill_rows": "together"},  # a step's prompts in one padded forward
    "traced": {"decode_step": "traced"},  # the static step, recorded per batch size and run by TorchScript
    "attention_kernel": {"decode_attention": "kernel"},  # our C kernel, each row over its own keys
    "attention_kernel_paged_blhd": {"decode_attention": "kernel", "kv_pool": "paged", "kv_layout": "BLHD"},
    "norm_kernel": {"norm_kernel": "kernel"},  # our C add + RMSNorm, the residual added in place
    "norm_kernel_apart": {"norm_kernel": "kernel", "norm_fused_residual": False, "decode_attention": "kernel"},
    # our C decode step, the whole forward in one call: every step, over the engine's own rows (fused slices); and
    # steps of up to 2 rows (more run eagerly on the same cache) over the checkpoint's weights loaded again
    # (pretransposed engine) with Llama's halves, a BLHD cache, drafts verified beside it
    "native": {"decode_step": "native", "native_max_rows": 64, "weight_layout": "native"},
    "native_reloaded_halves_blhd": {"decode_step": "native", "native_max_rows": 2, "rotary_pairs": "halves",
                                    "fused_qkv": False, "kv_layout": "BLHD", "speculation": "prompt_lookup",
                                    "spec_min_ngram": 1},
    # chunks of several requests in one forward over gathered blocks, a queue behind them
    "paged_chunked_together": {"kv_pool": "paged", "kv_layout": "BLHD", "prefill": "chunked", "prefill_chunk": 16,
                               "max_running": 2, "prefill_rows": "together"},
    # drafts verified over gathered blocks, beside prompts chunked into a queue
    "paged_chunked_speculation": {"kv_pool": "paged", "prefill": "chunked", "prefill_chunk": 16,
                                  "max_prefills_per_step": 1, "max_running": 2, "speculation": "prompt_lookup", "spec_min_ngram": 1,
                                  "spec_tokens": 8, "attention": "matmul"},
}


@pytest.mark.parametrize("design", sorted(DESIGNS))
def test_each_design_decodes_its_own_tokens_as_the_float64_reference_does(design):
    assert max(t.prompt_len for t in TRACE) > 16  # chunked designs prefill over several steps
    generator = serve_engine.build(SPACE.make(DESIGNS[design]), PRESET, CPU)
    if generator.policy.spec_tokens:
        plain = _replay(serve_engine.build(SPACE.default(), PRESET, CPU))
        generator.drafter = _knowing_drafter([r.prompt for r in plain.requests], plain.tokens)
    made = _record_logits(generator)
    result = _replay(generator)
    assert score(result, _reference, tolerance=1e-4, vocab=V) == []
    assert [len(t) for t in result.tokens] == [r.max_tokens for r in result.requests]
    _assert_logits_match(result, made)


@pytest.mark.parametrize("rows", ["each", "together"])
@pytest.mark.parametrize("pool", ["slots", "paged"])
def test_rows_moved_and_swapped_keep_their_requests_keys(pool, rows):
    """A burst of short and chunked long prompts: a short one finishes its prefill before a long one admitted
    before it and swaps rows with it; requests that end leave holes the last decoding rows move into. With
    prefill_rows=together the chunks of a step go through one forward, rows not the pool's first among them."""
    trace = [TraceRequest(i, 0.0, p, n) for i, (p, n) in enumerate(((20, 6), (3, 9), (18, 2), (2, 12), (24, 12),
                                                                     (1, 3)))]
    rng = np.random.default_rng(14)
    prompts = [rng.integers(0, V, t.prompt_len).tolist() for t in trace]
    generator = serve_engine.build(SPACE.make({"prefill": "chunked", "prefill_chunk": 16, "max_running": 4,
                                               "kv_pool": pool, "prefill_rows": rows}), PRESET, CPU)
    calls = {"move": 0, "swap": 0}
    for name in calls:
        def counted(*args, _do=getattr(generator.pool, name), _name=name):
            calls[_name] += 1
            return _do(*args)
        setattr(generator.pool, name, counted)
    batches = []
    if rows == "together":
        def recorded(rows, *args, _do=generator.runner.prefill_rows):
            batches.append(list(rows))
            return _do(rows, *args)
        generator.runner.prefill_rows = recorded
    made = _record_logits(generator)
    result = replay(generator, trace, prompts, deadline_s=120)
    assert score(result, _reference, tolerance=1e-4, vocab=V) == []
    _assert_logits_match(result, made)
    assert calls["move"] and calls["swap"], calls
    if rows == "together":  # several rows a forward, some of them behind the decoding ones
        assert any(len(b) > 1 for b in batches) and any(b != list(range(len(b))) for b in batches), batches


def test_the_static_shape_step_matches_the_reference():
    """The compiled step's math (the batch padded to a power of two, every pool position under the mask),
    run uncompiled so it costs no build."""
    generator = serve_engine.build(SPACE.default(), PRESET, CPU)
    generator.runner.compiled = generator.runner._static_step
    made = _record_logits(generator)
    result = _replay(generator)
    assert score(result, _reference, tolerance=1e-4, vocab=V) == []
    _assert_logits_match(result, made)


def test_speculation_accepts_drafts_and_makes_the_tokens_of_plain_decoding():
    """With one-token matches prompt lookup drafts on cpu_small (seldom: its toy has its own LM head): a speculative
    replay verifies drafts, accepts some, and makes the tokens the plain engine makes, greedy and sampled alike
    (each pick the same seeded draw), for the pool of slots and the paged one."""
    plain = _replay(serve_engine.build(SPACE.default(), PRESET, CPU))
    for design in ("speculation", "paged_chunked_speculation"):
        generator = serve_engine.build(SPACE.make(DESIGNS[design]), PRESET, CPU)
        verify, accepted = generator.runner.verify, []

        def counted(fed, positions, picks, _verify=verify):
            picked = _verify(fed, positions, picks)
            for tokens, row in zip(fed, picked):  # the draft's tokens the picks agreed with, in a run
                accepted.append(next((j for j in range(1, len(tokens)) if tokens[j] != row[j - 1]), len(tokens)) - 1)
            return picked

        generator.runner.verify = counted
        result = _replay(generator)
        assert result.tokens == plain.tokens and not result.violations, design
        assert sum(accepted) >= 1, (design, accepted)
    rng = np.random.default_rng(22)
    requests = [GenerationRequest(i, tuple(rng.integers(0, V, n).tolist()), 12, (), t, top_p, seed)
                for i, (n, t, top_p, seed) in enumerate(((5, 1.0, 1.0, 3), (17, 0.7, 0.9, 4), (1, 0.0, 1.0, 0)))]
    sampled = drive(serve_engine.build(SPACE.make(DESIGNS["speculation"]), PRESET, CPU), requests)
    assert sampled == drive(serve_engine.build(SPACE.default(), PRESET, CPU), requests)


@pytest.mark.parametrize("pool", ["slots", "paged"])
def test_a_row_at_the_pools_end_verifies_beside_a_long_draft(pool):
    """A request that takes every position of the pool decodes beside one drafting 8 tokens: its own draft is cut
    to its tokens left, and its row's pads stop at the pool's last position."""
    bound = PRESET.max_positions
    requests = [GenerationRequest(0, tuple(range(7, bound - 3 + 7)), 3), GenerationRequest(1, (5, 9, 2), 12)]
    plain = drive(serve_engine.build(SPACE.default(), PRESET, CPU), requests)
    design = {"speculation": "prompt_lookup", "spec_tokens": 8, "kv_pool": pool}
    generator = serve_engine.build(SPACE.make(design), PRESET, CPU)
    generator.drafter = _knowing_drafter([r.prompt for r in requests], [plain[r.id] for r in requests])
    widths = []
    verify = generator.runner.verify
    generator.runner.verify = lambda fed, *args: widths.append([len(f) for f in fed]) or verify(fed, *args)
    made = _record_logits(generator)
    assert drive(generator, requests) == plain
    assert widths[0][0] <= 2 and max(widths[0]) > 3, widths  # request 0 drafts 1, its row padded past the end
    for request in requests:
        ours = _rows(made[request.id], len(plain[request.id])).double().numpy()
        ref = _reference(request.prompt, tuple(plain[request.id]))
        assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-5, request.id


def test_a_stop_id_ends_its_request_on_that_token():
    """Stop ids met at the first token (the prefill's) and later (a decode step's): the request ends there."""
    prompts = [[7, 3, 47], [7, 3, 42], [7, 3, 64], [7, 3, 32]] + PROMPTS[:4]  # the first four change token midway
    trace = [TraceRequest(i, 0.0, len(p), 12) for i, p in enumerate(prompts)]
    plain = replay(serve_engine.build(SPACE.default(), PRESET, CPU), trace, prompts, deadline_s=120)
    later = {tokens[i] for tokens in plain.tokens for i in range(1, len(tokens)) if tokens[i] != tokens[0]}
    stops = (*sorted(later), plain.tokens[4][0])
    result = replay(serve_engine.build(SPACE.default(), PRESET, CPU), trace, prompts, stop_ids=stops, deadline_s=120)
    assert score(result, _reference, tolerance=1e-4, vocab=V) == [] and not result.violations
    ends = []
    for tokens, stopped in zip(plain.tokens, result.tokens):
        first = next((i for i, t in enumerate(tokens) if t in stops), len(tokens) - 1)
        assert stopped == tokens[:first + 1]
        ends.append(first)
    assert ends[4] == 0 and any(0 < end < 11 for end in ends), ends  # at a prefill and at a decode step


def test_a_request_longer_than_the_pool_is_refused_naming_the_bound():
    generator = serve_engine.build(SPACE.default(), PRESET, CPU)
    bound = PRESET.max_positions
    generator.add(GenerationRequest(0, (1,) * (bound - 1), 1))  # exactly fits
    with pytest.raises(ValueError, match=f"over the {bound} positions"):
        generator.add(GenerationRequest(1, (1,) * bound, 1))


def test_a_requests_tokens_do_not_depend_on_its_batch_mates():
    """The same requests one at a time and four together: the same tokens, from the same logits."""
    alone, together = (serve_engine.build(SPACE.make({"max_running": m}), PRESET, CPU) for m in (1, 4))
    alone_logits, together_logits = _record_logits(alone), _record_logits(together)
    assert _replay(alone, _prompts(13)).tokens == _replay(together, _prompts(13)).tokens
    for request_id, rows in alone_logits.items():
        a, b = _rows(rows, len(rows)), _rows(together_logits[request_id], len(rows))
        assert (a - b).abs().max() <= 1e-5 * a.abs().max(), request_id


def test_the_default_genome_is_the_plain_engine_and_rules_name_their_genes():
    default = SPACE.default().values()
    assert (default["batching"], default["prefill"], default["kv_pool"], default["decode_step"]) == (
        "continuous", "whole", "slots", "eager")
    assert default["max_running"] >= PRESET.shape["R"]
    assert "kv_alloc" not in default
    assert SPACE.make({"prefill_chunk": 16}) == SPACE.default()  # ignored with prefill=whole
    assert SPACE.make({"kv_block": 64}) == SPACE.default()  # ignored with kv_pool=slots
    assert SPACE.make({"spec_tokens": 8}) == SPACE.default()  # ignored with speculation=off
    assert default["speculation"] == "off" and serve_engine.build(SPACE.default(), PRESET, CPU).policy.spec_tokens == 0
    old = SPACE.default().to_dict()  # a genome stored before speculation was a gene builds the engine it built then
    for name in ("speculation", "spec_tokens"):
        del old["scheduling"][name]
    assert SPACE.validate(SPACE.completed(type(SPACE.default()).from_dict(old))) == SPACE.default()
    cuda = gene_space(PRESET, DeviceInfo("cuda", "h200"))
    with pytest.raises(GenomeError, match="kv_pool=slots or decode_step=eager"):
        cuda.make({"decode_step": "compiled", "kv_pool": "paged"})
    with pytest.raises(GenomeError, match="kv_pool=slots or decode_step=eager"):
        SPACE.make({"decode_step": "traced", "kv_pool": "paged"})
    for kernel in ("packed", "int8_dynamic"):  # prepacked weights cannot be held by a trace
        with pytest.raises(GenomeError, match="set linear_kernel=torch or decode_step=eager"):
            SPACE.make({"decode_step": "traced", "linear_kernel": kernel})
    assert SPACE.make({"decode_step": "traced", "weight_quant": "int8"})  # int8 through torch's ops traces
    with pytest.raises(GenomeError, match="set decode_step=eager or decode_attention=stage"):
        SPACE.make({"decode_step": "traced", "decode_attention": "kernel"})
    with pytest.raises(GenomeError, match="set weight_dtype=float32 or norm_kernel=stage"):
        SPACE.make({"norm_kernel": "kernel", "weight_dtype": "bfloat16", "kv_dtype": "bfloat16"})
    assert "decode_attention" not in {g.name for g in cuda.genes}  # a CPU kernel
    with pytest.raises(GenomeError, match="kv_pool=slots or decode_step=eager"):
        SPACE.make({"decode_step": "native", "kv_pool": "paged"})
    for genes in ({"linear_kernel": "packed"}, {"weight_quant": "int8"},
                  {"weight_dtype": "bfloat16", "kv_dtype": "bfloat16"}):  # weights the C step does not read
        with pytest.raises(GenomeError, match="decode_step='native' reads float32 weights.*or decode_step=eager"):
            SPACE.make({"decode_step": "native", **genes})
    assert SPACE.make({"native_max_rows": 1}) == SPACE.default()  # ignored unless decode_step=native
    one_row = {"decode_step": "native", "max_running": 1}  # and at one row (a one-stream sweep wasted runs on it)
    assert SPACE.make({**one_row, "native_max_rows": 8}) == SPACE.make(one_row)
    assert SPACE.make({"decode_step": "native", "native_max_rows": 8}) != SPACE.make({"decode_step": "native"})
    assert "native" not in next(g for g in cuda.genes if g.name == "decode_step").values


def test_the_shared_genes_reach_the_model_engine():
    generator = serve_engine.build(SPACE.make({"kv_layout": "BLHD", "attention": "matmul"}), PRESET, CPU)
    plan = generator.runner.engine.plan
    assert (plan.kv_layout, plan.attention, plan.decode_step) == ("BLHD", "matmul", "eager")
    assert generator.num_threads == SPACE.default()["threads"]


def test_sampled_requests_are_the_seeded_draw_the_judge_checks():
    """Temperature and top_p per request, batched with greedy ones: every token passes the judge's sampling check
    against the float64 reference; the same seed draws the same tokens, another seed others."""
    from evaluators.judge.replay import request_problems

    rng = np.random.default_rng(21)
    prompts = [tuple(rng.integers(0, V, n).tolist()) for n in (5, 17, 1, 9)]
    settings = [(1.0, 1.0, 3), (0.7, 0.9, 4), (1.5, 0.5, 5), (0.0, 1.0, 0)]
    requests = [GenerationRequest(i, p, 12, (), t, top_p, seed) for i, (p, (t, top_p, seed)) in
                enumerate(zip(prompts, settings))]
    made = drive(serve_engine.build(SPACE.default(), PRESET, CPU), requests)
    for request in requests:
        assert request_problems(request, made[request.id], lambda p, t: _reference(tuple(p), tuple(t)), 1e-4, V) == []
    again = drive(serve_engine.build(SPACE.make({"max_running": 1}), PRESET, CPU), requests)
    assert again == made
    reseeded = [GenerationRequest(r.id, r.prompt, r.max_tokens, (), r.temperature, r.top_p, r.seed + 100)
                for r in requests]
    other = drive(serve_engine.build(SPACE.default(), PRESET, CPU), reseeded)
    assert all(other[i] != made[i] for i in range(3)) and other[3] == made[3]
    greedy = [GenerationRequest(r.id, r.prompt, r.max_tokens) for r in requests]
    assert drive(serve_engine.build(SPACE.default(), PRESET, CPU), greedy)[0] != made[0]


@pytest.mark.parametrize("design", ["default", "paged_chunked_queue"])
def test_an_aborted_request_gets_no_token_and_frees_its_row(design):
    """Abort a request before its first step, one after its first token and one mid-decode: none gets a token
    after, the others' tokens are unchanged, and every row is free at the end."""
    generator = serve_engine.build(SPACE.make(DESIGNS[design]), PRESET, CPU)
    requests = [GenerationRequest(i, tuple(p), 12) for i, p in enumerate(PROMPTS[:6])]
    alone = drive(serve_engine.build(SPACE.make(DESIGNS[design]), PRESET, CPU), requests)
    made = drive(generator, requests, abort_after={1: 3, 4: 0, 5: 1})
    assert made[4] == [] and made[1] == alone[1][:3] and made[5] == alone[5][:1]
    assert all(made[i] == alone[i] for i in (0, 2, 3))
    assert generator.held == 0 and generator.free_rows == set(range(generator.plan.max_running))


def test_q8_weights_decode_as_the_float64_model_of_the_values_they_hold(monkeypatch):
    """linear_kernel=q8_weights (lossy: int8 in groups of 32; cpu_small's 64 and 176 inputs end in a group of 16): the
    C step reads the int8 rows (steps of up to 2 rows), prefill and larger steps multiply their dequantised values
    (as bf16_weights where bfloat16 is native: rounded once more). Its own tokens are the greedy picks of the float64
    model over the held values (the checkpoint's embedding, every projection and the LM head quantised) and its
    logits that model's within the rounding of a bfloat16 prefill; with a float32 prefill within 1e-4 (the C step's
    products read the activations as int16, a scale per 32), where the checkpoint's model is 1e-3 or more away."""
    from evo.workloads.llama import reference as llama_reference
    from evo.workloads.llama.int8 import dequantised_groups, quantise_groups
    from evo.workloads.llama.model import lm_head, load_weights

    weights = load_weights(PRESET.model)
    held = {name: (dequantised_groups(*quantise_groups(w)) if w.dim() == 2 and "embed" not in name else w).double()
            for name, w in weights.items()}
    held["lm_head.weight"] = dequantised_groups(*quantise_groups(lm_head(weights))).double()
    for bf16_prefill in (True, False):
        with monkeypatch.context() as patch:
            patch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: bf16_prefill)
            generator = serve_engine.build(SPACE.make({"linear_kernel": "q8_weights", "decode_step": "native",
                                                       "native_max_rows": 2}), PRESET, CPU)
        assert isinstance(generator.runner.native, serve_engine.cpu_kernels.LlamaDecodeStep)
        made = _record_logits(generator)
        result = _replay(generator)
        checkpoints = {request.id: _reference(tuple(request.prompt), tuple(tokens))
                       for request, tokens in zip(result.requests, result.tokens)}
        errors, wrong = [], []
        with monkeypatch.context() as patch:
            patch.setattr(llama_reference, "float64_weights", lambda spec: held)
            for request, tokens in zip(result.requests, result.tokens):
                continuation = torch.tensor([list(tokens[:-1])], dtype=torch.long)
                ref = generate(PRESET.model, torch.tensor([list(request.prompt)]), continuation)[0].numpy()
                ours = _rows(made[request.id], len(tokens)).double().numpy()
                errors.append(np.abs(ours - ref).max() / np.abs(ref).max())
                wrong.append(np.abs(ours - checkpoints[request.id]).max() / np.abs(ref).max())
                assert list(np.argmax(ref, 1)) == list(tokens), request.id  # the held model's greedy picks
        assert max(errors) < (2e-2 if bf16_prefill else 1e-4), (bf16_prefill, max(errors))
        if not bf16_prefill:  # within 1e-4 of the held model, 1e-3 or more off the checkpoint's: int8 it is
            assert max(wrong) > 1e-3, max(wrong)
    with pytest.raises(GenomeError, match="q8_weights' is read as int8 only by our C step"):
        SPACE.make({"linear_kernel": "q8_weights"})


@pytest.mark.skipif(not serve_engine.cpu_kernels.amx_bf16_available(), reason="this CPU has no AMX-BF16 tiles")
def test_amx_products_decode_as_the_float64_model_of_bfloat16_weights():
    """native_products=amx (lossy: bfloat16 weights as AMX tiles, each product's rows rounded to bfloat16): every step
    in C (native_max_rows 16); the engine's own tokens are the greedy picks of the float64 model over the bfloat16
    weights, its logits that model's within the rounding of bfloat16 activations."""
    from evo.workloads.llama import reference as llama_reference
    from evo.workloads.llama.model import lm_head, load_weights

    weights = load_weights(PRESET.model)
    held = {name: (w.to(torch.bfloat16) if w.dim() == 2 and "embed" not in name else w).double()
            for name, w in weights.items()}
    held["lm_head.weight"] = lm_head(weights).to(torch.bfloat16).double()
    generator = serve_engine.build(SPACE.make({"linear_kernel": "bf16_weights", "decode_step": "native",
                                               "native_max_rows": 16, "native_products": "amx"}), PRESET, CPU)
    assert int(generator.runner.native.dims[8]) == serve_engine.cpu_kernels.llama_decode_step.AMX_FORMAT
    made = _record_logits(generator)
    result = _replay(generator)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llama_reference, "float64_weights", lambda spec: held)
        for request, tokens in zip(result.requests, result.tokens):
            continuation = torch.tensor([list(tokens[:-1])], dtype=torch.long)
            ref = generate(PRESET.model, torch.tensor([list(request.prompt)]), continuation)[0].numpy()
            ours = _rows(made[request.id], len(tokens)).double().numpy()
            assert np.abs(ours - ref).max() < 2e-2 * np.abs(ref).max(), request.id
            assert list(np.argmax(ref, 1)) == list(tokens), request.id
    with pytest.raises(GenomeError, match="native_products='amx' multiplies bfloat16 weights in our C step"):
        SPACE.make({"linear_kernel": "bf16_weights", "native_products": "amx"})
