"""The Kimi Linear serving engine's gene space, and the plan its generator is built from.

Scheduling: how many requests run at once, how a prompt runs through the KDA layers (the token recurrence,
or the KDA workload's chunked engine, by import) and the CPU threads (the `llama` workload's gene, as it is).
Memory: the MLA cache form (per-head keys and values, or DeepSeek-V2's compressed latent with the up
projections absorbed) and the dtype of the KDA recurrent state. Fusion: how the routed experts are
dispatched, and whether projections that read the same input run as one matmul.
The default genome is the plainest correct engine: recurrent prefill, expanded cache, a loop over experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from evo.core.genome import Gene, GeneSpace, Genome, Ignored
from evo.workloads.base import DeviceInfo
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
        threads,
        *(g for g in _kda._scheduling_genes(device) if g.name in KDA_GENES),
    ]


def _memory_genes(preset: KimiPreset) -> list[Gene]:
    dtypes = ("float32", "bfloat16") if preset.dtype == "bfloat16" else ("float32",)
    return [
        Gene("mla_cache", "memory", ("expanded", "compressed"), "expanded",
             "expanded: per MLA layer each head's keys [nope+rope] and values kept per position; compressed: the "
             "normalised latent and the shared rope key kept per position (kv_lora_rank + rope per position, "
             "not heads x (nope + rope + v)), the key up-projection absorbed into the query and the value "
             "up-projection into o_proj (DeepSeek-V2's inference form)"),
        Gene("state_dtype", "memory", dtypes, "float32",
             "dtype the KDA recurrent state [H, K, V] is kept in between steps (updated in float32); bfloat16 only "
             "at a bfloat16 preset"),
    ]


def _fusion_genes() -> list[Gene]:
    return [
        Gene("moe_dispatch", "fusion", ("loop", "grouped", "dense"), "loop",
             "loop: per expert, find its routed tokens and run them; grouped: (token, expert) pairs sorted by "
             "expert once, each expert's contiguous run of rows in one product; dense: every expert on every "
             "token, combined with the routing weights (zero where not routed)"),
        Gene("fused_projections", "fusion", (False, True), False,
             "run projections that read the same input as one matmul: KDA's q|k|v and its forget-gate, output-"
             "gate and beta down-projections; MLA's query and latent; SwiGLU's gate|up"),
    ]


def gene_space(preset: KimiPreset, device: DeviceInfo) -> GeneSpace:
    """Genes legal for `preset` on `device` (names are a contract with operators, configs and the workload)."""
    genes = _scheduling_genes(preset, device) + _memory_genes(preset) + _fusion_genes()
    # no cross-gene rule: every combination is a correct engine (a bfloat16 state exists only where the
    # preset is bfloat16, by its gene's values, as the llama workload offers weight_dtype)
    chunked_only = Ignored(KDA_GENES, lambda v: v.get("kda_prefill") != "chunked",
                           "the KDA workload's genes are read by the chunked prefill only")
    return GeneSpace("kimi_linear", tuple(genes), ignored=(chunked_only,))


@dataclass(frozen=True)
class KimiPlan:
    """A validated genome's genes, typed: what the generator reads."""

    max_running: int
    kda_prefill: str
    threads: int
    mla_cache: str
    state_dtype: str
    moe_dispatch: str
    fused_projections: bool
    chunk_size: int = 16  # the chunked prefill's KDA genes (read when kda_prefill is chunked)
    intra_algorithm: str = "blocked_inverse"

    @classmethod
    def from_genome(cls, genome: Genome) -> KimiPlan:
        v = genome.values()
        return cls(max_running=int(v["max_running"]), kda_prefill=str(v["kda_prefill"]), threads=int(v["threads"]),
                   mla_cache=str(v["mla_cache"]), state_dtype=str(v["state_dtype"]),
                   moe_dispatch=str(v["moe_dispatch"]), fused_projections=bool(v["fused_projections"]),
                   chunk_size=int(v["chunk_size"]), intra_algorithm=str(v["intra_algorithm"]))
