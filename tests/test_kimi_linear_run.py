"""A kimi_linear search end to end on a transformers checkpoint (real Ray, the strict sandbox, a SQLite MLflow
store): a random tiny `KimiLinearForCausalLM` saved with `save_pretrained`, searched as an `hf:` preset for a
few evaluations with the final paired re-timing against a baseline, then the best engine built in this process
and held to transformers' OWN float64 model (not our reference): greedy tokens equal, teacher-forced logits
within float32 rounding. The same search is warm-started from a KDA run's lessons (written here in the lessons
file format): it keeps only their evidence on the genes both workloads declare, and its evidence says which
lessons it used.

The tolerance: transformers keeps its RMSNorms, gates, router and KDA kernels in float32 whatever the model's
dtype (tests/test_kimi_linear_reference.py: its float64 model is within ~2e-6 of a float64 oracle, < 1e-4
asserted there), and our engine computes in float32 (within 1e-5 of the float64 reference in
tests/test_kimi_linear_engine.py). So the two float64-vs-float32 gaps add to ~1e-5 at most: 1e-4 (max abs
error over max abs logit) bounds both with room, while a wrong state, cache or routing is off by O(1).
Tokens are compared exactly; the prompts' greedy margins (top-two gap over the largest logit, 3.6e-3 at the
least here) are asserted above twice that tolerance, so no token can flip by rounding alone.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.models.kimi_linear", reason="transformers >= 5.24 ships KimiLinearForCausalLM")

from evo.core.effects import GeneEffects  # noqa: E402
from evo.core.genome import Genome  # noqa: E402
from evo.core.lessons import FILE, WARM_FILE, Lessons, read, write  # noqa: E402
from evo.core.records import INCORRECT, OK  # noqa: E402
from evo.workloads import get_workload  # noqa: E402
from evo.workloads.base import DeviceInfo  # noqa: E402
from evo.workloads.generation import GenerationRequest  # noqa: E402
from evo.workloads.kimi_linear import engine as kimi_engine  # noqa: E402
from evo.workloads.kimi_linear import model as km  # noqa: E402
from evo.workloads.kimi_linear.presets import PRESETS  # noqa: E402
from tests.generation_driver import drive  # noqa: E402
from tests.models import saved_pretrained  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
W = get_workload("kimi_linear")
CPU = DeviceInfo("cpu", "cpu", 1)
TOLERANCE = 1e-4  # max |ours - transformers float64| / max |transformers float64|: see the module docstring


@pytest.fixture(scope="module")
def checkpoint():
    """A random tiny KimiLinearForCausalLM (cpu_small's layout: 3 KDA + 1 MLA, a dense MLP then 4 experts top-2,
    hidden 64, vocabulary 256) initialised by transformers itself, saved with save_pretrained outside /tmp and
    world-readable: the strict sandbox runs engines as nobody with a private /tmp, and they read the folder."""
    from transformers import KimiLinearForCausalLM

    config = km.hf_config(PRESETS["cpu_small"].model)
    config._experts_implementation = "eager"  # its grouped-mm experts take no float64
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(config)
    with saved_pretrained(model, "kimi-test") as folder:
        yield folder, model.double().eval()


def _kda_lessons(path: Path) -> Lessons:
    """A KDA run's lessons on this machine: threads=1 pays off and threads=2 is slow (ok results at several chunk
    sizes), exponent_form=factored_chunk fails. kimi_linear declares `threads` (values (1,) on one evaluator
    thread) and no exponent_form (its chunked prefill keeps the pairwise form): the threads=1 lesson holds there,
    the other two do not; lessons on chunk_size hold wherever kimi_linear declares it."""
    from evaluators.machine.device import cpu_name

    effects = GeneEffects()
    for threads, chunk, form, ms in [(1, 16, "pairwise", 10.0), (1, 32, "pairwise", 12.0),
                                     (1, 64, "factored_subchunk", 11.0), (2, 16, "pairwise", 20.0),
                                     (2, 32, "factored_subchunk", 23.0), (2, 64, "pairwise", 21.0),
                                     (1, 16, "factored_chunk", 0.0), (1, 32, "factored_chunk", 0.0),
                                     (2, 16, "factored_chunk", 0.0)]:  # 0 ms: a NaN output, judged incorrect
        genome = Genome("kda", scheduling=(("threads", threads), ("chunk_size", chunk), ("exponent_form", form)))
        effects.add(genome, OK if ms else INCORRECT, ms or float("inf"), "" if ms else "output has NaN")
    best = Genome("kda", scheduling=(("threads", 1), ("chunk_size", 16), ("exponent_form", "pairwise"))).to_dict()
    write(path, Lessons("kda", "cpu_small", f"cpu:{cpu_name()}", ((best, 10.0),), {}, {}, effects,
                        ("kda-run",), 9))
    return read(path)


@pytest.fixture(scope="module")
def search_run(ray_local, checkpoint, tmp_path_factory):
    """One short search on the checkpoint, warm-started from a KDA run's lessons, shared by the assertions:
    (preset name, summary, run dir, log, those lessons)."""
    from evo.driver.config import load_config
    from evo.driver.run import run

    folder, _ = checkpoint
    tmp = tmp_path_factory.mktemp("kimi-run")
    kda = _kda_lessons(tmp / "kda-lessons.yaml")
    preset_name = f"hf:{folder},R=2,P=12,N=6,count=4"
    config = load_config(ROOT / "configs" / "kimi_linear_smoke.yaml", [
        f"preset={preset_name}", "baselines=[one_at_a_time]", "search.generations=1", "search.offspring=2",
        "search.max_evaluations=3", "search.population.size=2", "evaluators.count=1",
        "search.intensify.final_race=0", f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
        "mlflow.experiment=kimi-e2e", "mlflow.model_name=kimi-checkpoint-engine"])
    log = io.StringIO()
    result = run(config, tmp / "run", out=log, lessons=kda)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    return preset_name, summary, result.run_dir, log.getvalue(), kda


@pytest.mark.slow
def test_a_search_on_a_checkpoint_judges_in_the_sandbox_and_retimes_its_best(search_run):
    preset_name, summary, run_dir, log, _ = search_run
    assert summary["best_genome"] is not None, log[-3000:]
    assert summary["baselines"]["one_at_a_time"]["status"] == "ok", summary["baselines"]
    judged = [json.loads(line) for line in (run_dir / "evidence.jsonl").read_text().splitlines()]
    assert judged and all(json.loads(r["versions"])["sandbox"] == "strict" for r in judged)  # the real judge
    assert summary["serving"]["best"]["completed"] == 4
    retimings = (run_dir / "retimings.jsonl").read_text().splitlines()
    assert retimings, "the best engine was not re-timed against its baseline"
    estimate, low, high = summary["serving_paired"]["one_at_a_time"]["output_throughput"]
    assert 0 < low <= estimate <= high


def _greedy_margins(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor, float]:
    """transformers' float64 greedy tokens, its teacher-forced logits of them [n, V] (one forward over prompt +
    tokens), and the smallest gap between the top two logits relative to the largest logit."""
    with torch.no_grad():
        tokens = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)[0, len(prompt):].tolist()
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    top = logits.topk(2, -1).values
    return tokens, logits, float(((top[:, 0] - top[:, 1]) / logits.abs().max()).min())


@pytest.mark.slow
def test_the_best_engine_decodes_as_transformers_own_float64_model(search_run, checkpoint, monkeypatch):
    preset_name, summary, _, _, _ = search_run
    _, model = checkpoint
    preset = W.presets()[preset_name]
    seen: dict[int, list[torch.Tensor]] = {}
    pick = kimi_engine.pick_tokens

    def keep(logits, picks):  # the logits rows each request's tokens are picked from, in order
        for row, (request, _) in zip(logits, picks):
            seen.setdefault(request.id, []).append(row.detach().double().clone())
        return pick(logits, picks)

    monkeypatch.setattr(kimi_engine, "pick_tokens", keep)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = W.build_generator(Genome.from_dict(summary["best_genome"]), preset, CPU)
        prompts = [[0, 17, 255, 3, 99, 41, 7, 200, 12, 5, 64, 128], [31, 1]]  # P and a short one, both in flight
        N = preset.shape["N"]
        made = drive(generator, [GenerationRequest(i, tuple(p), N) for i, p in enumerate(prompts)])
    finally:
        torch.set_num_threads(threads)
    errors = []
    for i, prompt in enumerate(prompts):
        tokens, theirs, margin = _greedy_margins(model, prompt, N)
        # every logit within TOLERANCE x max of transformers' cannot swap two whose gap is over twice that
        assert margin > 2 * TOLERANCE, f"prompt {i}: a near-tie ({margin:.1e}) would make the token test luck"
        assert made[i] == tokens, f"prompt {i}"
        ours = torch.stack(seen[i])
        assert ours.shape == theirs.shape == (N, preset.model.vocab)
        err = float((ours - theirs).abs().max() / theirs.abs().max())
        assert err < TOLERANCE, f"prompt {i}: {err:.2e}"
        errors.append(err)
    print(f"best engine vs transformers float64: max relative logit error {max(errors):.1e}")


@pytest.mark.slow
def test_a_kda_runs_lessons_warm_start_it_on_the_shared_genes_and_the_evidence_names_them(search_run):
    from evaluators.machine.device import cpu_name

    preset_name, summary, run_dir, log, kda = search_run
    said = kda.to_dict()
    threads_1 = next(line for line in said["pays_off"] if line.startswith("threads=1:"))
    assert any(line.startswith("threads=2:") for line in said["slow"])
    assert any(line.startswith("exponent_form=factored_chunk:") for line in said["fails"])
    legal = {g.name: {str(v) for v in g.values}
             for g in W.gene_space(W.presets()[preset_name], DeviceInfo("cpu", cpu_name(), 1)).genes}
    shared = tuple(sorted(g for g in kda.effects.values if g in legal))  # threads (and chunk_size where declared)
    used = tuple(line for key in ("pays_off", "slow", "fails") for line in said[key]
                 if line.split(":")[0].partition("=")[2] in legal.get(line.split("=")[0], ()))
    assert "threads" in shared and "exponent_form" not in shared and threads_1 in used
    # the evidence: the summary (and the log) name the KDA lessons, the genes kept and the lessons used
    for text in (summary["warm_start"], log):
        assert "kda/cpu_small" in text and "kda-run" in text
        assert f"genes shared with this run only ({', '.join(shared)})" in text and "; ".join(used) in text
        assert "threads=2" not in text and "exponent_form" not in text
    warm = read(run_dir / WARM_FILE)  # what the search started from, kept for a resume
    assert warm.shared == shared and warm.used == used
    assert set(warm.effects.values) == set(shared) and set(warm.effects.values["threads"]) == {"1"}
    assert warm.best == () and warm.agent_stats == {} and not warm.effects.rows  # no KDA genome or timing
    # the KDA evidence on threads=1 joined this run's, and stays in the lessons it leaves
    left = read(run_dir / FILE)
    assert left.workload == "kimi_linear" and left.sources[0] == "kda-run"
    assert left.effects.values["threads"]["1"].tries == kda.effects.values["threads"]["1"].tries + summary["evaluations"]
    assert all(Genome.from_dict(g).workload == "kimi_linear" for g, _ in left.best)
