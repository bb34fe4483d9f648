"""The Kimi Linear generation presets: a model (`evo.workloads.kimi_linear.model`) and the request trace its
engines are judged under (`evo.core.trace`), whose bounds are the verified domain.

Shape, as `llama_serve`'s (`evo.workloads.llama_serve.presets`): R (the most requests in flight: the trace's
concurrency), P (the longest prompt), N (the most new tokens a request may ask for), V (the vocabulary). An
engine holds P + N positions per request (its MLA layers' latent cache; its KDA layers hold a fixed state).

Every fixed preset keeps the 48B model's layout: KDA, KDA, KDA, MLA repeated (`layer_types`), the first
feed-forward dense and the others mixtures of experts (`mlp_layer_types`), MLA without rotary embedding.
Besides them, `hf:<folder>[,R=4,P=24,N=12,count=12,dtype=float32,device=cpu]` names the `save_pretrained`
folder of a Kimi Linear checkpoint under a closed trace of `count` requests, R in flight, prompts 1 to P,
outputs 1 to N; `PresetTable` resolves it when named.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from evo.core.trace import TraceSpec
from evo.workloads.base import Preset
from evo.workloads.kimi_linear.model import DENSE, KDA, MLA, SPARSE, KimiSpec, read_checkpoint_spec
from evo.workloads.llama_serve.presets import PresetTable, ServePreset, checkpoint_options


@dataclass(frozen=True)
class KimiPreset(Preset):
    """A Kimi Linear model and the trace its generation engines are judged and timed on."""

    model: KimiSpec = field(default=None)  # type: ignore[assignment]
    trace: TraceSpec = field(default_factory=TraceSpec)

    # the same bounds as a Llama serving preset's, by the same code (they read only name, shape and trace)
    max_positions = ServePreset.max_positions
    with_trace = ServePreset.with_trace


def hybrid(layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The 48B model's layout for `layers` layers: every fourth layer MLA, the rest KDA; the first
    feed-forward dense, the rest mixtures of experts."""
    return (tuple(MLA if (i + 1) % 4 == 0 else KDA for i in range(layers)),
            tuple(DENSE if i == 0 else SPARSE for i in range(layers)))


def _spec(vocab: int, hidden: int, layers: int, intermediate: int, kda: tuple[int, int], mla: dict, moe: dict,
          dtype: str = "float32", seed: int = 0) -> KimiSpec:
    layer_types, mlp_types = hybrid(layers)
    return KimiSpec(vocab, hidden, layer_types, mlp_types, intermediate, kda_heads=kda[0], kda_head_dim=kda[1],
                    **mla, **moe, storage_dtype=dtype, weight_seed=seed)


def _preset(name: str, model: KimiSpec, trace: TraceSpec, dtype: str, device: str) -> KimiPreset:
    shape = {"R": max(1, trace.concurrency), "P": trace.prompt_len[1], "N": trace.output_len[1], "V": model.vocab}
    return KimiPreset(name, shape, dtype, device, model, trace)


PRESETS: dict[str, KimiPreset] = {p.name: p for p in (
    # tests: hidden 64, KDA 4 heads of 16, MLA 4 heads (nope 16, rope 8, v 16, latent 16), a dense MLP of 128
    # then 4 experts of 32 top-2 and one shared expert; vocabulary 256: 0.23 M parameters
    _preset("cpu_small", _spec(256, 64, 4, 128, (4, 16),
                               dict(mla_heads=4, kv_lora_rank=16, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16),
                               dict(experts=4, top_k=2, moe_intermediate=32)),
            TraceSpec("closed", count=12, concurrency=4, prompt_len=(1, 24), output_len=(1, 12)), "float32", "cpu"),
    # the CPU search: hidden 256, KDA 4 heads of 64, MLA 4 heads (nope 64, rope 32, v 64, latent 64), a dense
    # MLP of 688 then 8 experts of 128 top-2 and one shared expert; vocabulary 4096: 6.5 M parameters
    _preset("cpu", _spec(4096, 256, 4, 688, (4, 64),
                         dict(mla_heads=4, kv_lora_rank=64, qk_nope_dim=64, qk_rope_dim=32, v_head_dim=64),
                         dict(experts=8, top_k=2, moe_intermediate=128)),
            TraceSpec("closed", count=32, concurrency=16, prompt_len=(16, 256), output_len=(16, 64)), "float32", "cpu"),
    # Kimi-Linear-48B-A3B's layer shapes (transformers' KimiLinearConfig defaults: hidden 2304, KDA 32 heads of
    # 128, MLA 32 heads nope 128 / rope 64 / v 128 over a 512 latent, no q low rank, dense MLP 9216, experts of
    # 1024 with one shared, routed scale 2.446, vocabulary 163840) in 8 layers instead of 27 and 64 experts
    # top-8 instead of 256: 4.3 G parameters (1.2 G read a token, the LM head included), bfloat16
    _preset("h200", _spec(163840, 2304, 8, 9216, (32, 128),
                          dict(mla_heads=32, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128),
                          dict(experts=64, top_k=8, moe_intermediate=1024), dtype="bfloat16"),
            TraceSpec("closed", count=256, concurrency=64, prompt_len=(128, 1024), output_len=(64, 256)),
            "bfloat16", "cuda"),
)}


def _in_bfloat16(preset: KimiPreset) -> KimiPreset:
    """`preset`'s model stored in bfloat16 (the same seeded draw rounded; FP32_TENSORS kept float32) at a bfloat16
    preset, on the same device and trace: named <name>_bf16."""
    return _preset(f"{preset.name}_bf16", replace(preset.model, storage_dtype="bfloat16"), preset.trace, "bfloat16",
                   preset.device)


# the CPU models in bfloat16, for the accuracy contract's budget mode on a CPU (calibrated by honest_logits)
PRESETS.update({p.name: p for p in (_in_bfloat16(PRESETS["cpu_small"]), _in_bfloat16(PRESETS["cpu"]))})


def checkpoint_preset(name: str) -> KimiPreset:
    """`hf:<folder>[,key=value...]` (llama_serve's `checkpoint_options`: the same keys, defaults and trace) -> the
    preset of that Kimi Linear checkpoint; ValueError names the option that is wrong, or what the folder lacks."""
    options = checkpoint_options(name)
    return _preset(name, read_checkpoint_spec(options.folder), options.trace, options.dtype, options.device)


PRESET_TABLE = PresetTable(PRESETS, checkpoint_preset)  # what the workload's presets() will return: PRESETS and hf: names
