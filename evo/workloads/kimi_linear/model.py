"""The Kimi Linear hybrid decoder a preset names: its architecture, where its weights come from, the weights.

Kimi Linear (moonshotai/Kimi-Linear-48B-A3B) interleaves two token mixers, as transformers 5.24's
`KimiLinearForCausalLM` builds them (`layer_types`):
- `linear_attention`: Kimi Delta Attention (KDA): q, k, v projections through one short causal depthwise
  convolution (SiLU), a low-rank per-channel forget gate g = -exp(A_log) softplus(f_b f_a x + dt_bias),
  beta = sigmoid(b x), the delta-rule recurrence with per-channel decay, a per-head RMSNorm gated by
  sigmoid(g_b g_a x), o_proj;
- `full_attention`: multi-head latent attention (MLA, DeepSeek-V2's) **without any rotary embedding**: the
  "rope" part of q and of the shared key is carried but never rotated (NoPE);
and two feed-forward kinds (`mlp_layer_types`): `dense` (a SwiGLU MLP) and `sparse` (sigmoid-scored grouped
top-k routing with a score-correction bias, routed SwiGLU experts scaled by `routed_scaling_factor`, plus
shared experts). Pre-norm residual blocks, a final RMSNorm, an untied LM head.

A `KimiSpec` is either read from a checkpoint folder (config.json and *.safetensors, no network: a
`save_pretrained` folder, which transformers writes in the original Moonshot checkpoint's tensor names, or the
original itself; `from_stored_names` maps them) or given as an architecture with a weight seed. Weights are a
dict by transformers' runtime names ([out, in] for projections; experts stacked [E, 2I, D] and [E, D, I]).
Nothing here imports transformers except `hf_config`: presets are read without torch, weights without
transformers (an optional extra; engines never need it).
"""
from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from evo.workloads.lazy import lazy

torch = lazy("torch")  # specs are read without torch (agents); tensors import it

KDA, MLA = "linear_attention", "full_attention"  # transformers' layer_types
DENSE, SPARSE = "dense", "sparse"  # transformers' mlp_layer_types
LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers' KimiLinearRMSNorm default, not rms_norm_eps
FP32_TENSORS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "forget_gate.dt_bias")  # transformers'
# _keep_in_fp32_modules_strict: stored in float32 whatever the model's dtype


@dataclass(frozen=True)
class KimiSpec:
    """A Kimi Linear decoder: its shape, and its weights (a checkpoint folder, or a seed)."""

    vocab: int
    hidden: int
    layer_types: tuple[str, ...]  # per layer: "linear_attention" (KDA) | "full_attention" (MLA)
    mlp_types: tuple[str, ...]  # per layer: "dense" | "sparse" (MoE)
    intermediate: int  # the dense MLP's width
    # KDA
    kda_heads: int
    kda_head_dim: int  # K = V per head; also the rank of the forget gate's and output gate's low-rank projections
    conv_kernel: int = 4  # taps of the short causal convolution on q, k, v
    # MLA (no rotary: the "rope" dims are position-free)
    mla_heads: int = 0
    q_lora_rank: int | None = None  # None: one q_proj; else q_a_proj -> RMSNorm -> q_b_proj
    kv_lora_rank: int = 512
    qk_nope_dim: int = 128
    qk_rope_dim: int = 64
    v_head_dim: int = 128
    # MoE
    experts: int = 0
    top_k: int = 0  # routed experts per token
    expert_groups: int = 1  # n_group: groups scored by their top-2 experts
    topk_groups: int = 1  # groups a token may route into
    shared_experts: int = 1  # one shared SwiGLU of width moe_intermediate * shared_experts
    moe_intermediate: int = 0
    routed_scaling: float = 2.446
    renormalize: bool = True  # routed weights divided by their sum (+1e-20) before the scaling
    rms_eps: float = 1e-5
    checkpoint: str | None = None  # a save_pretrained folder with config.json and *.safetensors
    weight_seed: int = 0  # for random weights (checkpoint None)
    storage_dtype: str = "float32"  # the dtype weights are stored in (FP32_TENSORS excepted)

    def __post_init__(self) -> None:
        problems = []
        if len(self.layer_types) != len(self.mlp_types) or not self.layer_types:
            problems.append(f"layer_types ({len(self.layer_types)}) and mlp_layer_types ({len(self.mlp_types)}) must "
                            f"name every layer, the same number")
        if bad := sorted(set(self.layer_types) - {KDA, MLA}):
            problems.append(f"layer_types {bad} are not {KDA!r} or {MLA!r}")
        if bad := sorted(set(self.mlp_types) - {DENSE, SPARSE}):
            problems.append(f"mlp_layer_types {bad} are not {DENSE!r} or {SPARSE!r}")
        if MLA in self.layer_types and self.mla_heads < 1:
            problems.append("num_attention_heads must be >= 1 where a layer is full_attention")
        if SPARSE in self.mlp_types:
            if self.experts % self.expert_groups or self.experts // max(self.expert_groups, 1) < 2:
                problems.append(f"num_experts/num_local_experts ({self.experts}) must split into num_expert_group/"
                                f"n_group ({self.expert_groups}) groups of at least 2 (a group is scored by its top two)")
            if not 1 <= self.topk_groups <= self.expert_groups:
                problems.append(f"topk_group ({self.topk_groups}) must lie in [1, num_expert_group={self.expert_groups}]")
            elif not 1 <= self.top_k <= self.topk_groups * self.experts // self.expert_groups:
                problems.append(f"num_experts_per_token/num_experts_per_tok ({self.top_k}) must lie in [1, experts in "
                                f"topk_group groups="
                                f"{self.topk_groups * self.experts // self.expert_groups}]")
        if problems:
            raise ValueError("Kimi Linear spec: " + "; ".join(problems))

    @property
    def layers(self) -> int:
        return len(self.layer_types)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight by transformers' name -> shape, in the model's order."""
        D, H, K = self.hidden, self.kda_heads, self.kda_head_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, D)}
        for i, (mixer, mlp) in enumerate(zip(self.layer_types, self.mlp_types)):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            if mixer == KDA:
                out.update({a + "q_proj.weight": (H * K, D), a + "k_proj.weight": (H * K, D),
                            a + "v_proj.weight": (H * K, D), a + "conv1d.weight": (3 * H * K, 1, self.conv_kernel),
                            a + "forget_gate.dt_bias": (H * K,), a + "forget_gate.A_log": (1, 1, H, 1),
                            a + "forget_gate.f_a_proj.weight": (K, D), a + "forget_gate.f_b_proj.weight": (H * K, K),
                            a + "b_proj.weight": (H, D), a + "g_a_proj.weight": (K, D), a + "g_b_proj.weight": (H * K, K),
                            a + "o_norm.weight": (K,), a + "o_proj.weight": (D, H * K)})
            else:
                Hm, R = self.mla_heads, self.kv_lora_rank
                if self.q_lora_rank is None:
                    out[a + "q_proj.weight"] = (Hm * self.qk_head_dim, D)
                else:
                    out.update({a + "q_a_proj.weight": (self.q_lora_rank, D),
                                a + "q_a_layernorm.weight": (self.q_lora_rank,),
                                a + "q_b_proj.weight": (Hm * self.qk_head_dim, self.q_lora_rank)})
                out.update({a + "kv_a_proj_with_mqa.weight": (R + self.qk_rope_dim, D), a + "kv_a_layernorm.weight": (R,),
                            a + "kv_b_proj.weight": (Hm * (self.qk_nope_dim + self.v_head_dim), R),
                            a + "o_proj.weight": (D, Hm * self.v_head_dim)})
            m = p + "mlp."
            if mlp == DENSE:
                F = self.intermediate
                out.update({m + "gate_proj.weight": (F, D), m + "up_proj.weight": (F, D), m + "down_proj.weight": (D, F)})
            else:
                E, I, S = self.experts, self.moe_intermediate, self.moe_intermediate * self.shared_experts
                out.update({m + "experts.gate_up_proj": (E, 2 * I, D), m + "experts.down_proj": (E, D, I),
                            m + "gate.weight": (E, D), m + "gate.e_score_correction_bias": (E,),
                            m + "shared_experts.gate_proj.weight": (S, D), m + "shared_experts.up_proj.weight": (S, D),
                            m + "shared_experts.down_proj.weight": (D, S)})
            out.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,)})
        out.update({"model.norm.weight": (D,), "lm_head.weight": (self.vocab, D)})
        return out

    def parameters(self) -> int:
        """Every parameter (embedding and LM head included)."""
        return sum(math.prod(s) for s in self.shapes().values())

    def active_parameters(self) -> int:
        """Parameters a token reads: the experts counted top_k of `experts` times (embedding row excluded)."""
        total = 0
        for name, shape in self.shapes().items():
            if name == "model.embed_tokens.weight":
                continue
            n = math.prod(shape)
            total += n * self.top_k // self.experts if ".experts." in name else n
        return total


# ---------------------------------------------------------------------------------------- config.json

# transformers 5.24's KimiLinearConfig defaults (the 48B model's shape), for fields a config.json omits
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_experts": 256, "num_experts_per_token": 8,
    "num_shared_experts": 1, "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True,
    "routed_scaling_factor": 2.446, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "rms_norm_eps": 1e-5, "linear_head_dim": 128,
    "linear_num_heads": 32, "linear_conv_kernel_dim": 4}
# the names transformers' attribute_map (and the original checkpoint, or DeepSeek's) may use for a field
_ALIASES = {"num_experts": ("num_local_experts", "n_routed_experts"), "num_experts_per_token": ("num_experts_per_tok",),
            "num_shared_experts": ("n_shared_experts",), "num_expert_group": ("n_group",),
            "moe_renormalize": ("norm_topk_prob",)}
# fields whose other values transformers 5.24 would silently compute otherwise (or not at all): value, why
_REQUIRED: dict[str, tuple[Any, str]] = {
    "hidden_act": ("silu", "the MLPs and the KDA convolution are written with SiLU only"),
    "attention_bias": (False, "MLA's projections are written without biases"),
    "tie_word_embeddings": (False, "transformers' KimiLinearForCausalLM never ties its LM head to the embedding"),
    "mla_use_nope": (True, "transformers' MLA applies no rotary embedding at all"),
    "moe_router_activation_func": ("sigmoid", "transformers' router always scores experts by a sigmoid"),
    "moe_layer_freq": (1, "transformers reads only first_k_dense_replace (or mlp_layer_types)")}


def _field(c: Mapping[str, Any], name: str) -> Any:
    for key in (name, *_ALIASES.get(name, ())):
        if key in c:
            return c[key]
    return _DEFAULTS[name]


def spec_from_config(c: Mapping[str, Any], checkpoint: str | None = None) -> KimiSpec:
    """The KimiSpec of a Kimi Linear config.json (as `save_pretrained` writes it, or the original checkpoint's
    `linear_attn_config` / `first_k_dense_replace` form); ValueError naming the field it cannot honour."""
    where = f"checkpoint {checkpoint!r}" if checkpoint else "config"

    def refuse(field: str, got: Any, allowed: str) -> ValueError:
        return ValueError(f"{where}: {field}={got!r} is not supported ({allowed})")

    if c.get("model_type", "kimi_linear") != "kimi_linear":
        raise refuse("model_type", c.get("model_type"), "only 'kimi_linear'")
    for name, (want, why) in _REQUIRED.items():
        if name in c and c[name] != want:
            raise refuse(name, c[name], f"only {want!r}: {why}")
    heads = int(_field(c, "num_attention_heads"))
    kv_heads = c.get("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != heads:
        raise refuse("num_key_value_heads", kv_heads, f"MLA expands every head from the latent: must equal "
                                                      f"num_attention_heads={heads}")
    if c.get("topk_method", "noaux_tc") != "noaux_tc":
        raise refuse("topk_method", c["topk_method"], "only 'noaux_tc' (sigmoid scores plus a correction bias)")
    groups = int(_field(c, "num_expert_group"))
    if c.get("use_grouped_topk", True) is False and groups > 1:
        raise refuse("use_grouped_topk", False, "transformers always routes by groups where n_group > 1")
    linear = dict(c.get("linear_attn_config") or {})
    for name in ("use_full_rank_gate", "gate_lower_bound"):
        if linear.get(name) not in (None, False):
            raise refuse(f"linear_attn_config.{name}", linear[name], "a Kimi K3 gate, not Kimi Linear's")
    layers = int(_field(c, "num_hidden_layers"))
    layer_types = c.get("layer_types")
    if layer_types is None:  # as transformers reads it: the checkpoint's 1-indexed lists, else MLA at 4, 8, ...
        if "full_attn_layers" in linear and "kda_layers" in linear:
            layer_types = [None] * layers
            for key, kind in (("full_attn_layers", MLA), ("kda_layers", KDA)):
                for i in linear[key]:
                    if not 1 <= int(i) <= layers:
                        raise refuse(f"linear_attn_config.{key}", linear[key], f"1-indexed layers in [1, {layers}]")
                    layer_types[int(i) - 1] = kind
        else:
            layer_types = [MLA if i and i % 4 == 0 else KDA for i in range(layers)]
    mlp_types = c.get("mlp_layer_types")
    if mlp_types is None:
        first_dense = int(c.get("first_k_dense_replace", 1))
        mlp_types = [DENSE if i < first_dense else SPARSE for i in range(layers)]
    for name, kinds, allowed in (("layer_types", layer_types, (KDA, MLA)), ("mlp_layer_types", mlp_types, (DENSE, SPARSE))):
        if len(kinds) != layers or any(k not in allowed for k in kinds):
            raise refuse(name, kinds, f"one of {allowed} for each of num_hidden_layers={layers} layers")
    q_lora = c.get("q_lora_rank", _DEFAULTS["q_lora_rank"])
    dtype = str(c.get("dtype") or c.get("torch_dtype") or "float32")
    try:
        return KimiSpec(
            vocab=int(_field(c, "vocab_size")), hidden=int(_field(c, "hidden_size")), layer_types=tuple(layer_types),
            mlp_types=tuple(mlp_types), intermediate=int(_field(c, "intermediate_size")),
            kda_heads=int(linear.get("num_heads", _field(c, "linear_num_heads"))),
            kda_head_dim=int(linear.get("head_dim", _field(c, "linear_head_dim"))),
            conv_kernel=int(linear.get("short_conv_kernel_size", _field(c, "linear_conv_kernel_dim"))),
            mla_heads=heads, q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(_field(c, "kv_lora_rank")), qk_nope_dim=int(_field(c, "qk_nope_head_dim")),
            qk_rope_dim=int(_field(c, "qk_rope_head_dim")), v_head_dim=int(_field(c, "v_head_dim")),
            experts=int(_field(c, "num_experts")), top_k=int(_field(c, "num_experts_per_token")),
            expert_groups=groups, topk_groups=int(_field(c, "topk_group")),
            shared_experts=int(_field(c, "num_shared_experts")), moe_intermediate=int(_field(c, "moe_intermediate_size")),
            routed_scaling=float(_field(c, "routed_scaling_factor")), renormalize=bool(_field(c, "moe_renormalize")),
            rms_eps=float(_field(c, "rms_norm_eps")), checkpoint=checkpoint,
            storage_dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "float32")
    except ValueError as exc:
        raise ValueError(f"{where}: {str(exc).removeprefix('Kimi Linear spec: ')}") from None


def read_checkpoint_spec(folder: Path | str) -> KimiSpec:
    """The KimiSpec of a `save_pretrained` folder (config.json + *.safetensors); ValueError when it is not one."""
    folder = Path(folder).expanduser().resolve()
    config_path = folder / "config.json"
    if not config_path.is_file() or not list(folder.glob("*.safetensors")):
        raise ValueError(f"checkpoint folder {str(folder)!r} needs config.json and *.safetensors (a transformers "
                         f"save_pretrained folder); found {sorted(p.name for p in folder.glob('*'))[:10]}")
    return spec_from_config(json.loads(config_path.read_text()), checkpoint=str(folder))


def hf_config(spec: KimiSpec):
    """transformers' `KimiLinearConfig` of this model (imports transformers >= 5.24). Token ids for
    padding, start and end are left unset: the random models have no tokenizer."""
    from transformers import KimiLinearConfig

    return KimiLinearConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        moe_intermediate_size=spec.moe_intermediate, num_hidden_layers=spec.layers,
        num_attention_heads=spec.mla_heads or 1, num_key_value_heads=spec.mla_heads or 1,
        kv_lora_rank=spec.kv_lora_rank, q_lora_rank=spec.q_lora_rank, qk_rope_head_dim=spec.qk_rope_dim,
        qk_nope_head_dim=spec.qk_nope_dim, v_head_dim=spec.v_head_dim, num_local_experts=max(spec.experts, 2),
        num_experts_per_tok=max(spec.top_k, 1), n_group=spec.expert_groups, topk_group=spec.topk_groups,
        n_shared_experts=spec.shared_experts, routed_scaling_factor=spec.routed_scaling,
        norm_topk_prob=spec.renormalize, rms_norm_eps=spec.rms_eps, linear_head_dim=spec.kda_head_dim,
        linear_num_heads=spec.kda_heads, linear_conv_kernel_dim=spec.conv_kernel, layer_types=list(spec.layer_types),
        mlp_layer_types=list(spec.mlp_types), hidden_act="silu", attention_bias=False, tie_word_embeddings=False,
        pad_token_id=None, bos_token_id=None, eos_token_id=None, dtype=spec.storage_dtype)


# ---------------------------------------------------------------------------------------- weights

def load_weights(spec: KimiSpec) -> dict[str, torch.Tensor]:
    """The model's weights by transformers' name, on the CPU: the checkpoint's tensors as stored, or the
    seed's (`random_weights`)."""
    return _read_checkpoint(spec) if spec.checkpoint is not None else random_weights(spec)


def random_weights(spec: KimiSpec) -> dict[str, torch.Tensor]:
    """Deterministic weights for `spec.weight_seed`, each tensor from its own seed (seed and name), so the draw
    depends neither on order nor on transformers. Scales (chosen so every part of the model matters and greedy
    tokens are well separated; transformers' own init, N(0, 0.02^2) everywhere, leaves the layers near the
    identity and the top logits ~0.01 apart):
    projections and expert matrices N(0, 1/fan_in) (unit-scale activations; the router's logits unit-scale, so
    routing is decisive), the convolution N(0, 1/taps), embeddings N(0, 1), every norm weight 1 + N(0, 0.1^2),
    the router's score-correction bias N(0, 0.1^2) (it must matter for the choice and not for the weights);
    A_log = log U(1, 16) and dt_bias = softplus^-1(dt), log dt ~ U(log 1e-3, log 1e-1) (flash-linear-attention's
    and transformers' init). Rounded to the storage dtype, FP32_TENSORS kept in float32."""
    dtype = getattr(torch, spec.storage_dtype)
    out = {}
    for name, shape in spec.shapes().items():
        gen = torch.Generator().manual_seed((spec.weight_seed << 32) ^ zlib.crc32(name.encode()))
        if name.endswith("A_log"):
            x = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp().clamp_min(1e-4)
            x = dt + torch.log(-torch.expm1(-dt))  # the inverse of softplus
        else:
            x = torch.randn(shape, generator=gen, dtype=torch.float32)
            if name.endswith(("norm.weight", "layernorm.weight")):
                x = 1 + 0.1 * x
            elif name.endswith("e_score_correction_bias"):
                x = 0.1 * x
            elif "embed_tokens" not in name:
                x = x * shape[-1] ** -0.5  # fan_in: the last dimension of [out, in], [E, out, in] and [C, 1, taps]
        out[name] = x if name.endswith(FP32_TENSORS) else x.to(dtype)
    return out


def _read_checkpoint(spec: KimiSpec) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folder = Path(spec.checkpoint)
    stored: dict[str, torch.Tensor] = {}
    try:
        for path in sorted(folder.glob("*.safetensors")):
            stored.update(load_file(str(path)))
    except OSError as exc:
        raise OSError(f"cannot read the checkpoint {str(folder)!r} ({exc}); engines read it in their own process, "
                      f"which in the strict sandbox runs as nobody with a private /tmp: keep checkpoints outside "
                      f"/tmp and /var/tmp, world-readable") from exc
    weights = from_stored_names(stored)
    want = spec.shapes()
    missing = sorted(set(want) - set(weights))
    if missing:
        raise ValueError(f"checkpoint {str(folder)!r} lacks {missing[:5]} ({len(missing)} tensors missing, in "
                         f"transformers' KimiLinearForCausalLM names after from_stored_names)")
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"checkpoint {str(folder)!r}: {name} has shape {tuple(weights[name].shape)}, config.json "
                             f"implies {shape}")
    return {name: weights[name] for name in want}


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")


def from_stored_names(stored: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors as a checkpoint stores them -> transformers' runtime names. transformers 5.24's `save_pretrained`
    writes Kimi Linear in the original Moonshot checkpoint's names (its conversion mapping, reversed), so this
    is the mapping transformers applies when it loads one (`conversion_mapping.py`, "kimi_linear"):
    `block_sparse_moe.` -> `mlp.`; the forget gate's `f_a_proj`, `f_b_proj`, `dt_bias`, `A_log` move under
    `self_attn.forget_gate.`; `q_conv1d`, `k_conv1d`, `v_conv1d` [HK, 1, taps] are concatenated into `conv1d`;
    per-expert `experts.<e>.w1` (gate), `w3` (up), `w2` (down) are stacked into `experts.gate_up_proj`
    [E, 2I, D] (gate rows, then up rows) and `experts.down_proj` [E, D, I]. Names already in runtime form pass."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in stored.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = re.sub(r"self_attn\.(f_a_proj\.|f_b_proj\.|dt_bias$|A_log$)", r"self_attn.forget_gate.\1", name)
        if m := _EXPERT.match(name):
            experts.setdefault(m[1], {})[int(m[2]), m[3]] = tensor
        else:
            out[name] = tensor
    for name in [n for n in out if n.endswith("self_attn.q_conv1d.weight")]:
        prefix = name[: -len("q_conv1d.weight")]
        parts = [out.pop(prefix + f"{x}_conv1d.weight", None) for x in "qkv"]
        if any(p is None for p in parts):
            raise ValueError(f"checkpoint has {name} but not all of {prefix}{{q,k,v}}_conv1d.weight")
        out[prefix + "conv1d.weight"] = torch.cat(parts, 0)
    for prefix, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        absent = [f"{prefix}.{e}.{w}.weight" for e in range(count) for w in ("w1", "w2", "w3") if (e, w) not in parts]
        if absent:
            raise ValueError(f"checkpoint lacks expert tensors {absent[:5]} ({len(absent)} missing)")
        out[prefix + ".gate_up_proj"] = torch.stack([torch.cat([parts[e, "w1"], parts[e, "w3"]], 0) for e in range(count)])
        out[prefix + ".down_proj"] = torch.stack([parts[e, "w2"] for e in range(count)])
    return out


def describe(spec: KimiSpec) -> dict:
    """The spec as plain data (for docs and logs)."""
    return {**asdict(spec), "parameters": spec.parameters(), "active_parameters": spec.active_parameters()}
