"""KDA's Triton kernels as an open stage (`code_triton`): the seed is `triton/kernels.py` itself, it is
checked like any engine code, the gene exists only where the Triton engine runs and only with it, and
the seed matches the float64 reference where a wrong edit of it does not, and the real evaluator
(kernels under Triton's interpreter, in its engine processes) judges the wrong kernel `incorrect`."""
from __future__ import annotations

import importlib.util

import pytest

from evo.core.code import END_MARK, START_MARK, CodeError, check_source, code_hash, marked_blocks
from evo.core.genome import GenomeError
from evo.core.records import INCORRECT
from evo.workloads import get_workload
from evo.workloads.base import CheckCase, DeviceInfo
from evo.workloads.kda import open_code
from evo.workloads.kda.open_code import TRITON_KERNELS, TRITON_STAGE

pytestmark = pytest.mark.usefixtures("trusted_engine_code")  # the project's own seed sources, built here

W = get_workload("kda")
PRESET = W.presets()["cpu_small"]
CPU = DeviceInfo("cpu", "test", threads=2)
SEED = TRITON_STAGE.seed()
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
# a wrong kernel: the decay inside each chunk taken at half strength in W (the blocked intra, which genomes
# run by default)
WRONG = ("kn * tl.exp(G) * bet[:, None]", "kn * tl.exp(0.5 * G) * bet[:, None]")


@pytest.fixture
def interpreted(monkeypatch):
    """Triton runs kernels on the CPU here: the Triton engine and its open stage join the gene space.
    Kernels run only in the evaluator's engine processes here: Triton's interpreter fails in a process
    that decorated kernels for a GPU before (as other test modules do), and engine processes are fresh."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return W.gene_space(PRESET, CPU)


def test_the_seed_is_the_hand_written_kernels_file_and_passes_the_checks() -> None:
    assert SEED == TRITON_KERNELS.read_text()  # one implementation, read as text
    check_source(SEED, TRITON_STAGE)
    blocks = marked_blocks(SEED)
    assert len(blocks) == 1 and SEED.count(START_MARK) == SEED.count(END_MARK) == 1
    start, end = blocks[0]
    assert "def intra_kernel(" in SEED[start:end] and "import" not in SEED[start:end].split("\n", 1)[0]
    assert "import os" not in SEED  # only triton


@pytest.mark.parametrize("change, words", [
    (("def output_kernel(", "def out_kernel("), "must also define ['output_kernel']"),
    (("SUB = 16", "SUBLOCK = 16"), "must also define ['SUB']"),
    (("import triton\n", "import triton\nimport os\n"), "import of 'os' is not allowed"),
    (("def intra_kernel(q, k, g,", "def intra_kernel(q, k,"), "must be def intra_kernel(q, k, g, v"),
])
def test_kernels_sources_missing_a_kernel_or_importing_outside_the_list_are_refused(change, words) -> None:
    old, new = change
    assert old in SEED
    with pytest.raises(CodeError) as refused:
        check_source(SEED.replace(old, new, 1), TRITON_STAGE)
    assert words in str(refused.value), refused.value


def test_the_gene_exists_only_where_triton_runs(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "code_triton" not in W.gene_space(PRESET, CPU).code_gene_names()
    assert TRITON_STAGE not in W.open_stages(PRESET, CPU)


@needs_triton
def test_code_belongs_to_its_engine(interpreted) -> None:
    assert {"code_triton", "code_intra"} <= set(interpreted.code_gene_names())
    assert TRITON_STAGE in W.open_stages(PRESET, CPU)
    digest = code_hash(SEED)
    interpreted.make({"engine": "triton", "code_triton": digest})  # legal
    with pytest.raises(GenomeError, match="code_triton is code of the triton engine, got engine='torch'"):
        interpreted.make({"engine": "torch", "code_triton": digest})
    with pytest.raises(GenomeError, match="code_intra is code of the torch engine, got engine='triton'"):
        interpreted.make({"engine": "triton", "code_intra": digest})


@needs_triton
def test_a_genome_without_its_kernels_source_is_a_code_error_naming_the_gene(interpreted) -> None:
    with pytest.raises(CodeError, match="gene code_triton="):
        W.build(interpreted.make({"engine": "triton", "code_triton": code_hash(SEED)}), PRESET, CPU, sources={})
    assert open_code.triton_kernels({"engine": "triton"}, {}) is None  # no gene: the hand-written kernels


# Builds engines from kernel sources in a fresh process under the interpreter (see `interpreted`) and
# prints each one's norm-wise relative error against the float64 reference on a small ragged shape.
ERRORS = """
import json, sys
from evo.core.code import code_hash, trusted_code
from evo.workloads import get_workload
from evo.workloads.base import CheckCase, DeviceInfo
W, cpu = get_workload("kda"), DeviceInfo("cpu", "test", threads=2)
preset = W.presets()["cpu_small"]
space = W.gene_space(preset, cpu)
x = W.make_inputs(CheckCase("strong_decay", {"B": 1, "T": 40, "H": 2, "K": 16, "V": 16}, "strong_decay", True),
                  "float32", "cpu", 3)
want = W.reference(x)
errors = {}
for label, source in json.loads(sys.stdin.read()).items():
    genes = {"engine": "triton", "chunk_size": 16, "code_triton": code_hash(source)}
    with trusted_code():  # the project's own seed and a test's edit of it
        got = W.build(space.make(genes), preset, cpu, sources={code_hash(source): source})(**x)
    errors[label] = {n: float((got[n].double() - want[n]).norm() / want[n].norm()) for n in ("o", "final_state")}
print(json.dumps(errors))
"""


@needs_triton
def test_the_seed_matches_the_reference_and_a_wrong_kernel_does_not() -> None:
    import json
    import os
    import subprocess
    import sys

    assert SEED.count(WRONG[0]) == 1
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", ERRORS], input=json.dumps({"seed": SEED, "wrong": SEED.replace(*WRONG)}),
                          cwd=TRITON_KERNELS.parents[4], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert max(errors["seed"].values()) < 1e-5, errors
    assert errors["wrong"]["o"] > 1e-2, errors


@needs_triton
def test_the_evaluator_judges_kernel_code_in_its_engine_processes(interpreted) -> None:
    """A wrong kernel is run (so its source was found, checked and loaded) and judged incorrect."""
    from evaluators.judge.evaluator import Evaluator
    from evaluators.settings import EvaluatorSettings

    evaluator = Evaluator("kda", "cpu_small", EvaluatorSettings(warmup=0, repeats=1), seed=7, name="triton-code-ev")
    space = W.gene_space(evaluator.preset, evaluator.device_info())
    wrong = SEED.replace(*WRONG)
    genome = space.make({"engine": "triton", "chunk_size": 64, "fuse_recurrence_output": True,
                         "fuse_l2norm_intra": True, "code_triton": code_hash(wrong)})  # two kernels
    result = evaluator.evaluate(genome.to_json(), {code_hash(wrong): wrong})
    assert result.status == INCORRECT, result.message


@needs_triton
def test_the_code_agent_edits_the_kernels_of_triton_parents(interpreted, tmp_path) -> None:
    import json

    from operators.base import Parent
    from operators.code_agent import CodeAgent
    from operators.code_settings import CodeAgentSettings
    from operators.llm.client import LlmSettings
    from tests.llm_server import ScriptedLlmServer, Step

    old, new = "    gamma = tl.exp(G)  # <= 1\n", "    gamma = tl.exp(G)  # the decay within the chunk, <= 1\n"
    reply = json.dumps({"rationale": "say what gamma is", "edits": [{"search": old, "replace": new}]})
    triton_parent = Parent(interpreted.make({"engine": "triton"}), 1.0)
    torch_parent = Parent(interpreted.make({"engine": "torch"}), 1.0)
    with ScriptedLlmServer([Step(reply)]) as server:
        settings = CodeAgentSettings(llm=LlmSettings(base_url=server.url, model="scripted", api_key_env="KEY",
                                                     timeout_s=10.0, max_retries=0), queue=1, critique=False)
        agent = CodeAgent(interpreted, seed=3, settings=settings, workload="kda", preset="cpu_small", device=CPU,
                          run_dir=str(tmp_path / "run"), lessons_path=str(tmp_path / "lessons.md"),
                          environ={"KEY": "k"})
        assert agent._codable(triton_parent.genome) == ["code_triton"]
        assert agent._codable(torch_parent.genome) == ["code_intra", "code_recurrence", "code_output"]
        agent.propose([triton_parent], 2, generation=1)
        assert agent.wait_idle(120), "the agent's work did not finish"
        (proposal,) = agent.propose([triton_parent], 2, generation=2)
        agent.close()
    (digest, source), = proposal.sources
    assert proposal.move_kind == "edit:code_triton" and proposal.genome["code_triton"] == digest
    assert source == SEED.replace(old, new) and interpreted.is_legal(proposal.genome)
    system, user = server.requests[0]["messages"][0]["content"], server.requests[0]["messages"][1]["content"]
    assert "keep `prepare_kernel`, `recurrence_kernel`, `output_kernel`, `SUB`" in system
    assert "def intra_kernel(" in user and "written against triton" in system


@pytest.mark.gpu
@needs_triton
def test_the_seed_reproduces_the_hand_written_kernels_on_cuda() -> None:
    """Triton's real JIT compiles kernels from a genome's source (kept in linecache) as it does the package's."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    preset, device = W.presets()["h200"], DeviceInfo("cuda", "gpu")
    space = W.gene_space(preset, device)
    shape = {"B": 1, "T": 300, "H": 4, "K": 128, "V": 128}
    x = W.make_inputs(CheckCase("strong_decay", shape, "strong_decay", True), "bfloat16", "cuda", 4)
    expected = W.build(space.make({"engine": "triton"}), preset, device)(**x)
    digest = code_hash(SEED)
    seeded = W.build(space.make({"engine": "triton", "code_triton": digest}), preset, device,
                     sources={digest: SEED})(**x)
    for name in ("o", "final_state"):
        assert torch.equal(seeded[name], expected[name]), name
