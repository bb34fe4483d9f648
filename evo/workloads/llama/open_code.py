"""The Llama engine's stages a genome may carry as code (`evo.core.code`): attention, mlp and norm.

Each open stage's seed is a self-contained source in `open_stages/`, the hand-written implementation
itself (`engine.py` imports it; here it is read as text). A genome that sets a code gene
(`code_attention`, `code_mlp`, `code_norm`) names a source by its hash; `implementations` loads the
sources a genome names and returns their entry points, which the engine calls in place of the seeds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

from evo.core.code import CodeError, OpenStage, check_sources, load_module
from evo.core.genome import CodeGene
from evo.workloads.base import DeviceInfo, Preset

SEEDS = Path(__file__).parent / "open_stages"
IMPORTS = ("torch", "math", "numpy")


def _seed(path: Path) -> Callable[[], str]:
    def read() -> str:
        return path.read_text()

    return read


STAGES = (
    OpenStage(gene="code_attention", stage="attention", entry="attention", params=("q", "k", "v", "mask", "plan"),
              language="torch", doc="grouped-query causal attention of the new positions over the KV cache",
              seed=_seed(SEEDS / "attention.py"), allowed_imports=IMPORTS),
    OpenStage(gene="code_mlp", stage="mlp", entry="mlp", params=("h", "w", "plan"), language="torch",
              doc="the SwiGLU feed-forward down(silu(gate(h)) * up(h)) with packed or separate weights",
              seed=_seed(SEEDS / "mlp.py"), allowed_imports=IMPORTS),
    OpenStage(gene="code_norm", stage="norm", entry="norm", params=("x", "residual", "weight", "eps", "plan"),
              language="torch", doc="RMSNorm after an optional residual add; returns (normed, new residual stream)",
              seed=_seed(SEEDS / "norm.py"), allowed_imports=IMPORTS),
)


def open_stages(preset: Preset, device: DeviceInfo) -> tuple[OpenStage, ...]:
    return STAGES


def code_genes(preset: Preset, device: DeviceInfo) -> tuple[CodeGene, ...]:
    """The genes holding the open stages' code hashes (omitted from a genome: hand-written code)."""
    return tuple(CodeGene(s.gene, "fusion", f"code of the {s.stage} stage: {s.doc}") for s in STAGES)


def implementations(values: Mapping[str, object], sources: Mapping[str, str]) -> dict[str, Callable]:
    """{stage: entry point} for each code gene in a genome's `values`, loaded from `sources` (hash ->
    source). CodeError names the gene when its source is missing, mismatched or not allowed."""
    chosen = check_sources(values, sources, STAGES)
    impl = {}
    for stage in STAGES:
        if stage.gene in chosen:
            entry = getattr(load_module(chosen[stage.gene], stage), stage.entry, None)
            if not callable(entry):
                raise CodeError(f"gene {stage.gene}: the source's {stage.entry} is not a function after it ran; "
                                f"define {stage.signature()} at top level and do not rebind it")
            impl[stage.stage] = entry
    return impl
