"""The llama engines' lossy genes (bfloat16 weights and KV at a float32 preset, int8 weights): marked lossy so an
exact-mode run never proposes them, built as they say (int8 rows really int8) and close to the float32 engine's
greedy tokens on the cpu_small preset."""
from __future__ import annotations

import pytest
import torch

from evo.core.genome import GenomeError
from evo.workloads.base import DeviceInfo
from evo.workloads.generation_core import cpu_kernels
from evo.workloads.generation import GenerationRequest
from evo.workloads.llama import genes as llama_genes
from evo.workloads.llama.int8 import Int8Weight, dequantised, int8pack, quantise_rows
from evo.workloads.llama_serve import WORKLOAD
from evo.workloads.llama_serve import engine as serve_engine
from evo.workloads.llama_serve.genes import gene_space, llama_genome
from evo.workloads.llama_serve.presets import PRESETS
from tests.generation_driver import TRACE, drive, trace_prompts

CPU = DeviceInfo("cpu", "cpu", 1)
PRESET = PRESETS["cpu_small"]
SPACE = gene_space(PRESET, CPU)
# 20 greedy requests (the engine tests' trace, two sets of prompts), up to 12 tokens each
REQUESTS = [GenerationRequest(10 * s + i, tuple(p), t.max_tokens)
            for s, seed in enumerate((3, 4)) for i, (p, t) in enumerate(zip(trace_prompts(PRESET.model.vocab, seed), TRACE))]


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    """Every test here on one torch thread (tests/conftest.py)."""


def test_the_lossy_values_are_marked_and_an_exact_space_leaves_them_out():
    lossy = {g.name: g.lossy for g in SPACE.genes if g.lossy}
    # the 16-bit kernels in the order this CPU favours (linear_kernels.cpu_kernel_order)
    sixteen = ("bf16_weights", "fp16_weights") if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (
        "fp16_weights", "bf16_weights")
    amx = {"native_products": ("amx",)} if cpu_kernels.amx_bf16_available() else {}  # offered where AMX runs
    assert lossy == {"kv_dtype": ("bfloat16",), "weight_dtype": ("bfloat16",), "weight_quant": ("int8",),
                     "linear_kernel": (*sixteen, "int8_dynamic", "q8_weights"), **amx}
    exact = SPACE.exact_only()
    assert exact.default() == SPACE.default()
    assert all(exact.gene(name).values == tuple(v for v in SPACE.gene(name).values if v not in values)
               for name, values in lossy.items())
    with pytest.raises(GenomeError, match="illegal value 'int8'"):
        exact.make({"weight_quant": "int8"})
    assert exact.make({"linear_kernel": "packed"})  # lossless: kept
    genome = SPACE.make({"weight_quant": "int8", "weight_dtype": "bfloat16", "kv_dtype": "bfloat16"})
    assert SPACE.lossy_values(genome.values()) == {"weight_quant": "int8", "weight_dtype": "bfloat16",
                                                   "kv_dtype": "bfloat16"}
    # the KV cache no wider than the weights, still
    with pytest.raises(GenomeError, match="kv_dtype='float32' with weight_dtype='bfloat16'"):
        SPACE.make({"weight_dtype": "bfloat16"})
    # a genome stored before weight_quant existed builds the engine it built then
    old = SPACE.default().to_dict()
    del old["memory"]["weight_quant"]
    assert SPACE.validate(SPACE.completed(type(SPACE.default()).from_dict(old))) == SPACE.default()


def test_lessons_stored_before_a_gene_was_added_still_seed_a_warm_start():
    """A warm start seeds the earlier run's best genomes; one stored before steps_per_exchange existed gets its
    default (a warm start once dropped every such genome as illegal and seeded random ones)."""
    from evo.core.effects import GeneEffects
    from evo.core.lessons import Lessons

    old = SPACE.make({"linear_kernel": "fp16_weights"}).to_dict()
    del old["scheduling"]["steps_per_exchange"]
    lessons = Lessons("llama_serve", "cpu_small", "cpu:cpu", ((old, 1.0),), {}, {}, GeneEffects())
    [(rank, genome, latency)] = lessons.legal_best(SPACE)
    assert genome == SPACE.make({"linear_kernel": "fp16_weights"}) and (rank, latency) == (0, 1.0)


def test_every_entry_point_searches_the_exact_space_of_an_exact_run():
    """search_space is what a run, `evo bench --sample` and `evo compare` draw from: at float32 in exact mode no
    lossy value (bench once drew a bfloat16 KV cache into an exact run), in budget mode all of them."""
    from evo.driver.config import load_config
    from evo.driver.rundir import search_space

    exact = load_config("configs/llama_serve_smoke.yaml", [])
    assert search_space(exact, WORKLOAD, PRESET, CPU).genes == SPACE.exact_only().genes
    budget = load_config("configs/llama_serve_smoke.yaml", ["evaluator.accuracy.mode=budget"])
    assert search_space(budget, WORKLOAD, PRESET, CPU).genes == SPACE.genes


def test_a_bfloat16_preset_has_no_lossy_dtype():
    bf16 = llama_genes.gene_space(PRESETS["h200"], DeviceInfo("cuda", "h200"))
    assert (bf16.gene("weight_dtype").lossy, bf16.gene("weight_quant").lossy) == ((), ("int8",))
    assert bf16.default()["weight_dtype"] == "bfloat16"


def test_int8_ignores_the_weight_layout_and_reaches_the_model_engine():
    int8 = SPACE.make({"weight_quant": "int8"})
    assert SPACE.make({"weight_quant": "int8", "weight_layout": "native_left"}) == int8
    assert SPACE.make({"weight_layout": "native_left"}) != SPACE.default()
    assert llama_genome(int8, PRESET, CPU)["weight_quant"] == "int8"
    assert "int8" in WORKLOAD.label(int8) and "int8" not in WORKLOAD.label(SPACE.default())


def test_quantised_rows_and_both_kernels_agree_with_the_float_product():
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 64, generator=gen), torch.randn(5, 64, generator=gen)
    w[3] = 0  # a zero row stays zero
    q, scale = quantise_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and (q[3] == 0).all()
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()  # round to nearest
    exact = x @ (q.float() * scale[:, None]).t()
    for kernel, dtype, tol in ((dequantised, torch.float32, 1e-5), (dequantised, torch.bfloat16, 2e-2),
                               (int8pack, torch.bfloat16, 2e-2)):
        got = kernel(x.to(dtype), q, scale.to(dtype)).float()
        assert (got - exact).abs().max() / exact.abs().max() < tol, (kernel.__name__, dtype)


def _agreement(genes: dict) -> float:
    """The share of the float32 engine's greedy tokens that the engine of `genes` makes too, position by position."""
    want = drive(serve_engine.build(SPACE.default(), PRESET, CPU), REQUESTS)
    got = drive(serve_engine.build(SPACE.make(genes), PRESET, CPU), REQUESTS)
    same = sum(a == b for r in want for a, b in zip(want[r], got[r]))
    return same / sum(len(t) for t in want.values())


def test_int8_weights_are_int8_and_its_tokens_mostly_agree_with_float32():
    for fused, per_layer in ((True, 4), (False, 7)):  # packed qkv and gate_up, or q, k, v, gate, up apart
        genes = {"weight_quant": "int8", "fused_qkv": fused, "fused_gate_up": fused}
        engine = serve_engine.build(SPACE.make(genes), PRESET, CPU).runner.engine
        projections = [w for layer in engine.layers for w in (*layer.values(), *layer["mlp"].values())
                       if not isinstance(w, (dict, torch.Tensor))]
        assert len(projections) == per_layer * PRESET.model.layers
        assert all(isinstance(w, Int8Weight) and w.q.dtype == torch.int8 for w in projections)
        assert engine.head.dtype == torch.float32  # the LM head stays in the activation dtype
    # a free-running greedy comparison: measured 0.89 over these 20 requests (0.78-1.0 per 10 on other prompts)
    assert _agreement({"weight_quant": "int8"}) >= 0.75


def test_bfloat16_weights_mostly_agree_with_float32():
    generator = serve_engine.build(SPACE.make({"weight_dtype": "bfloat16", "kv_dtype": "bfloat16"}), PRESET, CPU)
    assert generator.runner.engine.layers[0]["qkv"].dtype == generator.pool.k[0].dtype == torch.bfloat16
    # measured 0.85 over these 20 requests (0.83-1.0 per 10 on other prompts)
    assert _agreement({"weight_dtype": "bfloat16", "kv_dtype": "bfloat16"}) >= 0.75
    # both: measured 0.91 (0.76-1.0 per 10 on other prompts)
    assert _agreement({"weight_dtype": "bfloat16", "kv_dtype": "bfloat16", "weight_quant": "int8"}) >= 0.65


@pytest.mark.parametrize("T,masked", [(1, True), (3, False)])
def test_a_bfloat16_cache_is_attended_as_bfloat16_not_widened(T, masked):
    """kv_dtype=bfloat16 under float32 activations: SDPA reads the cache in bfloat16 (the queries narrowed), so a
    step reads half the cache's bytes instead of widening all of it first; close to float64's attention."""
    from types import SimpleNamespace

    from torch.utils._python_dispatch import TorchDispatchMode

    from evo.workloads.llama.open_stages.attention import attention

    gen = torch.Generator().manual_seed(0)
    B, H, KVH, S, d = 2, 6, 2, 9, 16
    q = torch.randn(B, H, T, d, generator=gen)
    k, v = (torch.randn(B, KVH, S, d, generator=gen).bfloat16() for _ in range(2))
    mask = torch.zeros(T, S).masked_fill_(torch.rand(T, S, generator=gen) < 0.3, float("-inf")) if masked else None
    if mask is not None:
        mask[:, -1] = 0  # every query sees a key

    class Widened(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape[-2:] == (S, d):
                self.seen.append(str(func))
            return out

    with Widened() as mode:
        got = attention(q, k, v, mask, SimpleNamespace(attention="sdpa"))
    assert got.dtype == torch.float32 and got.shape == (B, H, T, d)
    assert mode.seen == [], f"the cache was widened to float32: {mode.seen}"
    G = H // KVH
    kk, vv = (t.double().repeat_interleave(G, 1) for t in (k, v))
    scores = q.double() @ kk.transpose(-1, -2) * d**-0.5
    scores = scores + (mask.double() if mask is not None else torch.full((T, S), float("-inf")).triu(S - T + 1).double())
    want = scores.softmax(-1) @ vv
    assert (got.double() - want).abs().max() < 2e-2
