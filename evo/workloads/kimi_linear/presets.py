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

from dataclasses import dataclass, field
from pathlib import Path

from evo.core.trace import TraceSpec
from evo.workloads.base import Preset
from evo.workloads.kimi_linear.model import DENSE, KDA, MLA, SPARSE, KimiSpec, read_checkpoint_spec
from evo.workloads.llama.model import CHECKPOINT_PREFIX
from evo.workloads.llama.model import PresetTable as _LlamaPresetTable
from evo.workloads.llama_serve.presets import CHECKPOINT_DEFAULTS, ServePreset


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


_CHOICES = {"dtype": ("float32", "bfloat16"), "device": ("cpu", "cuda")}


def checkpoint_preset(name: str) -> KimiPreset:
    """`hf:<folder>[,key=value...]` (keys and defaults: llama_serve's CHECKPOINT_DEFAULTS) -> the preset of that
    Kimi Linear checkpoint, judged on a closed trace of `count` requests, R in flight, prompts 1 to P, outputs
    1 to N. ValueError names the option that is wrong and what is allowed, or what the folder lacks."""
    folder, *options = name[len(CHECKPOINT_PREFIX):].split(",")
    defaults = ",".join(f"{k}={v}" for k, v in CHECKPOINT_DEFAULTS.items())
    settings = dict(CHECKPOINT_DEFAULTS)
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in settings:
            raise ValueError(f"preset {name!r}: option {option!r} must be key=value with key one of "
                             f"{', '.join(CHECKPOINT_DEFAULTS)} (defaults {defaults})")
        if key in _CHOICES and value not in _CHOICES[key]:
            raise ValueError(f"preset {name!r}: {key} must be one of {', '.join(_CHOICES[key])}, got {value!r}")
        if key not in _CHOICES and not (value.isdecimal() and int(value) >= 1):
            raise ValueError(f"preset {name!r}: {key} must be an integer >= 1, got {value!r}")
        settings[key] = value if key in _CHOICES else int(value)
    if not folder:
        raise ValueError(f"preset {name!r} names no folder: write hf:<folder>[,{defaults}]")
    R, P, N, count = (int(settings[k]) for k in ("R", "P", "N", "count"))
    trace = TraceSpec("closed", count=count, concurrency=R, prompt_len=(1, P), output_len=(1, N))
    return _preset(name, read_checkpoint_spec(Path(folder)), trace, str(settings["dtype"]), str(settings["device"]))


class PresetTable(_LlamaPresetTable):
    """The fixed presets, plus `hf:<folder>[,R=..,P=..,N=..,count=..,dtype=..,device=..]` resolved (its
    config.json read) when first named: the `llama` workload's table, with this workload's presets."""

    def __missing__(self, name: str) -> KimiPreset:
        if not isinstance(name, str) or not name.startswith(CHECKPOINT_PREFIX):
            raise KeyError(name)
        self[name] = preset = checkpoint_preset(name)
        return preset


PRESET_TABLE = PresetTable(PRESETS)  # what the workload's presets() will return: PRESETS and hf: names
