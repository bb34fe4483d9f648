"""The KDA stages a genome may carry as code (`evo.core.code`): for the torch engine (CPU and CUDA) intra,
the recurrence's per-chunk state update and output; for the Triton engine (where it runs) its kernels.

Torch: each open stage's seed is a self-contained source in `open_stages/`, the hand-written
implementation itself (`stages.py` imports it; here it is read as text). A genome that sets a
code gene (`code_intra`, `code_recurrence`, `code_output`) names a source by its hash;
`implementations` loads the sources a genome names and returns their entry points, which the engine
uses in place of the hand-written stages wherever those run (their own group, fused into the chunk
loop, compiled or eager).

Triton: the seed of `code_triton` is `triton/kernels.py` itself (one implementation, read as text);
`triton_kernels` loads a genome's replacement, whose prepare, intra, recurrence and output kernels the
Triton engine launches as it launches its own.
"""
from __future__ import annotations

import types
from pathlib import Path
from typing import Callable, Mapping

from evo.core.code import CodeError, OpenStage, check_sources, load_module
from evo.core.genome import CodeGene
from evo.workloads.base import DeviceInfo, Preset
from evo.workloads.kda import triton as _triton

SEEDS = Path(__file__).parent / "open_stages"
IMPORTS = ("torch", "math", "numpy")  # torch stages: no triton
TRITON_KERNELS = Path(__file__).parent / "triton" / "kernels.py"


def _seed(path: Path) -> Callable[[], str]:
    def read() -> str:
        return path.read_text()

    return read


_STAGES = (
    OpenStage(
        gene="code_intra", stage="intra", entry="intra", params=("ctx", "plan"), language="torch",
        doc="Intra-chunk matrices of one or all chunks: from l2-normalised q, k, v, beta and the cumulative "
            "log decay G, return W, U0 (the (I + A)^-1 solve) and the causal q-k products M (plus Qg, Kd when "
            "plan.intermediates == 'store'). Runs as its own stage or per chunk inside the state loop.",
        seed=_seed(SEEDS / "intra.py"), allowed_imports=IMPORTS),
    OpenStage(
        gene="code_recurrence", stage="recurrence", entry="chunk_step", params=("c", "S", "plan"), language="torch",
        doc="The state update of one chunk, called by the engine's loop over chunks: from the chunk's W, U0, "
            "gammaC and Kd (or k, G, gC) and the start state S [B*H, K, V], return the next state S and the "
            "corrected values U = U0 - W S.",
        seed=_seed(SEEDS / "recurrence.py"), allowed_imports=IMPORTS),
    OpenStage(
        gene="code_output", stage="output", entry="output", params=("ctx", "plan"), language="torch",
        doc="The output O = (Q * Gamma) S + M U, of all chunks in one batched pass or of one chunk inside the "
            "state loop.",
        seed=_seed(SEEDS / "output.py"), allowed_imports=IMPORTS),
)
TRITON_STAGE = OpenStage(
    gene="code_triton", stage="triton_kernels", entry="intra_kernel",
    params=("q", "k", "g", "v", "beta", "qn", "kn", "Gw", "W", "U0", "M", "Qg", "Kd", "gam", "T", "Tp", "scale",
            "H", "K", "V", "BT", "BK", "BVF", "SB", "FUSED_PREPARE", "DOT", "SDOT"),
    language="triton",
    doc="The Triton engine's kernels, launched by the engine exactly as in the seed (same names, arguments, "
        "grids and workspaces): prepare_kernel (l2norm, chunk cumsum; skipped when FUSED_PREPARE), intra_kernel "
        "(W, U0, M, Qg, Kd, exp(G_C) per chunk), recurrence_kernel (the state loop over chunks, per V tile; "
        "writes o too when FUSED_OUTPUT) and output_kernel; SUB is the pair products' sub-chunk block; the blocked "
        "family (gene triton_kernels='blocked'): intra_blocked_kernel, recurrence_blocked_kernel, output_blocked_kernel.",
    seed=_seed(TRITON_KERNELS), allowed_imports=("triton", "math"),
    also_defines=("prepare_kernel", "recurrence_kernel", "output_kernel", "SUB", "intra_blocked_kernel",
                  "recurrence_blocked_kernel", "output_blocked_kernel"))

ALL_STAGES = _STAGES + (TRITON_STAGE,)


def open_stages(preset: Preset, device: DeviceInfo) -> tuple[OpenStage, ...]:
    """The torch engine's open stages (the same on CPU and CUDA, for every preset), and the Triton
    engine's kernels where that engine runs."""
    return _STAGES + ((TRITON_STAGE,) if _triton.runnable(device) else ())


def code_genes(preset: Preset, device: DeviceInfo) -> tuple[CodeGene, ...]:
    """The genes holding the open stages' code hashes (omitted from a genome: hand-written code)."""
    return tuple(CodeGene(s.gene, "fusion", f"code of the {s.stage} stage ({s.language} engine): {s.doc}")
                 for s in open_stages(preset, device))


def implementations(values: Mapping[str, object], sources: Mapping[str, str]) -> dict[str, Callable]:
    """{stage: entry point} for each torch-engine code gene in a genome's `values`, loaded from `sources`
    (hash -> source). CodeError names the gene when its source is missing, mismatched or not allowed."""
    chosen = check_sources(values, sources, _STAGES)
    impl = {}
    for stage in _STAGES:
        if stage.gene in chosen:
            module = load_module(chosen[stage.gene], stage)  # registered in sys.modules for torch.compile
            entry = getattr(module, stage.entry, None)
            if not callable(entry):
                raise CodeError(f"gene {stage.gene}: the source's {stage.entry} is not a function after it ran; "
                                f"define {stage.signature()} at top level and do not rebind it")
            impl[stage.stage] = entry
    return impl


def triton_kernels(values: Mapping[str, object], sources: Mapping[str, str]) -> types.ModuleType | None:
    """The kernels module of a Triton genome's `code_triton` source (None: the hand-written kernels)."""
    chosen = check_sources(values, sources, (TRITON_STAGE,))
    if TRITON_STAGE.gene not in chosen:
        return None
    return load_module(chosen[TRITON_STAGE.gene], TRITON_STAGE)  # decorates its kernels with triton.jit
