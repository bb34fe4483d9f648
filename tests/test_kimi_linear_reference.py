"""The Kimi Linear float64 reference (evo/workloads/kimi_linear/reference.py) against transformers' own
`KimiLinearForCausalLM` on the same weights: teacher-forced logits, greedy decoding (transformers' cached
decode path: the convolution's update and the recurrent KDA step), a `save_pretrained` folder read back as an
`hf:` preset, and configs the reference cannot honour refused by field name.

transformers computes its RMSNorms, the gated output norm, the forget gate, the router and both KDA kernels in
float32 whatever the model's dtype, so its float64 model agrees with a float64 oracle only to ~2e-6.
`float64_throughout` lifts exactly those casts (the module's `torch.float32` reads as float64, and `.float()`
of a float64 tensor is a no-op) for the strict comparison; the unpatched model is compared at float32's
tolerance beside it, so the lift changes precision, not the math.
"""
from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import pytest
import torch

pytest.importorskip("transformers.models.kimi_linear", reason="transformers >= 5.24 ships KimiLinearForCausalLM")

from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear  # noqa: E402

from evo.workloads.kimi_linear import model as km  # noqa: E402
from evo.workloads.kimi_linear import reference  # noqa: E402
from evo.workloads.kimi_linear.model import DENSE, KDA, MLA, SPARSE, KimiSpec  # noqa: E402
from evo.workloads.kimi_linear.presets import PRESET_TABLE, PRESETS  # noqa: E402
from tests.models import KIMI_VARIANT as VARIANT  # noqa: E402  (every branch cpu_small leaves out)

torch.set_num_threads(1)

SMALL = PRESETS["cpu_small"].model


class _Float64Torch(types.ModuleType):
    """`torch` as transformers' Kimi Linear module sees it, with float32 reading as float64."""

    float32 = torch.float64

    def __getattr__(self, name: str):
        return getattr(torch, name)


@pytest.fixture
def float64_throughout(monkeypatch):
    monkeypatch.setattr(modeling_kimi_linear, "torch", _Float64Torch("torch"))
    to_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda self, *a, **k: self if self.dtype == torch.float64
                        else to_float(self, *a, **k))


def _hf_model(spec: KimiSpec, dtype=torch.float64) -> KimiLinearForCausalLM:
    config = km.hf_config(spec)
    config._experts_implementation = "eager"  # the grouped-mm experts take no float64
    model = KimiLinearForCausalLM(config)
    model.load_state_dict(km.load_weights(spec), strict=True)
    return model.to(dtype).eval()


@pytest.fixture(scope="module")
def hf_small() -> KimiLinearForCausalLM:
    return _hf_model(SMALL)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("spec", [SMALL, VARIANT, PRESETS["cpu"].model, PRESETS["h200"].model],
                         ids=["cpu_small", "variant", "cpu", "h200"])
def test_weight_names_and_shapes_are_transformers_own(spec):
    with torch.device("meta"):  # shapes only: the h200 model has 4.3 G parameters
        model = KimiLinearForCausalLM(km.hf_config(spec))
    assert {n: tuple(t.shape) for n, t in model.state_dict().items()} == spec.shapes()
    assert spec.parameters() == sum(t.numel() for t in model.state_dict().values())  # the router bias a buffer


@pytest.mark.parametrize("spec,T", [(SMALL, 70), (VARIANT, 33)], ids=["cpu_small", "variant"])
def test_teacher_forced_logits_equal_transformers_float64(spec, T, float64_throughout):
    ids = torch.randint(0, spec.vocab, (T,), generator=torch.Generator().manual_seed(T))
    ids[:2] = torch.tensor([0, spec.vocab - 1])
    ours = reference.logits(spec, reference.float64_weights(spec), ids)  # [T, V]
    model = _hf_model(spec)
    with torch.no_grad():
        theirs = model(ids[None]).logits[0]  # T=70 > 64: transformers' chunked KDA over two chunks
    assert ours.dtype == theirs.dtype == torch.float64 and ours.shape == (T, spec.vocab)
    assert _rel(ours, theirs) < 1e-9


def test_transformers_as_shipped_agrees_to_float32(hf_small):
    ids = torch.randint(0, SMALL.vocab, (24,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs = hf_small(ids[None]).logits[0]
    err = _rel(reference.logits(SMALL, reference.float64_weights(SMALL), ids), theirs)
    assert 1e-9 < err < 1e-4  # its float32 islands show, and nothing else


def test_greedy_decode_equals_transformers_generate(hf_small, float64_throughout):
    preset = PRESETS["cpu_small"]
    gen = torch.Generator().manual_seed(11)
    for P in (1, 7, 20):
        prompt = torch.randint(0, SMALL.vocab, (P,), generator=gen).tolist()
        with torch.no_grad():
            theirs = hf_small.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8)[0, P:].tolist()
        ours: list[int] = []
        for _ in range(8):  # the row past the last token predicts the next one
            ours.append(int(np.argmax(reference.continuation_logits(preset, prompt, [*ours, 0])[-1])))
        assert ours == theirs, f"prompt of {P}"
        rows = reference.continuation_logits(preset, prompt, ours)
        assert rows.shape == (8, SMALL.vocab) and [int(r.argmax()) for r in rows] == ours


def test_continuation_logits_rows_and_empty():
    preset = PRESETS["cpu_small"]
    full = reference.logits(SMALL, reference.float64_weights(SMALL), torch.tensor([3, 4, 5, 6]))
    np.testing.assert_array_equal(reference.continuation_logits(preset, [3, 4], [5, 6, 7]), full[1:].numpy())
    assert reference.continuation_logits(preset, [3], []).shape == (0, SMALL.vocab)


def test_save_pretrained_folder_reads_back_as_hf_preset(tmp_path):
    _hf_model(VARIANT, torch.float32).save_pretrained(tmp_path)
    preset = PRESET_TABLE[f"hf:{tmp_path},R=2,P=30,N=6,count=5"]
    assert preset.shape == {"R": 2, "P": 30, "N": 6, "V": VARIANT.vocab} and preset.trace.count == 5
    assert dataclasses.replace(preset.model, checkpoint=None, weight_seed=VARIANT.weight_seed) == VARIANT
    weights = km.load_weights(preset.model)
    assert all(torch.equal(weights[n], w) for n, w in km.load_weights(VARIANT).items())
    prompt, tokens = [5, 0, 127, 9], [1, 2, 3]
    np.testing.assert_array_equal(reference.continuation_logits(preset, prompt, tokens),
                                  reference.continuation_logits(dataclasses.replace(preset, model=VARIANT), prompt, tokens))
    with pytest.raises(ValueError, match="option 'B=2'"):
        PRESET_TABLE[f"hf:{tmp_path},B=2"]


def _saved_config() -> dict:
    return json.loads(KimiLinearConfig(**{k: v for k, v in km.hf_config(SMALL).to_dict().items()
                                          if k != "transformers_version"}).to_json_string())


@pytest.mark.parametrize("field,value", [
    ("model_type", "llama"), ("hidden_act", "gelu"), ("attention_bias", True), ("tie_word_embeddings", True),
    ("num_key_value_heads", 2), ("mla_use_nope", False), ("moe_router_activation_func", "softmax"),
    ("topk_method", "greedy"), ("layer_types", ["linear_attention"] * 3 + ["sliding_attention"]),
    ("mlp_layer_types", ["dense"] * 3), ("num_experts_per_token", 9)])
def test_an_unsupported_config_is_refused_naming_the_field(tmp_path, field, value):
    config = {**_saved_config(), field: value}
    with pytest.raises(ValueError, match=field):
        km.spec_from_config(config)
    if field == "hidden_act":  # and through a preset name, before any weight is read
        (tmp_path / "config.json").write_text(json.dumps(config))
        (tmp_path / "model.safetensors").write_bytes(b"")
        with pytest.raises(ValueError, match="hidden_act='gelu'"):
            PRESET_TABLE[f"hf:{tmp_path}"]


def test_the_original_checkpoint_config_form_reads_as_transformers_does():
    """Moonshot's config.json names (linear_attn_config with 1-indexed layer lists, first_k_dense_replace,
    num_experts...) give the same model as transformers' own reading of that dict."""
    original = {"model_type": "kimi_linear", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                "moe_intermediate_size": 32, "num_hidden_layers": 5, "num_attention_heads": 4,
                "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True, "num_experts": 4,
                "num_experts_per_token": 2, "num_shared_experts": 1, "moe_router_activation_func": "sigmoid",
                "moe_renormalize": True, "routed_scaling_factor": 2.446, "first_k_dense_replace": 2,
                "moe_layer_freq": 1, "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
                "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                "linear_attn_config": {"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4], "num_heads": 2,
                                       "head_dim": 32, "short_conv_kernel_size": 3}}
    ours = km.spec_from_config(original)
    theirs = km.spec_from_config(KimiLinearConfig(**original).to_dict())
    assert ours == theirs
    assert ours.layer_types == (KDA, KDA, KDA, MLA, KDA) and ours.mlp_types == (DENSE, DENSE, SPARSE, SPARSE, SPARSE)
    assert (ours.kda_heads, ours.kda_head_dim, ours.conv_kernel) == (2, 32, 3)
    with pytest.raises(ValueError, match="linear_attn_config.full_attn_layers"):
        km.spec_from_config({**original, "linear_attn_config": {"kda_layers": [1, 2, 3, 4], "full_attn_layers": [6]}})


def test_a_router_near_tie_taken_the_other_way_is_read_as_rounding_and_no_other_choice_is():
    """An MoE router's top-k is a cliff: an honest float32 engine whose scores sit 1e-6 from the float64 ones
    picks the other expert where two are that close, and its next token may then differ from the first reading's
    by far more than the logits' near-tie tolerance (measured at cpu: 5 choices in 18000 within 1e-5, and one
    such flip failed a final re-timing). Tokens decoded greedily under the nearest tie flipped pass only through
    the reference's other readings, and only while that gap counts as a tie."""
    from evo.workloads.generation import GenerationRequest
    from evaluators.judge.replay import request_problems

    preset, w, n = PRESETS["cpu_small"], reference.float64_weights(SMALL), 8
    moe_layers = [i for i, ffn in enumerate(SMALL.mlp_types) if ffn != DENSE]

    def greedy(prompt, routing=lambda: None):
        tokens = []
        for _ in range(n):
            row = reference.logits(SMALL, w, torch.tensor([*prompt, *tokens]), routing())[-1]
            tokens.append(int(row.argmax()))
        return tokens

    rng = np.random.default_rng(5)
    for _ in range(40):  # prompts until the nearest tie at a generated position changes a greedy token
        prompt = rng.integers(0, SMALL.vocab, 6).tolist()
        first = greedy(prompt)
        noted = {i: reference._Routing(tie=1.0) for i in moe_layers}
        reference.logits(SMALL, w, torch.tensor([*prompt, *first[:-1]]), noted)
        gap, layer, t = min((gap, i, t) for i, r in noted.items() for gap, t in r.ties if t >= len(prompt) - 1)
        flipped = greedy(prompt, lambda: {i: reference._Routing(frozenset([t] if i == layer else [])) for i in moe_layers})
        if flipped != first:
            break
    else:
        pytest.fail("no near tie changed a greedy token in 40 prompts")
    request = GenerationRequest(0, tuple(prompt), n)

    def judged(tie: float) -> list[str]:
        saved = dict(reference.ROUTING_TIE)
        reference.ROUTING_TIE["float32"] = tie
        try:
            return request_problems(request, flipped, lambda p, s: reference.continuation_logits(preset, p, s), 1e-3,
                                    SMALL.vocab, lambda p, s: reference.continuation_alternatives(preset, p, s))
        finally:
            reference.ROUTING_TIE.update(saved)

    assert request_problems(request, flipped, lambda p, s: reference.continuation_logits(preset, p, s), 1e-3,
                            SMALL.vocab)  # the first reading alone rejects them
    assert judged(gap * 1.0001) == []  # that gap a tie: read the other way, they pass
    rejected = judged(gap * 0.9999)  # not a tie: no reading excuses them
    assert rejected and "step" in rejected[0], rejected
    assert first == [int(np.argmax(r)) for r in reference.continuation_logits(preset, prompt, first)]
