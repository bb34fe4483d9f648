"""The Kimi Linear serving engine's gene space, and the plan its generator is built from.

Scheduling: how many requests run at once, how a prompt runs through the KDA layers (the token recurrence,
or the KDA workload's chunked engine, by import) and the CPU threads (the `llama` workload's gene, as it is).
Memory: the MLA cache form (per-head keys and values, or DeepSeek-V2's compressed latent with the up
projections absorbed) and its dtype, the dtype and layout ([K, V] or [V, K]) of the KDA recurrent state, and
how the KDA convolution window is kept (shifted each step, or a ring addressed by position). Fusion: how the
routed experts are dispatched, whether the shared experts join them as always-chosen experts, and whether
projections that read the same input run as one matmul.
The default genome is the plainest correct engine: recurrent prefill, expanded cache in the model's dtype, a
[K, V] state, a shifted window, a loop over experts, the shared experts apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Mapping

from evo.core.genome import Constraint, Gene, GeneSpace, Genome, Ignored, Scalar
from evo.workloads.base import DeviceInfo
from evo.workloads.generation_core.exchange import exchange_gene
from evo.workloads.kda import genes as _kda
from evo.workloads.kimi_linear.presets import KimiPreset
from evo.workloads.llama import genes as _llama

# the KDA workload's genes the chunked prefill reads, by the KDA workload's names and values, so a KDA run's
# lessons on them carry over (`evo.core.lessons.Lessons.shared_with`); its exponent form stays pairwise (the
# factored forms overflow under this model's decay: evo.workloads.kimi_linear.engine.CHUNKED_KDA_GENES)
KDA_GENES = ("chunk_size", "intra_algorithm")

MAX_RUNNING = (1, 2, 4, 8, 16, 32, 64)


def _scheduling_genes(preset: KimiPreset, device: DeviceInfo) -> list[Gene]:
    R = max(1, preset.shape["R"])
    running = tuple(m for m in MAX_RUNNING if m <= 2 * R) or (1,)
    default = min((m for m in running if m >= R), default=running[-1])  # room for every request in flight
    threads = next(g for g in _llama._scheduling_genes(device) if g.name == "threads")
    return [
        Gene("max_running", "scheduling", running, default,
             "the most requests admitted at once (continuous batching: a waiting request is admitted, and its "
             "prompt prefilled, as soon as a running one ends); every running request decodes in one forward"),
        Gene("kda_prefill", "scheduling", ("recurrent", "chunked"), "recurrent",
             "how a prompt runs through each KDA layer: the token recurrence (one state update per token), or "
             "the KDA workload's chunked engine (by import: the WY form, chunks of 16, pairwise exponents, "
             "stable under this model's strong decay) from a zero state, returning the final state"),
        Gene("prefill_rows", "scheduling", ("each", "together"), "each",
             "each: one forward per admitted request's prompt; together: the prompts admitted in a step in one "
             "forward, their tokens packed for the projections and experts, each KDA and MLA layer running them as "
             "rows padded to the longest (a padded token leaves a KDA state as it was: decay 1, beta 0; MLA is "
             "causal, so no real token sees one), so each weight is read once for all of them (vLLM packs the "
             "prefill tokens of several requests into one batch)"),
        threads,
        *(g for g in _kda._scheduling_genes(device) if g.name in KDA_GENES),
    ]


def _memory_genes(preset: KimiPreset) -> list[Gene]:
    dtypes = ("float32", "bfloat16") if preset.dtype == "bfloat16" else ("float32",)
    # the default keeps the cache in the model's dtype; float32 beside it where that is narrower
    cache_dtypes = (preset.dtype,) if preset.dtype == "float32" else (preset.dtype, "float32")
    return [
        Gene("mla_cache", "memory", ("expanded", "compressed"), "expanded",
             "expanded: per MLA layer each head's keys [nope+rope] and values kept per position; compressed: the "
             "normalised latent and the shared rope key kept per position (kv_lora_rank + rope per position, "
             "not heads x (nope + rope + v)), the key up-projection absorbed into the query and the value "
             "up-projection into o_proj (DeepSeek-V2's inference form)"),
        Gene("mla_cache_dtype", "memory", cache_dtypes, preset.dtype,
             "dtype the MLA cache (expanded or compressed) is stored in; attention computes in the model's dtype "
             "(a wider cache is cast on read); float32 beside the model's dtype only where that is narrower"),
        Gene("state_dtype", "memory", dtypes, "float32",
             "dtype the KDA recurrent state [H, K, V] is kept in between steps (updated in float32); bfloat16 only "
             "at a bfloat16 preset"),
        Gene("state_layout", "memory", ("kv", "vk"), "kv",
             "layout of the KDA recurrent state per head: kv [K, V], or vk [V, K], its transpose (the decode step's "
             "decay and rank-one update run along the other axis; its products k^T S and q^T S read the state "
             "through a transposed view; a prefill stores its final state transposed)"),
        Gene("conv_window", "memory", ("shifted", "ring"), "shifted",
             "the KDA convolution window (each row's last taps-1 q|k|v inputs): shifted (one copy per decode "
             "step moves it up by one), or a ring per row (a step writes its input at slot position % (taps-1) "
             "and the convolution gathers the taps in order by per-row indices; no shift copy)"),
    ]


def _step_genes(preset: KimiPreset, device: DeviceInfo) -> list[Gene]:
    if device.kind != "cpu" or preset.dtype != "float32":
        return []
    return [Gene("decode_step", "fusion", ("eager", "native"), "eager",
                 "eager: a decode step as torch ops (~250 a step, each dispatched from Python); native: our C decode "
                 "step (generation_core.cpu_kernels.kimi_decode_step; AVX2, FMA), the whole forward of every decoding "
                 "row in one call: each product streams its weight once for all rows, the convolution, gates and KDA "
                 "recurrence per row and head, MLA over each row's own positions of the compressed cache, each routed "
                 "expert on the rows that chose it (float32 weights; needs mla_cache=compressed, state_layout=kv, "
                 "conv_window=shifted; prefills are prefill_step's)"),
            Gene("prefill_step", "fusion", ("torch", "native", "with_decode"), "torch",
                 "torch: a prefill as torch ops (the products by torch's BLAS, ~100 ops a call dispatched from "
                 "Python); native: the C decode step's forward over the prompts' tokens (their products streaming "
                 "each weight once per 6 tokens from cache, each KDA prompt through its recurrence, each MLA token "
                 "over its prompt's positions), PREFILL_CHUNK tokens a call (float32 weights; needs "
                 "mla_cache=compressed, state_layout=kv, conv_window=shifted); with_decode: native, and a step that "
                 "prefills runs its decode rows in the same forward, one token each beside the prompts' (all of "
                 "the step's prompts, whatever prefill_rows says; vLLM's unified batch: the step's weights read "
                 "once for both, not again by a decode step of their own; needs decode_step=native too)")]


def _fusion_genes(device: DeviceInfo) -> list[Gene]:
    native = [Gene("kda_kernel", "fusion", ("torch", "native"), "torch",
                   "how the KDA recurrence runs: torch (the prefill loop under TorchScript, four ops a token; a decode "
                   "step's decay, products and rank-one update as batched ops), or native: our C kernel (AVX2, FMA; "
                   "generation_core.cpu_kernels.kda_recurrence), each head's state decayed, multiplied and updated in "
                   "one pass over it a token, for a recurrent prefill (each prompt to its own length) and every decode "
                   "step; a float32 recurrent prefill runs everything between its products in C too (the window, SiLU, "
                   "l2 norms, gates, recurrence and gated norm: cpu_kernels.kda_prefill); needs state_layout=kv")
              ] if device.kind == "cpu" else []
    return native + [
        Gene("moe_dispatch", "fusion", ("loop", "grouped", "dense"), "loop",
             "loop: per expert, find its routed tokens and run them; grouped: (token, expert) pairs sorted by "
             "expert once, each expert's contiguous run of rows in one product; dense: every expert on every "
             "token, combined with the routing weights (zero where not routed)"),
        Gene("shared_expert", "fusion", ("separate", "fused"), "separate",
             "separate: the shared experts run as their own dense SwiGLU on every token; fused: they run inside the "
             "routed dispatch as extra experts every token chooses with weight 1 (the shared SwiGLU of "
             "shared_experts x moe_intermediate split along its intermediate dimension into shared_experts experts "
             "of moe_intermediate, exact: gate and up [S, D] by rows, down [D, S] by columns)"),
        Gene("fused_projections", "fusion", (False, True), False,
             "run projections that read the same input as one matmul: KDA's q|k|v and its forget-gate, output-"
             "gate and beta down-projections; MLA's query and latent; SwiGLU's gate|up"),
    ]


# the speed levers, most leverage first (the `levers` agent's sweep): the decode step in C, the prefill by its
# forward, the KDA recurrence in C, how prompts are prefilled (together, and through the recurrence or chunks), how
# many steps an exchange runs, how the experts are dispatched, the projections fused, the MLA cache held
LEVERS = ("decode_step", "prefill_step", "kda_kernel", "prefill_rows", "kda_prefill", "steps_per_exchange",
          "moe_dispatch", "fused_projections", "mla_cache")


def gene_space(preset: KimiPreset, device: DeviceInfo) -> GeneSpace:
    """Genes legal for `preset` on `device` (names are a contract with operators, configs and the workload)."""
    genes = (_scheduling_genes(preset, device) + [exchange_gene()] + _memory_genes(preset) + _fusion_genes(device)
             + _step_genes(preset, device))
    # one cross-gene rule (the C recurrence keeps [K, V] states); otherwise every combination is a correct engine (a
    # bfloat16 state exists only where the preset is bfloat16, a float32 cache beside the model's dtype only where
    # that is narrower, by their genes' values, as the llama workload offers weight_dtype; the shared experts always
    # split exactly, their width being shared_experts x moe_intermediate by the spec's shapes, which a checkpoint is
    # checked against)
    chunked_only = Ignored(KDA_GENES, lambda v: v.get("kda_prefill") != "chunked",
                           "the KDA workload's genes are read by the chunked prefill only")
    names = {g.name for g in genes}  # kda_kernel is a CPU gene
    return GeneSpace("kimi_linear", tuple(genes), ignored=(chunked_only,),
                     levers=tuple(n for n in LEVERS if n in names),
                     constraints=(Constraint("kda_kernel native needs state_layout kv", _native_kernel_needs_kv),
                                  Constraint("decode_step native needs mla_cache compressed, state_layout kv, "
                                             "conv_window shifted", partial(_native_step_needs, "decode_step")),
                                  Constraint("prefill_step native or with_decode needs mla_cache compressed, "
                                             "state_layout kv, conv_window shifted (with_decode: decode_step "
                                             "native too)", partial(_native_step_needs, "prefill_step"))))


def _native_kernel_needs_kv(values: Mapping[str, Scalar]) -> str | None:
    if values.get("kda_kernel") == "native" and values.get("state_layout") != "kv":
        return (f"kda_kernel='native' updates KDA states kept as [K, V] per head; got state_layout="
                f"{values.get('state_layout')!r}; set state_layout=kv or kda_kernel=torch")
    return None


NATIVE_STEP_NEEDS = {"mla_cache": "compressed", "state_layout": "kv", "conv_window": "shifted"}  # what the C step reads


def _native_step_needs(gene: str, values: Mapping[str, Scalar]) -> str | None:
    """The rule for `gene` (decode_step or prefill_step; bound by partial): native reads what the C step reads;
    a prefill with the decode rows needs them decoded by the C step too."""
    if values.get(gene) in ("eager", "torch", None):
        return None
    if values.get(gene) == "with_decode" and values.get("decode_step") != "native":
        return (f"prefill_step='with_decode' runs the decode rows through the C step's forward; got decode_step="
                f"{values.get('decode_step')!r}; set decode_step=native or prefill_step=native")
    wrong = {g: values.get(g) for g, want in NATIVE_STEP_NEEDS.items() if values.get(g) != want}
    if wrong:
        return (f"{gene}={values.get(gene)!r} reads the compressed MLA cache, [K, V] states and a shifted window; got "
                f"{', '.join(f'{g}={v!r}' for g, v in wrong.items())}; set "
                f"{', '.join(f'{g}={NATIVE_STEP_NEEDS[g]}' for g in wrong)} or "
                f"{gene}={'eager' if gene == 'decode_step' else 'torch'}")
    return None


@dataclass(frozen=True)
class KimiPlan:
    """A validated genome's genes, typed: what the generator reads."""

    max_running: int
    kda_prefill: str
    threads: int
    mla_cache: str
    mla_cache_dtype: str
    state_dtype: str
    state_layout: str
    conv_window: str
    moe_dispatch: str
    shared_expert: str
    fused_projections: bool
    prefill_rows: str = "each"
    kda_kernel: str = "torch"
    decode_step: str = "eager"
    prefill_step: str = "torch"
    chunk_size: int = 16  # the chunked prefill's KDA genes (read when kda_prefill is chunked)
    intra_algorithm: str = "blocked_inverse"

    @classmethod
    def from_genome(cls, genome: Genome) -> KimiPlan:
        v = genome.values()
        return cls(max_running=int(v["max_running"]), kda_prefill=str(v["kda_prefill"]), threads=int(v["threads"]),
                   mla_cache=str(v["mla_cache"]), mla_cache_dtype=str(v["mla_cache_dtype"]),
                   state_dtype=str(v["state_dtype"]), state_layout=str(v["state_layout"]),
                   conv_window=str(v["conv_window"]), moe_dispatch=str(v["moe_dispatch"]),
                   shared_expert=str(v["shared_expert"]), fused_projections=bool(v["fused_projections"]),
                   chunk_size=int(v["chunk_size"]), intra_algorithm=str(v["intra_algorithm"]),
                   prefill_rows=str(v["prefill_rows"]), kda_kernel=str(v.get("kda_kernel", "torch")),
                   decode_step=str(v.get("decode_step", "eager")), prefill_step=str(v.get("prefill_step", "torch")))
