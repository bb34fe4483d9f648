"""The KDA gene space and the plan an engine is built from.

Stages, in order: gate (chunk-local cumulative sum of g), l2norm, intra (intra-chunk matrices and
the unit-lower-triangular solve), recurrence (the inter-chunk state loop), output. Intra, the
recurrence's state update and output are open (`open_code`): optional code genes may replace them;
where the Triton engine runs, its kernels are open too (`code_triton`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from evo.core.genome import Constraint, Gene, GeneSpace, Genome, Ignored, Scalar, StagePipeline
from evo.workloads.base import DeviceInfo, Preset
from evo.workloads.kda import open_code as _open_code
from evo.workloads.kda import triton as _triton
from evo.workloads.kda.triton import genes as _triton_genes

STAGES = ("gate", "l2norm", "intra", "recurrence", "output")
BACKEND_VALUES = ("eager", "compile")
CPU_THREADS = (1, 2, 4, 8, 16)

# The torch engine's stages: the backend_<stage> and fuse_<a>_<b> genes, their "fused stages share one
# backend" constraint and the fused groups a Plan runs all come from here.
PIPELINE = StagePipeline(
    STAGES, BACKEND_VALUES,
    fused=(True, False, False, False),
    fuse_docs=("run gate and l2norm in one function (one compiled graph when compiled)",
               "run l2norm and the intra-chunk matrices in one function",
               "compute intra-chunk matrices per chunk inside the state loop",
               "compute the output inside the state loop (else one batched pass after it)"),
    backend_doc="how the {stage} stage runs: eager torch or torch.compile",
)
FUSE_GENES = tuple(gene for gene, _, _ in PIPELINE.boundaries())


def _scheduling_genes(device: DeviceInfo) -> list[Gene]:
    threads = tuple(t for t in CPU_THREADS if t <= max(1, device.threads)) if device.kind == "cpu" else (1,)
    # CPU: C=16 (one sub-chunk, few exps, cheap loop steps) measured fastest; GPU: fewer, fatter chunks
    chunk_sizes = (16, 32, 64, 128) if device.kind == "cpu" else (64, 16, 32, 128)
    return [
        Gene("chunk_size", "scheduling", chunk_sizes, chunk_sizes[0], "tokens per chunk C"),
        Gene("sub_chunk_size", "scheduling", (16, 8, 32, 64), 16,
             "sub-chunk size c for factored_subchunk and blocked_inverse; must divide chunk_size"),
        Gene("intra_algorithm", "scheduling", ("blocked_inverse", "forward_substitution", "triangular_solve"),
             "blocked_inverse", "how (I + A) X = R is solved inside a chunk"),
        Gene("exponent_form", "scheduling", ("factored_subchunk", "pairwise", "factored_chunk"), "factored_subchunk",
             "pairwise: [C,C,K] exp differences (stable, slow); factored_subchunk: per sub-chunk block offsets "
             "(stable for c <= 32 at g >= -5); factored_chunk: exp(G) exp(-G) over the chunk (finite while "
             "chunk_size x |g| < 88: at the domain's floor g >= -5 for chunk_size 16 only; larger chunks overflow "
             "under strong decay and fail the cascade)"),
        Gene("threads", "scheduling", threads, threads[-1] if device.kind == "cpu" else 1,
             "CPU threads the evaluator sets around calls"),
    ]


def _memory_genes(preset: Preset) -> list[Gene]:
    dtypes = ("float32", "bfloat16") if preset.dtype == "bfloat16" else ("float32",)
    return [
        Gene("compute_dtype", "memory", dtypes, "float32",
             "dtype of the intra-chunk and output matmul operands (the state stays float32)"),
        Gene("layout", "memory", ("head_major", "time_major"), "head_major",
             "head_major: copy to [B,H,T,*] once; time_major: strided views of [B,T,H,*]"),
        Gene("state_layout", "memory", ("kv", "vk"), "kv", "state held as [K,V] or transposed [V,K]"),
        Gene("intermediates", "memory", ("store", "recompute"), "store",
             "store gated q/k once for all chunks, or recompute them where used"),
        Gene("preallocate_outputs", "memory", (False, True), False,
             "write outputs into buffers kept per shape (valid until the next call of that shape)"),
    ]


def _sub_chunk_divides_chunk(values: Mapping[str, Scalar]) -> str | None:
    c, C = values.get("sub_chunk_size"), values.get("chunk_size")
    if isinstance(c, int) and isinstance(C, int) and (c > C or C % c):
        return f"sub_chunk_size={c} must divide chunk_size={C} and be <= it; pick a divisor of {C}"
    return None


def _code_for_its_engine(values: Mapping[str, Scalar]) -> str | None:
    """Each open stage's code belongs to one engine (its language: torch or triton)."""
    engine = values.get("engine", "torch")
    for stage in _open_code.ALL_STAGES:
        if values.get(stage.gene) is not None and stage.language != engine:
            others = [s.gene for s in _open_code.ALL_STAGES if s.language == engine]
            return (f"{stage.gene} is code of the {stage.language} engine, got engine={engine!r}; set "
                    f"engine={stage.language!r} or drop {stage.gene} (code genes of engine={engine!r}: {others})")
    return None


def gene_space(preset: Preset, device: DeviceInfo) -> GeneSpace:
    """Genes legal for `preset` on `device` (names are a contract with operators and configs)."""
    genes = list(PIPELINE.genes()) + _scheduling_genes(device) + _memory_genes(preset)
    constraints = (
        PIPELINE.constraint(),
        Constraint("sub_chunk_size divides chunk_size", _sub_chunk_divides_chunk),
    )
    ignored: tuple[Ignored, ...] = ()
    if _triton.runnable(device):  # the Triton engine joins as a genome choice (never on a plain CPU)
        dtypes = _triton_genes.compute_dtypes(preset)
        genes = [Gene(g.name, g.domain, dtypes, _triton_genes.default_compute_dtype(preset),
                      g.doc + "; tfloat32: tf32 tensor cores (triton)")
                 if g.name == "compute_dtype" else g for g in genes]
        genes += _triton_genes.genes(preset, device)
        constraints += _triton_genes.constraints() + (
            Constraint("code genes apply to their own engine", _code_for_its_engine),)
        ignored = _triton_genes.ignored(PIPELINE)
    return GeneSpace("kda", tuple(genes), constraints, _open_code.code_genes(preset, device), ignored, PIPELINE)


@dataclass(frozen=True)
class Plan:
    """A validated genome as typed fields: what the stage functions read."""

    fuse: tuple[bool, bool, bool, bool]  # links between adjacent STAGES
    backends: tuple[str, ...]  # one per stage
    chunk_size: int
    sub_chunk_size: int
    intra_algorithm: str
    exponent_form: str
    threads: int
    compute_dtype: str
    layout: str
    state_layout: str
    intermediates: str
    preallocate_outputs: bool

    @classmethod
    def from_genome(cls, genome: Genome) -> Plan:
        v = genome.values()
        return cls(
            fuse=tuple(bool(v[g]) for g in FUSE_GENES),
            backends=tuple(str(v[PIPELINE.backend_gene(s)]) for s in STAGES),
            chunk_size=int(v["chunk_size"]),
            sub_chunk_size=int(v["sub_chunk_size"]),
            intra_algorithm=str(v["intra_algorithm"]),
            exponent_form=str(v["exponent_form"]),
            threads=int(v["threads"]),
            compute_dtype=str(v["compute_dtype"]),
            layout=str(v["layout"]),
            state_layout=str(v["state_layout"]),
            intermediates=str(v["intermediates"]),
            preallocate_outputs=bool(v["preallocate_outputs"]),
        )

    def groups(self) -> list[tuple[tuple[str, ...], str]]:
        """Fused groups of consecutive stages, each with its (shared) backend."""
        return [(g, self.backends[STAGES.index(g[0])]) for g in PIPELINE.partition(self.fuse)]
