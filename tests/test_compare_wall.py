"""`evo compare` at equal wall time and against the default genome: a run stops proposing once its charge
(evaluations at their measured cost, its own time, its own re-timings) reaches the wall budget; every run's
best is re-timed paired against the default genome. A synthetic evaluator with a fixed cost per evaluation
(no sleeping: the cost is charged, not spent) and a synthetic paired judge; one end-to-end run on the
`llama_serve` smoke preset."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from evaluators.judge.synthetic import SyntheticEvaluator
from evo.bench.compare import compare, run_lines
from evo.bench.paired import AgainstDefault, LocalRetimer
from evo.bench.strategies import Meter, Step, Trajectory
from evo.cli import build_parser
from evo.core.genome import Genome
from evo.core.records import EvalResult, Evaluated, Proposal
from evo.core.retiming import Challenge, IntensifySettings, not_timed, paired_timing
from evo.driver.config import config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[1]
COST_S = 0.1  # what each synthetic evaluation is charged, as if measured so


class Costed(SyntheticEvaluator):
    """The synthetic evaluator with a measured cost of COST_S per evaluation."""

    def evaluate(self, genome_json: str):
        return dataclasses.replace(super().evaluate(genome_json), eval_s=COST_S)


class CostedJudge(Costed):
    """... that also re-times paired: each engine's synthetic latency times log-normal noise (sigma 2%)."""

    def __init__(self) -> None:
        super().__init__()
        self.truth, self.rng = SyntheticEvaluator(), np.random.default_rng(0)

    def retime(self, engines, *, calls, warmup, min_effect, sources=None, reason="ab", generation=-1):
        (a, a_ms), *others = [(Genome.from_json(e).hash, self.truth.evaluate(e).latency_ms) for e in engines]
        noisy = lambda ms: ms * np.exp(self.rng.normal(0.0, 0.02, calls))  # noqa: E731
        return [paired_timing(a, b, noisy(a_ms), noisy(b_ms), min_effect, reason=reason, generation=generation)
                for b, b_ms in others]


def kda_config(tmp_path: Path):
    """The KDA space, eager only (plenty of genomes); its default genome is legal and passes."""
    return config_from_dict({"workload": "kda", "preset": "cpu_small", "name": "t", "out_dir": str(tmp_path),
                             "genes": {f"backend_{s}": ["eager"] for s in ("gate", "l2norm", "intra", "recurrence",
                                                                              "output")},
                             "search": {"offspring": 6, "population": {"size": 6, "elite": 2, "tournament": 2}},
                             "mlflow": {"enabled": False}})


def quietly(tmp_path: Path, name: str = "log.txt"):
    return open(tmp_path / name, "w")


def test_a_wall_budget_stops_each_run_once_its_charge_reaches_it(tmp_path: Path) -> None:
    wall_s = 1.0
    results = compare(kda_config(tmp_path), ["agents", "random", "tpe"], seeds=2, wall_s=wall_s,
                      bench_dir=tmp_path / "bench", evaluator=Costed(), log_mlflow=False, out=quietly(tmp_path))
    assert results["budget"] == {"kind": "seconds", "evaluations": None, "wall_s": wall_s}
    assert len(results["trajectories"]) == len(results["runs"]) == 6
    for t in results["trajectories"]:
        steps = t["steps"]
        assert all(s["cost_s"] == COST_S for s in steps)  # a cached result costs what it cost when measured
        charges = [s["charged_s"] for s in steps]
        assert charges == sorted(charges) and t["charged_s"] == charges[-1]
        # it stopped at its charge: the last evaluation began before S, and no other could begin after it
        assert t["charged_s"] - steps[-1]["cost_s"] < wall_s <= t["charged_s"] + t["propose_s"]
        assert t["charged_s"] >= sum(s["cost_s"] for s in steps)  # plus its own time
    for run in results["runs"]:  # every run's charge is reported, in results.json and the table
        assert run["charged_s"] > 0 and run["evaluations"] >= 1
    table = (tmp_path / "bench" / "table.md").read_text()
    assert f"budget {wall_s:g} s of charged time per run" in table and "| charged s |" in table
    assert all(f"| {n}/{seed} |" in table for n in ("agents", "random", "tpe") for seed in (0, 1))
    assert all(math.isfinite(r["charged_s"]) for r in results["rows"])


def test_every_strategy_has_its_best_against_the_default_genome_paired(tmp_path: Path) -> None:
    config, wall_s = kda_config(tmp_path), 2.0  # two generations and the agents' first challenges fit
    results = compare(config, ["agents", "random", "tpe"], seeds=2, wall_s=wall_s, bench_dir=tmp_path / "bench",
                      evaluator=CostedJudge(), log_mlflow=False, out=quietly(tmp_path))
    default = results["default"]
    against = results["against_default"]
    assert against["default"] == default
    for t in against["timings"]:
        assert t["b"] == default and t["reason"] == "default"
        assert t["min_effect"] == config.search.intensify.min_effect and len(t["samples_a_ms"]) == 16
    timed = {t["a"]: t for t in against["timings"]}
    for run in results["runs"]:
        s = run["speedup"]
        if run["best_hash"] == default:  # the default itself: 1.0, no interval
            assert s["estimate"] == 1.0 and s["low"] is None
        else:
            assert s["low"] <= s["estimate"] <= s["high"]
            assert s["estimate"] == pytest.approx(1 / timed[run["best_hash"]]["ratio"])
    assert {r["strategy"] for r in results["rows"]} == {"agents", "random", "tpe"}
    assert all(r["default_speedup"] > 0 and r["default_speedup_single"] > 0 for r in results["rows"])
    agents = [t for t in results["trajectories"] if t["strategy"] == "agents"]
    assert sum(len(t["retimings"]) for t in agents) > 0  # the agents intensified, charged to their runs
    for t in results["trajectories"]:  # nothing began at or after S
        assert all(s["charged_s"] - s["cost_s"] < wall_s for s in t["steps"])
    table = (tmp_path / "bench" / "table.md").read_text()
    assert "speedup over the default (paired), median" in table and "speedup over the default (paired) [95%]" in table


def test_a_best_that_is_the_default_genome_is_speedup_one_without_interval() -> None:
    default = "d" * 16
    run = Trajectory("random", 0, (Step(default, "ok", 2.0, COST_S, "random", COST_S, COST_S),), 0.0, charged_s=COST_S)
    (line,) = run_lines({"random": [run]}, 1, default, AgainstDefault(default, ()))
    assert line.speedup.estimate == 1.0 and math.isnan(line.speedup.low) and line.single_speedup == 1.0
    assert line.paired_text(default) == "1 (the best is the default genome: no interval)"


def test_no_re_timing_starts_once_the_charge_reaches_the_wall_budget() -> None:
    from tests.toy_space import toy_space

    space = toy_space()
    a, b = space.default(), space.make({"chunk_size": 32})
    done = lambda g: Evaluated(Proposal(g, (), "seed", "", 0), EvalResult(g.hash, "ok", latency_ms=1.0))  # noqa: E731
    challenge = Challenge(done(b), done(a), "incumbent", 1)
    judge, meter = CostedJudge(), Meter(wall_s=60.0)
    retimer = LocalRetimer(judge, meter)
    (timed,) = retimer.retime([challenge], IntensifySettings(calls=8))
    assert timed.verdict != "failed" and 0 < meter.charged_s < 60.0  # charged its wall time
    meter.wall_s = meter.now()  # the budget is spent
    (left,) = retimer.retime([challenge], IntensifySettings(calls=8))
    assert not_timed(left) and (left.a, left.b) == (b.hash, a.hash) and retimer.timings == [timed]


def test_budget_and_wall_time_are_one_or_the_other(tmp_path: Path, capsys) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["compare", "c.yaml", "--budget", "3", "--wall-s", "10"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert parser.parse_args(["compare", "c.yaml"]).budget is None  # main() runs 40 evaluations then
    args = parser.parse_args(["compare", "c.yaml", "--wall-s", "300"])
    assert args.wall_s == 300.0 and args.budget is None
    for budget, wall_s in ((None, None), (3, 10.0)):
        with pytest.raises(ValueError, match="exactly one budget: --budget E .* or --wall-s S"):
            compare(kda_config(tmp_path), ["random"], 1, budget, tmp_path / "b", evaluator=Costed(), wall_s=wall_s)


def test_compare_runs_on_llama_serve_at_a_wall_budget(tmp_path: Path) -> None:
    """End to end on the generation workload's smoke preset, with the real in-process evaluator."""
    config = dataclasses.replace(load_config(ROOT / "configs/llama_serve_smoke.yaml"), out_dir=str(tmp_path))
    results = compare(config, ["agents", "random", "tpe"], seeds=1, wall_s=5.0, bench_dir=tmp_path / "bench",
                      log_mlflow=False, out=quietly(tmp_path))
    assert results["budget"]["kind"] == "seconds" and results["context"]["workload"] == "llama_serve"
    assert {r["strategy"] for r in results["runs"]} == {"agents", "random", "tpe"}
    for run in results["runs"]:
        assert run["best_hash"] and run["charged_s"] > 0
        assert run["speedup"] is not None and run["speedup"]["estimate"] > 0  # paired against the default
    assert "speedup over the default (paired) [95%]" in (tmp_path / "bench" / "table.md").read_text()
