"""`python -m evo ab CONFIG A B`: the paired test of two engines, in this process (no Ray, no MLflow).

A and B are each: genome JSON (a full genome, or a flat {gene: value} map that takes defaults), a file
holding one, a genome hash (or its prefix) from a run's evidence (`--run RUN_DIR`, else every run
directory under the config's `out_dir`), `default` (the gene space's default genome), or a baseline's
name. Both are built in one evaluator and called interleaved (`evaluators.judge.paired`); the answer is the
latency ratio A / B with its 95% interval and the verdict: faster, slower, or equal within noise.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from evo.core.genome import Genome, GeneSpace
from evo.core.jsonl import read_jsonl
from evo.core.retiming import PairedTiming
from evo.core.seeds import derive_seed
from evo.driver.config import RunConfig
from evo.evidence.journal import JOURNAL_FILE

_HASH = re.compile(r"^[0-9a-f]{6,64}$")


class EngineNotFound(ValueError):
    """An A or B that names no engine; the message says what was tried."""


def resolve(text: str, space: GeneSpace, run_dirs: list[Path]) -> str:
    """What the evaluator is given for `text`: genome JSON, `default` or `baseline:NAME`."""
    text = text.strip()
    if text == "default" or text.startswith("baseline:"):
        return text
    if text.startswith("{"):
        return _genome_json(text, space, "the genome given")
    path = Path(text)
    if path.is_file():
        return _genome_json(path.read_text(), space, str(path))
    if _HASH.match(text):
        found = _from_evidence(text, run_dirs)
        if found is not None:
            return found
    return f"baseline:{text}"  # the evaluator names the baselines there are, should it be none of them


def _genome_json(text: str, space: GeneSpace, where: str) -> str:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EngineNotFound(f"{where} is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise EngineNotFound(f"{where} is not a JSON object")
    genome = space.validate(Genome.from_dict(data)) if "workload" in data else space.make(data)
    return genome.to_json()


def _from_evidence(prefix: str, run_dirs: list[Path]) -> str | None:
    """The genome JSON whose hash starts with `prefix` in the runs' evidence (ambiguous: an error)."""
    found: dict[str, str] = {}
    for run_dir in run_dirs:
        journal = Path(run_dir) / JOURNAL_FILE
        if journal.exists():
            for row in read_jsonl(journal):
                if str(row.get("genome_hash", "")).startswith(prefix):
                    found[row["genome_hash"]] = row["genome"]
    if len(found) > 1:
        raise EngineNotFound(f"hash {prefix!r} is ambiguous in the evidence: {sorted(found)[:5]}; give more digits")
    return next(iter(found.values()), None)


def run_dirs(config: RunConfig, given: list[str]) -> list[Path]:
    """The run directories whose evidence hashes are looked up in: those given, else all under out_dir."""
    if given:
        return [Path(g) for g in given]
    root = Path(config.out_dir)
    return sorted(p.parent for p in root.glob(f"*/{JOURNAL_FILE}")) if root.is_dir() else []


def ab(config: RunConfig, a: str, b: str, *, calls: int, warmup: int, min_effect: float,
       runs: list[str] = ()) -> PairedTiming:
    """Time A against B, paired, with the config's workload, preset and evaluator settings."""
    from evaluators.judge.evaluator import Evaluator  # torch loads here, not at `python -m evo --help`

    cores = tuple(range(config.evaluators.threads))
    evaluator = Evaluator(config.workload, config.preset, config.evaluator, derive_seed(config.search.seed, "ab"),
                          "ab-0", cores if config.evaluators.threads else None)
    space = evaluator.workload.gene_space(evaluator.preset, evaluator.device_info())
    dirs = run_dirs(config, list(runs))
    return evaluator.compare(resolve(a, space, dirs), resolve(b, space, dirs), calls=calls, warmup=warmup,
                             min_effect=min_effect, reason="ab")


def report(timing: PairedTiming) -> str:
    """The lines `evo ab` prints."""
    lines = [timing.describe()]
    if timing.verdict != "failed":
        estimate, low, high = timing.speedup
        lines.append(f"A is {estimate:.3f}x as fast as B (95% [{low:.3f}, {high:.3f}]); {timing.wall_s:.1f} s")
        machine = ", ".join(f"{k}={v}" for k, v in sorted(timing.telemetry.items()))
        lines.append(f"machine: {machine}")
    lines.append(f"verdict: {timing.verdict if timing.verdict != 'equal' else 'equal within noise'}")
    return "\n".join(lines)
