"""The model a Llama preset names: its architecture and where its weights come from, and the weights.

A `ModelSpec` is either read from a Hugging Face checkpoint folder (`config.json` and `*.safetensors`,
no network) or given as an architecture with a weight seed (weights drawn deterministically). The
float64 reference, every engine and every baseline load the same weights through `load_weights`,
each in its own process: engines in their `build()`, never through the judge's per-call arenas.

Weights are a dict in Hugging Face's names (`model.layers.0.self_attn.q_proj.weight`, [out, in]),
in the model's storage dtype.
"""
from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

from evo.workloads.base import Preset
from evo.workloads.llama.gguf_import import GGUF_PREFIX, import_gguf
from evo.workloads.lazy import lazy

torch = lazy("torch")  # presets and specs are read without torch (agents); tensors import it

CHECKPOINT_PREFIX = "hf:"  # a preset named hf:<folder>[,B=..,P=..,N=..,dtype=..,device=..]
CHECKPOINT_PREFIXES = (CHECKPOINT_PREFIX, GGUF_PREFIX)  # gguf:<file or distribution>[,...]: the same, imported
CHECKPOINT_DEFAULTS = {"B": 1, "P": 16, "N": 8}


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-family decoder: its shape, and its weights (a checkpoint folder, or a seed)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int = 0  # 0: hidden // heads
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, float], ...] = ()  # () or llama3's (factor, low/high_freq_factor, ...)
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    checkpoint: str | None = None  # a folder with config.json and *.safetensors
    weight_seed: int = 0  # for random weights (checkpoint None)
    storage_dtype: str = "float32"  # the dtype the weights are stored in (random ones are rounded to it)

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads} (grouped-query attention)")

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    def parameters(self, with_embedding: bool = True) -> int:
        """Parameter count (the LM head counted once, as the embedding when tied)."""
        D, hd = self.hidden, self.head_dim
        per_layer = D * hd * (2 * self.heads + 2 * self.kv_heads) + 3 * D * self.intermediate + 2 * D
        head = 0 if self.tie_embeddings and with_embedding else self.vocab * D
        return self.layers * per_layer + D + head + (self.vocab * D if with_embedding else 0)

    def weight_names(self) -> list[str]:
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            names += [p + f"self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")]
            names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        if not self.tie_embeddings:
            names.append("lm_head.weight")
        return names

    def shapes(self) -> dict[str, tuple[int, ...]]:
        D, hd, F = self.hidden, self.head_dim, self.intermediate
        out = {"model.embed_tokens.weight": (self.vocab, D), "model.norm.weight": (D,), "lm_head.weight": (self.vocab, D)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                        p + "self_attn.q_proj.weight": (self.heads * hd, D),
                        p + "self_attn.k_proj.weight": (self.kv_heads * hd, D),
                        p + "self_attn.v_proj.weight": (self.kv_heads * hd, D),
                        p + "self_attn.o_proj.weight": (D, self.heads * hd),
                        p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                        p + "mlp.down_proj.weight": (D, F)})
        return {n: out[n] for n in self.weight_names()}

    def hf_config(self) -> dict:
        """The transformers `LlamaConfig` keyword arguments of this model."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**dict(self.rope_scaling), "rope_type": "llama3", "rope_theta": self.rope_theta}
        return dict(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                    num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                    head_dim=self.head_dim, rms_norm_eps=self.rms_eps, tie_word_embeddings=self.tie_embeddings,
                    rope_parameters=rope, max_position_embeddings=1 << 17, attention_bias=False, mlp_bias=False,
                    hidden_act="silu")


@dataclass(frozen=True)
class LlamaPreset(Preset):
    """A preset with its model: shape {B, P, N, V} (batch, prompt length, decode steps, vocabulary)."""

    model: ModelSpec = field(default=None)  # type: ignore[assignment]


def _spec(vocab, hidden, layers, heads, kv_heads, intermediate, dtype="float32", seed=0, **kw) -> ModelSpec:
    return ModelSpec(vocab, hidden, layers, heads, kv_heads, intermediate, storage_dtype=dtype, weight_seed=seed, **kw)


def _preset(name: str, spec: ModelSpec, B: int, P: int, N: int, dtype: str, device: str) -> LlamaPreset:
    return LlamaPreset(name, {"B": B, "P": P, "N": N, "V": spec.vocab}, dtype, device, spec)


PRESETS: dict[str, LlamaPreset] = {p.name: p for p in (
    _preset("cpu_small", _spec(256, 64, 2, 4, 2, 176, tie_embeddings=True), 1, 12, 6, "float32", "cpu"),
    _preset("cpu", _spec(4096, 256, 4, 4, 2, 688), 1, 64, 64, "float32", "cpu"),
    _preset("cpu_batch", _spec(8192, 512, 4, 8, 2, 1376), 4, 128, 32, "float32", "cpu"),
    # a Llama-3.2-1B shape (its rope scaling and tied embeddings), random weights
    _preset("h200", _spec(128256, 2048, 16, 32, 8, 8192, "bfloat16", head_dim=64, rope_theta=500000.0,
                          tie_embeddings=True, rope_scaling=(("factor", 32.0), ("high_freq_factor", 4.0),
                                                             ("low_freq_factor", 1.0),
                                                             ("original_max_position_embeddings", 8192.0))),
            8, 512, 128, "bfloat16", "cuda"),
)}


def is_checkpoint_name(name: object) -> bool:
    """Whether `name` names a checkpoint: hf:<folder>[,...] or gguf:<source>[,...]."""
    return isinstance(name, str) and name.startswith(CHECKPOINT_PREFIXES)


def split_checkpoint_name(name: str) -> tuple[Path, list[str]]:
    """`hf:<folder>[,options]` or `gguf:<source>[,options]` -> the checkpoint folder (a GGUF is imported to
    float32 on first use, `evo.workloads.llama.gguf_import`) and the options as written."""
    prefix = GGUF_PREFIX if name.startswith(GGUF_PREFIX) else CHECKPOINT_PREFIX
    where, *options = name[len(prefix):].split(",")
    if not where:
        raise ValueError(f"preset {name!r} names no {'folder' if prefix == CHECKPOINT_PREFIX else 'GGUF file'}: "
                         f"write hf:<folder>[,options] or gguf:<file.gguf or distribution>[,options]")
    return (import_gguf(where) if prefix == GGUF_PREFIX else Path(where)), options


class PresetTable(dict):
    """The fixed presets, plus `hf:<folder>[,B=1,P=16,N=8,dtype=float32,device=cpu]`: the checkpoint in
    that folder at that shape, resolved (its config.json read) when first named; `gguf:<source>[,...]` the
    same for an imported GGUF."""

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or is_checkpoint_name(name)

    def __missing__(self, name: str) -> LlamaPreset:
        if not is_checkpoint_name(name):
            raise KeyError(name)
        preset = checkpoint_preset(name)
        self[name] = preset
        return preset

    def get(self, name, default=None):
        return self[name] if name in self else default


def checkpoint_preset(name: str) -> LlamaPreset:
    """`hf:<folder>[,key=value...]` (or `gguf:<source>[,...]`) -> the preset of that checkpoint; ValueError says
    what is wrong."""
    folder, options = split_checkpoint_name(name)
    settings: dict[str, object] = {**CHECKPOINT_DEFAULTS, "dtype": "float32", "device": "cpu"}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in settings:
            raise ValueError(f"preset {name!r}: option {option!r} must be key=value with key one of {sorted(settings)}")
        settings[key] = value if key in ("dtype", "device") else int(value)
    if settings["dtype"] not in ("float32", "bfloat16") or settings["device"] not in ("cpu", "cuda"):
        raise ValueError(f"preset {name!r}: dtype must be float32 or bfloat16 and device cpu or cuda, got "
                         f"{settings['dtype']!r}, {settings['device']!r}")
    spec = read_checkpoint_spec(folder)
    return _preset(name, spec, int(settings["B"]), int(settings["P"]), int(settings["N"]),
                   str(settings["dtype"]), str(settings["device"]))


def read_checkpoint_spec(folder: Path) -> ModelSpec:
    """The ModelSpec of a Hugging Face Llama checkpoint folder (config.json); ValueError when it is not one."""
    folder = folder.expanduser().resolve()
    config_path = folder / "config.json"
    if not config_path.is_file() or not list(folder.glob("*.safetensors")):
        raise ValueError(f"checkpoint folder {str(folder)!r} needs config.json and *.safetensors (a Hugging Face "
                         f"save_pretrained folder); found {sorted(p.name for p in folder.glob('*'))[:10]}")
    c = json.loads(config_path.read_text())
    if c.get("model_type") not in ("llama", None):
        raise ValueError(f"checkpoint {str(folder)!r} has model_type {c.get('model_type')!r}; only 'llama' is supported")
    for flag in ("attention_bias", "mlp_bias"):
        if c.get(flag):
            raise ValueError(f"checkpoint {str(folder)!r} sets {flag}=true; biases are not supported")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"checkpoint {str(folder)!r} has hidden_act {c.get('hidden_act')!r}; only 'silu' is supported")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ValueError(f"checkpoint {str(folder)!r} has rope_type {kind!r}; supported: 'default', 'llama3'")
    scaling = () if kind == "default" else tuple(sorted(
        (k, float(rope[k])) for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")))
    dtype = str(c.get("dtype") or c.get("torch_dtype") or "float32")
    heads = int(c["num_attention_heads"])
    return ModelSpec(
        vocab=int(c["vocab_size"]), hidden=int(c["hidden_size"]), layers=int(c["num_hidden_layers"]), heads=heads,
        kv_heads=int(c.get("num_key_value_heads") or heads), intermediate=int(c["intermediate_size"]),
        head_dim=int(c.get("head_dim") or 0), rope_theta=theta, rope_scaling=scaling,
        rms_eps=float(c.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        checkpoint=str(folder), storage_dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "float32")


def inv_freq(spec: ModelSpec, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim / 2] (Llama's default, or Llama 3's scaled ones), float64
    unless `dtype` says otherwise."""
    hd = spec.head_dim
    freq = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if spec.rope_scaling:
        s = dict(spec.rope_scaling)
        factor, low, high, old = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > old / low, freq / factor, freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        freq = torch.where(medium, smoothed, scaled)
    return freq if dtype is None else freq.to(dtype)


def load_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The model's weights in its storage dtype, by Hugging Face name, on the CPU."""
    if spec.checkpoint is not None:
        return _read_checkpoint(spec)
    return random_weights(spec)


def random_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Deterministic weights for `spec.weight_seed`: each tensor from its own seed (seed and name), so
    the draw does not depend on order. Projections N(0, 1/fan_in) (unit-scale activations, sharp
    attention: a wrong mask or rotary shows), embeddings N(0, 1), norm weights 1 + N(0, 0.1^2)."""
    dtype = getattr(torch, spec.storage_dtype)
    out = {}
    for name, shape in spec.shapes().items():
        gen = torch.Generator().manual_seed((spec.weight_seed << 32) ^ zlib.crc32(name.encode()))
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            x = 1 + 0.1 * x
        elif "embed_tokens" not in name:
            x = x * shape[-1] ** -0.5
        out[name] = x.to(dtype)
    return out


def _read_checkpoint(spec: ModelSpec) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folder = Path(spec.checkpoint)
    weights: dict[str, torch.Tensor] = {}
    try:
        for path in sorted(folder.glob("*.safetensors")):
            weights.update(load_file(str(path)))
    except OSError as exc:
        raise OSError(f"cannot read the checkpoint {str(folder)!r} ({exc}); engines read it in their own process, "
                      f"which in the strict sandbox runs as nobody with a private /tmp: keep checkpoints outside "
                      f"/tmp and /var/tmp, world-readable") from exc
    if spec.tie_embeddings:
        weights.pop("lm_head.weight", None)
    want = spec.shapes()
    missing = sorted(set(want) - set(weights))
    if missing:
        raise ValueError(f"checkpoint {str(folder)!r} lacks {missing[:5]} ({len(missing)} tensors missing)")
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"checkpoint {str(folder)!r}: {name} has shape {tuple(weights[name].shape)}, config.json "
                             f"implies {shape}")
    return {name: weights[name] for name in want}


def describe(spec: ModelSpec) -> dict:
    """The spec as plain data (for docs and logs)."""
    return {**asdict(spec), "parameters": spec.parameters()}


def layer_weights(weights: Mapping[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Layer i's weights by short name (q, k, v, o, gate, up, down, input_norm, post_norm)."""
    p = f"model.layers.{i}."
    return {"q": weights[p + "self_attn.q_proj.weight"], "k": weights[p + "self_attn.k_proj.weight"],
            "v": weights[p + "self_attn.v_proj.weight"], "o": weights[p + "self_attn.o_proj.weight"],
            "gate": weights[p + "mlp.gate_proj.weight"], "up": weights[p + "mlp.up_proj.weight"],
            "down": weights[p + "mlp.down_proj.weight"], "input_norm": weights[p + "input_layernorm.weight"],
            "post_norm": weights[p + "post_attention_layernorm.weight"]}


def lm_head(weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The LM head [V, D] (the embedding when tied)."""
    return weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
