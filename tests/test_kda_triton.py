"""The Triton KDA engine: every kernel and fused variant against the float64 reference under Triton's
interpreter (one subprocess, see tests/kda_triton_cases.py), its genes, and CUDA-only checks."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evo.core.genome import GenomeError
from evo.workloads import get_workload
from evo.workloads.base import DeviceInfo

ROOT = Path(__file__).resolve().parents[1]
W = get_workload("kda")
H200, CPU = W.presets()["h200"], W.presets()["cpu"]
CUDA = DeviceInfo("cuda", "test-gpu", 1)
TOL = {"float32": 1e-5, "bfloat16": 6e-3}  # the evaluator's default norm-wise bounds
ELEMENTWISE_FACTOR = 10.0

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Errors of every case, computed once in a subprocess with TRITON_INTERPRET=1 (~40 s on 2 quiet cores)."""
    out = tmp_path_factory.mktemp("triton") / "cases.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.kda_triton_cases", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _case_names() -> list[str]:
    if importlib.util.find_spec("triton") is None:
        return []
    from tests.kda_triton_cases import CASES  # imports no triton: the dataclass module only

    return [c.name for c in CASES]


@needs_triton
@pytest.mark.parametrize("case", _case_names())
def test_engine_matches_reference(interpreted: dict, case: str) -> None:
    r = interpreted["engines"][case]
    tol = TOL[r["dtype"]]
    assert r["finite"]
    assert r["o_dtype"] == r["dtype"] and r["state_dtype"] == "float32"
    assert r["o"] <= tol and r["final_state"] <= tol, r
    assert r["o_elementwise"] <= ELEMENTWISE_FACTOR * tol and r["state_elementwise"] <= ELEMENTWISE_FACTOR * tol, r


@needs_triton
def test_bf16_and_tf32_operands_are_really_rounded(interpreted: dict) -> None:
    """bf16 and tf32 dot operands must cost accuracy (else the interpreter silently ran them in float32:
    ~1e-7 here); tf32 is emulated by truncating operands to its 10-bit mantissa."""
    engines = interpreted["engines"]
    for case in ("bf16_strong_decay_c64", "bf16_inputs_tf32_c16", "blocked_bf16_c32_ragged", "blocked_tf32_fused_c16"):
        assert engines[case]["final_state"] > 1e-4, (case, engines[case])


@needs_triton
@pytest.mark.parametrize("name", ["prepare_q", "prepare_k", "prepare_G"]
                         + [f"{tag}_{out}" for tag in ("intra", "intra_fused_prepare")
                            for out in ("W", "U0", "M", "Qg", "Kd", "gam")]
                         + [f"intra_blocked_{out}" for out in ("W", "U0", "M", "Kd", "gam")])
def test_stage_kernel_matches_float64(interpreted: dict, name: str) -> None:
    assert interpreted["stages"][name] <= 1e-5


def _triton_backend_internals() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except Exception:
        return False
    return True


@needs_triton
def test_kernels_compile_for_sm90_and_fit_shared_memory(tmp_path: Path) -> None:
    """The GPU code path (not the interpreter) compiles for Hopper, and every launch of the default and
    bench genomes at the h200 preset fits a block's shared memory (~20 s, no GPU)."""
    if not _triton_backend_internals():
        pytest.skip("this Triton has no ASTSource/CUDABackend to compile with")
    from evo.workloads.kda.triton.genes import SHARED_MEMORY_BYTES

    out = tmp_path / "sm90.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "tests.kda_triton_sm90", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    shared = json.loads(out.read_text())
    assert {"classic:intra_kernel", "classic:recurrence_kernel", "classic:output_kernel",
            "blocked_c32_bv64_3stages_fp32:recurrence_blocked_kernel"} <= set(shared)
    assert all(0 < b <= SHARED_MEMORY_BYTES for b in shared.values()), shared


def test_pipelined_stages_need_small_chunks() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    space = W.gene_space(H200, CUDA)
    assert space.make({"engine": "triton", "chunk_size": 64, "num_stages": 3}).values()["num_stages"] == 3  # blocked
    assert space.make({"engine": "triton", "triton_kernels": "classic", "chunk_size": 32,
                       "num_stages": 3}).values()["num_stages"] == 3
    with pytest.raises(GenomeError, match="num_stages=2 with chunk_size=64 .classic kernels."):
        space.make({"engine": "triton", "triton_kernels": "classic", "chunk_size": 64, "num_stages": 2})
    with pytest.raises(GenomeError, match="num_stages=2 with chunk_size=128 .blocked kernels."):
        space.make({"engine": "triton", "chunk_size": 128, "num_stages": 2})
    with pytest.raises(GenomeError, match="block_v=64 and workspace_dtype='float32' needs ~"):
        space.make({"engine": "triton", "block_v": 64, "num_stages": 3, "workspace_dtype": "float32"})


# ---- genes ----------------------------------------------------------------------------------------
def test_cpu_gene_space_has_no_triton_genes(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    space = W.gene_space(CPU, DeviceInfo("cpu", "test", 2))
    names = {g.name for g in space.genes}
    assert not names & {"engine", "block_v", "num_warps", "num_stages", "cuda_graph", "triton_kernels", "block_k"}
    assert space.gene("compute_dtype").values == ("float32",)
    assert space.default().values()["chunk_size"] == 16


@needs_triton
def test_cuda_gene_space_offers_triton() -> None:
    space = W.gene_space(H200, CUDA)
    default = space.default().values()
    assert default["engine"] == "triton" and default["compute_dtype"] == "bfloat16"
    assert default["triton_kernels"] == "blocked" and default["workspace_dtype"] == "bfloat16"
    assert space.gene("block_v").values == (32, 64, 128, 16)
    assert space.gene("compute_dtype").values == ("float32", "bfloat16", "tfloat32")
    assert space.gene("cuda_graph").values == (False, True)
    rng = __import__("numpy").random.default_rng(0)
    engines = {space.sample(rng).values()["engine"] for _ in range(40)}
    assert engines == {"triton", "torch"}


@needs_triton
@pytest.mark.parametrize("genes, words", [
    ({"engine": "triton", "fuse_intra_recurrence": True, "backend_recurrence": "eager"}, ["fuse_intra_recurrence", "False"]),
    ({"engine": "triton", "fuse_gate_l2norm": False}, ["fuse_gate_l2norm", "True"]),
    ({"engine": "torch", "compute_dtype": "tfloat32"}, ["tfloat32", "engine", "float32"]),
    ({"block_v": 256}, ["block_v", "256", "allowed"]),
])
def test_illegal_triton_genomes_say_why(genes: dict, words: list[str]) -> None:
    with pytest.raises(GenomeError) as err:
        W.gene_space(H200, CUDA).make(genes)
    assert all(w in str(err.value) for w in words), str(err.value)


@needs_triton
def test_triton_genome_off_cuda_fails_clearly(monkeypatch) -> None:
    """Built for a GPU but called with CPU tensors and no interpreter: a clear error, not garbage."""
    import torch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from evo.workloads.kda.triton.engine import TritonKdaEngine, plan_from_genome

    engine = TritonKdaEngine(plan_from_genome(W.gene_space(H200, CUDA).default()))
    x = torch.zeros(1, 16, 1, 16)
    with pytest.raises(RuntimeError, match="CUDA device or TRITON_INTERPRET=1"):
        engine(x, x, x, x, torch.zeros(1, 16, 1))


# ---- CUDA only ----------------------------------------------------------------------------------
def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


gpu = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")]


@needs_triton
@pytest.mark.parametrize("genes", [{}, {"compute_dtype": "float32", "chunk_size": 32, "fuse_recurrence_output": True},
                                   {"compute_dtype": "tfloat32", "state_layout": "vk", "fuse_l2norm_intra": True,
                                    "block_v": 32, "num_warps": 8}])
@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")
def test_triton_engine_on_cuda(genes: dict) -> None:
    from evo.workloads.base import CheckCase

    space = W.gene_space(H200, CUDA)
    engine = W.build(space.make({"engine": "triton", **genes}), H200, CUDA)
    shape = {"B": 2, "T": 300, "H": 4, "K": 128, "V": 128}
    for dist in ("standard", "strong_decay", "heavy"):
        inputs = W.make_inputs(CheckCase(dist, shape, dist, True), "bfloat16", "cuda", 7)
        out, ref = engine(**inputs), W.reference({k: v.cpu() for k, v in inputs.items()})
        for name in ("o", "final_state"):
            got, want = out[name].double().cpu(), ref[name]
            assert float((got - want).norm() / want.norm()) <= TOL["bfloat16"], (dist, name)


@needs_triton
@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")
def test_cuda_graph_recaptures_per_shape_and_never_serves_stale() -> None:
    import torch

    from evo.workloads.base import CheckCase

    space = W.gene_space(H200, CUDA)
    genome = space.make({"engine": "triton", "cuda_graph": True})
    graphed, plain = W.build(genome, H200, CUDA), W.build(genome.with_genes(cuda_graph=False), H200, CUDA)
    shapes = [{"B": 1, "T": 256, "H": 2, "K": 128, "V": 128}, {"B": 1, "T": 77, "H": 2, "K": 128, "V": 128}]
    for round_ in range(2):
        for i, shape in enumerate(shapes):
            inputs = W.make_inputs(CheckCase("x", shape, "standard", True), "bfloat16", "cuda", 10 * round_ + i)
            got, want = graphed(**inputs), plain(**inputs)
            torch.testing.assert_close(got["o"], want["o"], rtol=0, atol=0)
            torch.testing.assert_close(got["final_state"], want["final_state"], rtol=0, atol=0)
    assert graphed.captures_made == 2  # one per shape, replayed on the second round with new inputs


# ---- the output stage as CUDA C (CuPy, NVRTC) -------------------------------------------------------
def test_cuda_output_compiles_to_ptx_without_a_gpu() -> None:
    """NVRTC needs no driver: the CUDA C output compiles to sm_90 PTX here wherever cupy is installed."""
    pytest.importorskip("cupy")
    from evo.workloads.kda.triton import cuda_output

    try:
        ptx = cuda_output.ptx(cuda_output.options(64, 128, in_bf16=True, ws_bf16=True, m_bf16=True))
    except (ImportError, OSError) as exc:  # cupy without its NVRTC library
        pytest.skip(f"NVRTC cannot load here: {exc}")
    assert ".entry output_cuda" in ptx and ".target sm_90" in ptx
    with pytest.raises(ValueError, match="shared memory"):
        cuda_output.options(128, 128, in_bf16=True, ws_bf16=True, m_bf16=True)


@needs_triton
@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")
def test_cuda_output_backend_matches_the_reference_on_cuda() -> None:
    pytest.importorskip("cupy")
    from evo.workloads.base import CheckCase

    space = W.gene_space(H200, CUDA)
    shape = {"B": 2, "T": 300, "H": 4, "K": 128, "V": 128}
    inputs = W.make_inputs(CheckCase("x", shape, "strong_decay", True), "bfloat16", "cuda", 11)
    ref = W.reference({k: v.cpu() for k, v in inputs.items()})
    for genes in ({"output_backend": "cuda"}, {"output_backend": "cuda", "workspace_dtype": "float32", "chunk_size": 32}):
        out = W.build(space.make({"engine": "triton", **genes}), H200, CUDA)(**inputs)
        for name in ("o", "final_state"):
            got, want = out[name].double().cpu(), ref[name]
            assert float((got - want).norm() / want.norm()) <= TOL["bfloat16"], (genes, name)
