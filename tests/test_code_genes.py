"""Genomes that carry code: source checks, the content-addressed store, code genes, and the judge
building agent-written code only in the engine's process (cheats written as code rejected too)."""
from __future__ import annotations

import pytest

from evaluators.judge.evaluator import Evaluator
from evaluators.settings import EvaluatorSettings
from evo.core.code import CodeError, CodeStore, check_source, code_hash, load_module, marked_blocks
from evo.core.genome import Genome, GenomeError
from evo.core.records import BUILD_ERROR, INCORRECT, OK, RUNTIME_ERROR
from evo.workloads.base import DeviceInfo
from tests import fake_workload as fw

STAGE = fw.SUM_STAGE
SPACE = fw.WORKLOAD.gene_space(fw.WORKLOAD.presets()["cpu"], DeviceInfo("cpu", "cpu"))


def edited(new_block: str) -> str:
    return fw.SUM_SEED.replace("    o = x.cumsum(1)\n", new_block)


# -- evo.core.code ----------------------------------------------------------------------------------------
def test_the_seed_passes_and_its_marked_block_is_found():
    check_source(fw.SUM_SEED, STAGE)
    (start, end), = marked_blocks(fw.SUM_SEED)
    assert fw.SUM_SEED[start:end] == "    o = x.cumsum(1)\n"


@pytest.mark.parametrize("source, words", [
    ("def running_sum(x, initial_state)\n    return x\n", "does not compile"),
    ("import os\ndef running_sum(x, initial_state):\n    return x\n", "import of 'os' is not allowed"),
    ("from subprocess import run\ndef running_sum(x, initial_state):\n    return x\n", "'subprocess'"),
    ("from . import x\ndef running_sum(x, initial_state):\n    return x\n", "relative import"),
    ("def running_sum(x, initial_state):\n    return eval('x')\n", "'eval' is not allowed"),
    ("def running_sum(x, initial_state):\n    return __import__('os')\n", "'__import__' is not allowed"),
    ("def running_sum(x, initial_state):\n    return x.__class__.__subclasses__()\n", "'__subclasses__'"),
    ("def running_sum(x):\n    return x\n", "must be def running_sum(x, initial_state)"),
    ("def running_sum(x, initial_state, *rest):\n    return x\n", "must be def running_sum(x, initial_state)"),
    ("def other(x, initial_state):\n    return x\n", "must define the entry point"),
])
def test_bad_sources_are_refused_with_the_reason(source, words):
    with pytest.raises(CodeError, match=None) as caught:
        check_source(source, STAGE)
    assert words in str(caught.value)


def test_submodules_of_the_allow_list_are_allowed():
    check_source("import torch.nn.functional as F\nimport math\nfrom numpy import float32\n"
                 "def running_sum(x, initial_state):\n    return x.cumsum(1)\n", STAGE)


def test_the_store_keeps_sources_by_hash_and_detects_damage(tmp_path):
    store = CodeStore(tmp_path / "code")
    digest = store.put(fw.SUM_SEED)
    assert digest == code_hash(fw.SUM_SEED) and store.has(digest)
    assert store.put(fw.SUM_SEED) == digest and len(list((tmp_path / "code").iterdir())) == 1  # dedupe by hash
    assert store.get(digest) == fw.SUM_SEED
    store.path(digest).write_text(fw.SUM_SEED + "# changed\n")
    with pytest.raises(CodeError, match="damaged"):
        store.get(digest)
    with pytest.raises(CodeError, match="not a code hash"):
        store.get("../../etc/passwd")
    with pytest.raises(CodeError, match="no source"):
        store.get("0" * 16)


def test_loaded_code_is_readable_by_inspect(trusted_engine_code):
    import inspect

    module = load_module(fw.SUM_SEED, STAGE)
    assert "x.cumsum(1)" in inspect.getsource(module.running_sum)


def test_code_runs_nowhere_but_in_an_engine_process():
    """The code filter is not a boundary (this source passes it and reaches os through torch): load_module
    refuses to run a code gene outside an engine's confined process, whatever the source."""
    source = fw.SUM_SEED + "\nimport torch\nLEAK = torch.os.getcwd\n"
    check_source(source, STAGE)  # passes the filter
    with pytest.raises(CodeError, match="only inside a judge's confined engine process"):
        load_module(source, STAGE)


# -- code genes --------------------------------------------------------------------------------------
def test_code_genes_are_optional_and_take_only_hashes():
    default = SPACE.default()
    assert "code_sum" not in default.values()  # hand-written: the gene is omitted, hashes stay as they were
    with_code = SPACE.make({"code_sum": code_hash(fw.SUM_SEED)})
    assert with_code["code_sum"] == code_hash(fw.SUM_SEED) and with_code.hash != default.hash
    with pytest.raises(GenomeError, match="code gene 'code_sum' has value 'builtin'"):
        SPACE.validate(default.with_domain("fusion", {**default.domain("fusion"), "code_sum": "builtin"}))
    assert any(row["gene"] == "code_sum" for row in SPACE.describe())


def test_agents_moves_keep_a_parents_code():
    import numpy as np

    from operators.base import GeneMutationAgent

    class FusionMutation(GeneMutationAgent):
        name, domain = "fusion_mutation", "fusion"

    parent = SPACE.make({"code_sum": code_hash(fw.SUM_SEED)})
    move = FusionMutation(SPACE, seed=1).apply("impl", parent, np.random.default_rng(0))
    assert move is not None and move.child["code_sum"] == parent["code_sum"]


# -- the judge ---------------------------------------------------------------------------------------
@pytest.fixture
def ev(fake):
    return Evaluator(fake, "cpu", EvaluatorSettings(warmup=1, repeats=5), seed=3, name="code-ev")


def _evaluate(ev: Evaluator, source: str, sources: dict | None = None):
    genome = SPACE.make({"code_sum": code_hash(source)})
    return ev.evaluate(genome.to_json(), {code_hash(source): source} if sources is None else sources)


def test_agent_written_code_is_built_checked_and_timed(ev):
    source = edited("    o = torch.cumsum(x, dim=1)\n")
    result = _evaluate(ev, source)
    assert result.status == OK, result.message


def test_missing_mismatched_or_forbidden_code_is_a_build_error_before_any_process(ev):
    source = edited("    o = torch.cumsum(x, dim=1)\n")
    missing = _evaluate(ev, source, sources={})
    assert missing.status == BUILD_ERROR and "no source with that hash" in missing.message
    mismatched = _evaluate(ev, source, sources={code_hash(source): source + "\n"})
    assert mismatched.status == BUILD_ERROR and "hashes to" in mismatched.message
    forbidden = "import os\n" + source
    refused = _evaluate(ev, forbidden)
    assert refused.status == BUILD_ERROR and "import of 'os' is not allowed" in refused.message


# Cheats written as agent code: each gets through the static checks and must fail in the judge.
CODE_CHEATS = {
    "wrong": ("    o = x.cumsum(1) * 1.01\n", "incorrect"),
    "zeros_after_warmup": ("    _state.append(1)\n    o = x.cumsum(1) if len(_state) < 3 else x * 0\n", "incorrect"),
    "cache_by_pointer": ("    key = (x.data_ptr(), tuple(x.shape))\n    if key not in _cache:\n"
                         "        _cache[key] = x.cumsum(1)\n    o = _cache[key].clone()\n", "incorrect"),
    "previous_answer": ("    o = _state[-1] if _state and _state[-1].shape == x.shape else x.cumsum(1)\n"
                        "    _state.append(x.cumsum(1))\n", "incorrect"),
    "runtime_escape": ("    o = getattr(x, '__cl' + 'ass__')\n", None),
}


@pytest.mark.parametrize("cheat", sorted(CODE_CHEATS))
def test_cheats_written_as_code_are_rejected(ev, cheat):
    block, status = CODE_CHEATS[cheat]
    source = edited(block).replace("import torch\n", "import torch\n\n_cache = {}\n_state = []\n")
    check_source(source, STAGE)  # nothing static gives them away
    result = _evaluate(ev, source)
    assert result.status != OK, f"{cheat} was accepted: {result.message}"
    if status:
        assert result.status == status, result.message


# -- KDA: agent-written stage code that cheats, judged by the same evaluator ---------------------------
KDA_BODY = '    return {"O": inter + (M @ ctx["U"].to(M.dtype)).float()}\n'
KDA_CHEATS = {
    # reaches for the float64 oracle at run time (no name the static check refuses): a KDA engine's process
    # never loads it (its zygote preloads only the KDA workload's engine side), so the lookup fails
    "calls_reference": ('    ref = getattr(getattr(torch, "sy" + "s"), "mod" + "ules")["evo.workloads.kda.reference"]\n'
                        "    try:\n        ref.reference({})\n    except Exception:\n        pass\n" + KDA_BODY,
                        "KeyError: 'evo.workloads.kda.reference'"),
    # remembers its first answer per shape and returns it for every later call
    "cached_per_shape": ("    key = tuple(ctx['U'].shape)\n    if key not in _cache:\n"
                         '        _cache[key] = inter + (M @ ctx["U"].to(M.dtype)).float()\n'
                         '    return {"O": _cache[key].clone()}\n', None),
    # skips the intra-chunk term on long sequences (right only where the cascade is short)
    "skips_work_when_long": ('    if ctx["U"].shape[-3] > 2:\n        return {"O": inter}\n' + KDA_BODY, None),
}


@pytest.fixture(scope="module")
def kda_code_ev():
    return Evaluator("kda", "cpu_small", EvaluatorSettings(warmup=1, repeats=3), seed=5, name="kda-code-ev")


def _kda_code(ev: Evaluator, source: str):
    from evo.workloads import get_workload

    space = get_workload("kda").gene_space(ev.preset, ev.device_info())
    genome = space.make({"code_output": code_hash(source)})
    return ev.evaluate(genome.to_json(), {code_hash(source): source})


def test_kda_seed_code_passes_the_judge(kda_code_ev):
    from evo.workloads import get_workload

    (stage,) = [s for s in get_workload("kda").open_stages(kda_code_ev.preset, kda_code_ev.device_info())
                if s.gene == "code_output"]
    result = _kda_code(kda_code_ev, stage.seed())
    assert result.status == OK, result.message


@pytest.mark.parametrize("cheat", sorted(KDA_CHEATS))
def test_kda_cheats_written_as_code_are_rejected(kda_code_ev, cheat):
    from evo.workloads import get_workload

    (stage,) = [s for s in get_workload("kda").open_stages(kda_code_ev.preset, kda_code_ev.device_info())
                if s.gene == "code_output"]
    body, words = KDA_CHEATS[cheat]
    source = stage.seed().replace(KDA_BODY, body).replace("import torch\n", "import torch\n\n_cache = {}\n", 1)
    assert source != stage.seed()
    check_source(source, stage)
    result = _kda_code(kda_code_ev, source)
    expected = RUNTIME_ERROR if cheat == "calls_reference" else INCORRECT
    assert result.status == expected, f"{cheat}: {result.status} {result.message}"
    if words:
        assert words in result.message, result.message


# -- limits of the engine's process: no network, bounded memory -----------------------------------------
def test_engine_code_has_no_network(ev):
    # a module reachable without an import (torch imports socket) tries to reach this machine's loopback
    block = ('    s = getattr(torch, "multiprocessing").reductions.multiprocessing.connection.socket\n'
             '    s.create_connection(("127.0.0.1", 9), timeout=1)\n    o = x.cumsum(1)\n')
    source = edited(block)
    result = _evaluate(ev, source)
    assert result.status == "runtime_error", result.message
    assert "unreachable" in result.message.lower() or "network" in result.message.lower(), result.message


def test_engine_code_cannot_take_more_memory_than_allowed(fake):
    small = Evaluator(fake, "cpu", EvaluatorSettings(warmup=1, repeats=3, engine_memory_gb=2.0), seed=3)
    result = _evaluate(small, edited("    big = torch.ones(3 * 2**30, dtype=torch.uint8)\n    o = x.cumsum(1)\n"))
    assert result.status == "runtime_error" and "memory" in result.message.lower(), result.message
    assert _evaluate(small, edited("    o = torch.cumsum(x, dim=1)\n")).status == OK  # the limit leaves room
