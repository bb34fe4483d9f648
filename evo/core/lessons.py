"""Lessons: what a search learned, kept per (workload, preset, device) so the next search starts from it.

A lessons file (`lessons.yaml` in a run directory, also logged to the run's MLflow parent run) is
small, versioned and readable by a person: the best genomes with their latencies (and the sources of
their code genes, so a later run can build them), what pays off and what fails (with evidence counts
and the commonest failure messages), the agents' move statistics and yields, and the raw per-gene
effects the search reads back. A warm-started run's lessons include
the earlier runs' evidence, so lessons accumulate run after run.

`python -m evo run CONFIG --warm-start SOURCE` reads lessons from a run directory, a lessons file,
or an MLflow experiment (the newest run of the same workload and preset that logged lessons). Lessons of
another workload on the same device warm-start a run only on the genes both declare (`Lessons.shared_with`:
e.g. a run on one model's layers for a hybrid model whose layers of that kind take that workload's genes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from evo.core.code import CodeStore, code_hash, is_code_hash
from evo.core.effects import GeneEffects, ValueEvidence, value_key
from evo.core.genome import GeneSpace, Genome, GenomeError

FORMAT = 1
FILE = "lessons.yaml"
KEEP_BEST = 5


class LessonsError(ValueError):
    """Lessons that cannot be used here; the message says what was found and what was expected."""


@dataclass(frozen=True)
class Lessons:
    workload: str
    preset: str
    device: str  # "<kind>:<name>" as results record it: timings of other devices are never reused
    best: tuple[tuple[dict, float], ...]  # (genome, latency_ms), fastest first
    agent_stats: dict[str, dict[str, list[int]]]  # agent -> move kind -> [tries, wins]
    yields: dict[str, list[int]]  # agent -> [children, children that beat their parent]
    effects: GeneEffects = field(compare=False)
    sources: tuple[str, ...] = ()  # runs this evidence comes from, oldest first
    evaluations: int = 0
    code: dict[str, str] = field(default_factory=dict, compare=False)  # code hash -> source, for `best`
    shared: tuple[str, ...] = ()  # another workload's lessons: the genes kept, those this run declares too
    used: tuple[str, ...] = ()  # ... and what those lessons say about them (pays_off, slow, fails lines)

    def describe(self) -> str:
        text = f"{self.workload}/{self.preset} on {self.device} from {', '.join(self.sources) or '?'}"
        if self.shared:
            text += (f", on the genes shared with this run only ({', '.join(self.shared)}): lessons used: "
                     + ("; ".join(self.used) or "none yet, evidence counts only"))
        return text

    def shared_with(self, space: GeneSpace) -> Lessons:
        """These lessons (of another workload) as far as they hold in `space`: the per-value evidence (tries,
        failures and their messages) of the genes `space` declares under the same name, on values legal there.
        Latencies stay behind (another workload times another thing: its milliseconds are not this run's), as
        do its best genomes (they build no engine here) and its agents' move statistics."""
        legal = {g.name: {value_key(v) for v in g.values} for g in space.genes}
        effects = GeneEffects()
        for gene, values in self.effects.values.items():
            kept = {k: ValueEvidence(ev.tries, ev.ok, 0.0, dict(ev.failures), dict(ev.messages))
                    for k, ev in values.items() if k in legal.get(gene, ())}
            if kept:
                effects.values[gene] = kept
        said = self.to_dict()

        def on_shared(line: str) -> bool:  # "gene=value: ..."
            gene, _, value = line.partition(":")[0].partition("=")
            return value in effects.values.get(gene, {})

        used = tuple(line for key in ("pays_off", "slow", "fails") for line in said[key] if on_shared(line))
        return replace(self, best=(), agent_stats={}, yields={}, effects=effects, code={},
                       shared=tuple(sorted(effects.values)), used=used)

    def legal_best(self, space: GeneSpace) -> list[tuple[int, Genome, float]]:
        """(rank, genome, latency) of the best genomes that are legal in `space` (a config may restrict it); a genome
        stored before a gene was added gets that gene's default (`GeneSpace.completed`), as a champion does."""
        out = []
        for rank, (data, latency) in enumerate(self.best):
            try:
                out.append((rank, space.validate(space.completed(Genome.from_dict(data))), latency))
            except GenomeError:
                continue
        return out

    def check(self, workload: str, preset: str, device: str, where: str) -> Lessons:
        if (self.workload, self.preset, self.device) != (workload, preset, device):
            raise LessonsError(
                f"{where}: lessons are for workload={self.workload!r} preset={self.preset!r} device={self.device!r}, "
                f"this run is workload={workload!r} preset={preset!r} device={device!r}; warm-start only from runs "
                f"of the same workload, preset and device, or of another workload on the same device (the genes "
                f"both declare)")
        return self

    # -- the file -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        rows = self.effects.table()
        timed = sorted((r for r in rows if r["ok"] >= 2 and r["latency_vs_mean_pct"] is not None),
                       key=lambda r: r["latency_vs_mean_pct"])
        pays = [r for r in timed if r["latency_vs_mean_pct"] < 0]
        slow = [r for r in reversed(timed) if r["latency_vs_mean_pct"] > 0]
        fails = sorted((r for r in rows if r["failed"] >= 2 and r["failed"] >= r["results"] / 2),
                       key=lambda r: -r["failed"] / r["results"])
        return {
            "format": FORMAT,
            "workload": self.workload, "preset": self.preset, "device": self.device,
            "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "sources": list(self.sources), "evaluations": self.evaluations,
            "best": [{"hash": Genome.from_dict(g).hash, "latency_ms": round(lat, 4), "genome": g}
                     for g, lat in self.best],
            "code": dict(sorted(self.code.items())),
            "pays_off": [f"{r['gene']}={r['value']}: {r['latency_vs_mean_pct']:+.1f}% vs the mean engine "
                         f"({r['ok']} ok results)" for r in pays[:8]],
            "slow": [f"{r['gene']}={r['value']}: {r['latency_vs_mean_pct']:+.1f}% vs the mean engine "
                     f"({r['ok']} ok results)" for r in slow[:8]],
            "fails": [f"{r['gene']}={r['value']}: {r['failed']} of {r['results']} failed {r['failures']}"
                      + (f"; e.g. {max(r['messages'], key=r['messages'].get)!r}" if r["messages"] else "")
                      for r in fails[:8]],
            "agents": {a: {"children": self.yields.get(a, [0, 0])[0], "beat_parent": self.yields.get(a, [0, 0])[1],
                           "moves": {k: list(v) for k, v in sorted(self.agent_stats.get(a, {}).items())}}
                       for a in sorted(set(self.yields) | set(self.agent_stats))},
            "gene_effects": self.effects.to_dict(),
            **({"shared_genes": list(self.shared), "used": list(self.used)} if self.shared else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> Lessons:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise LessonsError(f"{where}: lessons format {got!r}; this version reads format {FORMAT}")
        code = _checked_code(data.get("code") or {}, where)
        try:
            agents = data.get("agents") or {}
            return cls(
                workload=data["workload"], preset=data["preset"], device=data["device"],
                best=tuple((b["genome"], float(b["latency_ms"])) for b in data.get("best") or []),
                agent_stats={a: {k: list(v) for k, v in (s.get("moves") or {}).items()} for a, s in agents.items()},
                yields={a: [int(s["children"]), int(s["beat_parent"])] for a, s in agents.items()},
                effects=GeneEffects.from_dict(data["gene_effects"]),
                sources=tuple(data.get("sources") or ()), evaluations=int(data.get("evaluations") or 0),
                code=code, shared=tuple(data.get("shared_genes") or ()), used=tuple(data.get("used") or ()))
        except (KeyError, TypeError, ValueError) as exc:
            raise LessonsError(f"{where}: lessons file is corrupt ({type(exc).__name__}: {exc})") from exc


def _checked_code(code: Any, where: str) -> dict[str, str]:
    if not isinstance(code, dict):
        raise LessonsError(f"{where}: 'code' must map code hashes to sources, got {type(code).__name__}")
    for digest, source in code.items():
        if not isinstance(source, str) or code_hash(source) != digest:
            raise LessonsError(f"{where}: the source under code hash {digest!r} is damaged (it hashes to "
                               f"{code_hash(source) if isinstance(source, str) else type(source).__name__})")
    return dict(code)


def from_search(search, workload: str, preset: str, device: str, source: str,
                store: CodeStore | None = None) -> Lessons:
    """What `search` (an `evo.core.search.Search`) knows now, including the lessons it was warm-started with;
    the sources of the best genomes' code come from `store` (this run's) or the earlier lessons."""
    earlier = search.lessons
    best: dict[str, tuple[dict, float]] = {}
    if earlier is not None:
        best = {Genome.from_dict(g).hash: (g, lat) for g, lat in earlier.best}
    for item in search.known.values():  # this run's timings replace an earlier run's for the same genome
        if math.isfinite(item.fitness):
            best[item.proposal.hash] = (item.proposal.genome.to_dict(), item.fitness)
    ranked = sorted(best.items(), key=lambda kv: kv[1][1])
    # the search's best first: with intensification its wins were confirmed by paired re-timing, while a
    # faster single timing of another genome may be luck (`evo.core.search`)
    incumbent = search.best() if callable(getattr(search, "best", None)) else None
    if incumbent is not None and incumbent.proposal.hash in best:
        ranked.sort(key=lambda kv: kv[0] != incumbent.proposal.hash)  # stable: the rest stay by latency
    top = [b for _, b in ranked[:KEEP_BEST]]
    known_code = earlier.code if earlier else {}
    code = {}
    for genome, _ in top:
        for digest in filter(is_code_hash, Genome.from_dict(genome).values().values()):
            if store is not None and store.has(digest):
                code[digest] = store.get(digest)
            elif digest in known_code:
                code[digest] = known_code[digest]
    team = search.team.state()
    return Lessons(
        workload=workload, preset=preset, device=device, best=tuple(top),
        agent_stats={a: {k: list(v) for k, v in s.get("stats", {}).items()} for a, s in team.items()},
        yields={a: list(v) for a, v in search.yields.items()},
        effects=search.effects,
        sources=(*(earlier.sources if earlier else ()), source),
        evaluations=(earlier.evaluations if earlier else 0) + search.evaluations,
        code=code,
    )


def write(path: Path, lessons: Lessons) -> Path:
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"# Lessons of engine-factory searches on {lessons.workload}/{lessons.preset}, {lessons.device}.\n"
                   "# pays_off / slow / fails / agents are for people; best, agents and gene_effects seed the next search\n"
                   "# (python -m evo run CONFIG --warm-start RUN_DIR|LESSONS_FILE|MLFLOW_EXPERIMENT).\n"
                   + "".join(_dump(key, value) for key, value in lessons.to_dict().items()))
    tmp.replace(path)
    return path


class _SourceDumper(yaml.SafeDumper):
    """Multi-line strings (engine sources) as literal blocks, readable as code."""


_SourceDumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def _dump(key: str, value: Any) -> str:
    """One top-level key: the sentences in block style, genomes and effect rows one per line, sources
    as literal blocks."""
    if key == "code":
        return yaml.dump({key: value}, Dumper=_SourceDumper, sort_keys=False, width=200, default_flow_style=False)
    flow = None if key in ("best", "gene_effects") else False
    return yaml.safe_dump({key: value}, sort_keys=False, width=200, default_flow_style=flow)


def read(path: Path) -> Lessons:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise LessonsError(f"{path}: cannot read lessons ({type(exc).__name__}: {exc})") from exc
    return Lessons.from_dict(data, str(path))


WARM_FILE = "warm_start.yaml"  # the lessons a run was warm-started with, kept so a resume uses them again


def for_run(run_dir: Path, lessons: Lessons | None, resumed: bool, workload: str, preset: str,
            device: str, space: GeneSpace | None = None) -> Lessons | None:
    """The lessons a run starts from: on resume, the ones it was started with; else `lessons`, checked
    against this run's workload, preset and device (another workload's on this device: kept to the genes
    `space` shares with it) and copied into the run directory."""
    saved = Path(run_dir) / WARM_FILE
    if resumed:
        return read(saved) if saved.exists() else None
    if lessons is None:
        return None
    if space is not None and lessons.workload != workload and lessons.device == device:
        lessons = lessons.shared_with(space)
        if not lessons.shared:
            raise LessonsError(f"--warm-start: lessons of workload {lessons.workload!r} hold no evidence on a gene "
                               f"of this {workload!r} run (its genes: {', '.join(g.name for g in space.genes)})")
    else:
        lessons.check(workload, preset, device, "--warm-start")
    write(saved, lessons)
    return lessons
