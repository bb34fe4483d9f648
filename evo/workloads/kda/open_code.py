"""The KDA stages a genome may carry as code (`evo.code`): intra, the recurrence's per-chunk state
update, and output, for the torch engine (CPU and CUDA).

Each open stage's seed is the hand-written implementation of `stages.py` as a self-contained source in
`open_stages/` (read as text, never imported as part of this package). A genome that sets a code gene
(`code_intra`, `code_recurrence`, `code_output`) names a source by its hash; `implementations` loads the
sources a genome names and returns their entry points, which the engine uses in place of the
hand-written stages wherever those run (their own group, fused into the chunk loop, compiled or eager).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

from evo.code import CodeError, OpenStage, check_sources, load_module
from evo.genome import CodeGene
from evo.workloads.base import DeviceInfo, Preset

SEEDS = Path(__file__).parent / "open_stages"
IMPORTS = ("torch", "math", "numpy")  # torch stages: no triton


def _seed(name: str) -> Callable[[], str]:
    def read() -> str:
        return (SEEDS / name).read_text()

    return read


_STAGES = (
    OpenStage(
        gene="code_intra", stage="intra", entry="intra", params=("ctx", "plan"), language="torch",
        doc="Intra-chunk matrices of one or all chunks: from l2-normalised q, k, v, beta and the cumulative "
            "log decay G, return W, U0 (the (I + A)^-1 solve) and the causal q-k products M (plus Qg, Kd when "
            "plan.intermediates == 'store'). Runs as its own stage or per chunk inside the state loop.",
        seed=_seed("intra.py"), allowed_imports=IMPORTS),
    OpenStage(
        gene="code_recurrence", stage="recurrence", entry="chunk_step", params=("c", "S", "plan"), language="torch",
        doc="The state update of one chunk, called by the engine's loop over chunks: from the chunk's W, U0, "
            "gammaC and Kd (or k, G, gC) and the start state S [B*H, K, V], return the next state S and the "
            "corrected values U = U0 - W S.",
        seed=_seed("recurrence.py"), allowed_imports=IMPORTS),
    OpenStage(
        gene="code_output", stage="output", entry="output", params=("ctx", "plan"), language="torch",
        doc="The output O = (Q * Gamma) S + M U, of all chunks in one batched pass or of one chunk inside the "
            "state loop.",
        seed=_seed("output.py"), allowed_imports=IMPORTS),
)


def open_stages(preset: Preset, device: DeviceInfo) -> tuple[OpenStage, ...]:
    """The open stages of the torch engine (the same on CPU and CUDA, for every preset)."""
    return _STAGES


def code_genes() -> tuple[CodeGene, ...]:
    """The genes holding the open stages' code hashes (omitted from a genome: hand-written code)."""
    return tuple(CodeGene(s.gene, "fusion", f"code of the {s.stage} stage (torch engine): {s.doc}") for s in _STAGES)


def implementations(values: Mapping[str, object], sources: Mapping[str, str], preset: Preset,
                    device: DeviceInfo) -> dict[str, Callable]:
    """{stage: entry point} for each code gene in a genome's `values`, loaded from `sources`
    (hash -> source). CodeError names the gene when its source is missing, mismatched or not allowed."""
    stages = open_stages(preset, device)
    chosen = check_sources(values, sources, stages)
    impl = {}
    for stage in stages:
        if stage.gene in chosen:
            module = load_module(chosen[stage.gene], stage)  # registered in sys.modules for torch.compile
            entry = getattr(module, stage.entry, None)
            if not callable(entry):
                raise CodeError(f"gene {stage.gene}: the source's {stage.entry} is not a function after it ran; "
                                f"define {stage.signature()} at top level and do not rebind it")
            impl[stage.stage] = entry
    return impl
