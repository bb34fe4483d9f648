"""A search's family tree: every evaluated candidate, its parents, and how the best engine came to be.

Read from a run directory (the journal `evidence.jsonl`, else the Parquet generations, plus
`summary.json`, `baselines.json` and the paired re-timings `retimings.jsonl`); no Ray, no MLflow, no
plotting here. A single timing ranks candidates; a paired re-timing decides the winner, so a candidate
can look faster than the winner and not be it: `Lineage.not_the_winner` says why for each. `evo.evidence.lineage_view` draws it;
`python -m evo report` prints `ancestry_lines`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evo.core.jsonl import read_jsonl
from evo.core.retiming import EQUAL, FAILED, FASTER, SLOWER, PairedTiming
from evo.evidence.journal import JOURNAL_FILE, read_generations, read_retimings
from evo.evidence.summary import SUMMARY_FILE, Summary
from evo.core.records import OK, Evaluated

CANDIDATES_FILE = "candidates.json"  # per generation child run, in MLflow's table format (as `log_table` writes)
CANDIDATE_TAGS = ("hash", "parents", "agent", "move", "status", "latency_ms")  # tagged per candidate


@dataclass(frozen=True)
class Node:
    """One evaluated candidate: where it came from, what it is, what its evaluation found."""

    hash: str
    generation: int
    index: int
    agent: str
    move: str
    parents: tuple[str, ...]
    status: str
    message: str
    latency_ms: float  # NaN unless the candidate was measured
    evaluator: str
    genome: dict[str, Any]
    error: str = ""  # traceback or error text of a failure
    eval_s: float = math.nan
    recorded_at: float | None = None  # unix seconds the result was journaled (runs before this field: None)

    @property
    def ok(self) -> bool:
        return self.status == OK and math.isfinite(self.latency_ms)

    def genes(self) -> dict[str, Any]:
        """Genes flattened as "domain.gene" -> value."""
        return {f"{domain}.{gene}": value for domain, genes in sorted(self.genome.items()) if isinstance(genes, dict)
                for gene, value in sorted(genes.items())}


@dataclass(frozen=True)
class Step:
    """One step of the best engine's ancestry: a node and what it gained over its first parent."""

    node: Node
    parent: Node | None

    @property
    def gain_ms(self) -> float:
        """Parent latency minus child latency: positive when the step made the engine faster."""
        return self.parent.latency_ms - self.node.latency_ms if self.parent else math.nan

    @property
    def speedup(self) -> float:
        return self.parent.latency_ms / self.node.latency_ms if self.parent else math.nan


@dataclass(frozen=True)
class Lineage:
    """Every evaluated candidate of a run, by hash in evaluation order, and the best one."""

    name: str
    nodes: dict[str, Node]
    best: str | None
    baseline: tuple[str, float] | None = None  # fastest correct baseline: (name, latency ms)
    summary: Summary | None = None  # None while the run has no summary.json (still going, or stopped early)
    retimings: tuple[PairedTiming, ...] = ()  # the run's paired re-timings, in the order they ran

    def retimed(self) -> dict[str, list[PairedTiming]]:
        """Each candidate re-timed paired as the challenger (`a`: against a parent, the incumbent, in the final
        race, or the winner against the baselines), with its re-timings in order."""
        out: dict[str, list[PairedTiming]] = {}
        for timing in self.retimings:
            if timing.a in self.nodes:
                out.setdefault(timing.a, []).append(timing)
        return out

    def not_the_winner(self) -> dict[str, str]:
        """Why each correct candidate whose single timing beats the winner's is not the winner: hash -> reason,
        fastest-looking first ({} without a winner)."""
        best = self.nodes.get(self.best)
        if best is None or not best.ok:
            return {}
        retimed = self.retimed()
        unexamined = {u.get("hash"): u.get("reason", "") for u in (self.summary.unexamined if self.summary else [])}
        faster = sorted((n for n in self.nodes.values() if n.ok and n.latency_ms < best.latency_ms and n.hash != best.hash),
                        key=lambda n: (n.latency_ms, n.hash))
        return {n.hash: _why_not(retimed.get(n.hash), unexamined.get(n.hash), bool(self.retimings)) for n in faster}

    def children(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {h: [] for h in self.nodes}
        for node in self.nodes.values():
            for parent in node.parents:
                if parent in out:
                    out[parent].append(node.hash)
        return out

    def edges(self) -> list[tuple[str, str]]:
        """(parent, child) for every parent link whose parent was evaluated in this run."""
        return [(p, n.hash) for n in self.nodes.values() for p in n.parents if p in self.nodes]

    def ancestors(self, genome_hash: str | None) -> set[str]:
        """The node and every ancestor through all parents (both parents of an integration child)."""
        seen: set[str] = set()
        todo = [genome_hash] if genome_hash in self.nodes else []
        while todo:
            h = todo.pop()
            if h not in seen:
                seen.add(h)
                todo.extend(p for p in self.nodes[h].parents if p in self.nodes)
        return seen

    def chain(self, genome_hash: str | None = None) -> list[Step]:
        """From a seed to `genome_hash` (default: the best), following first parents, oldest first."""
        steps, seen, h = [], set(), genome_hash or self.best
        while h in self.nodes and h not in seen:
            seen.add(h)
            node = self.nodes[h]
            first = node.parents[0] if node.parents else None
            steps.append(Step(node, self.nodes.get(first)))
            h = first
        return steps[::-1]

    def best_so_far(self) -> list[tuple[Node, float]]:
        """Each candidate in the order its result arrived, with the best latency up to and including it."""
        order = sorted(self.nodes.values(), key=lambda n: (n.recorded_at is None, n.recorded_at or 0.0,
                                                           n.generation, n.index))
        best, out = math.inf, []
        for node in order:
            if node.ok:
                best = min(best, node.latency_ms)
            out.append((node, best))
        return out

    def started_at(self) -> float | None:
        """When the first evaluation began (unix seconds), if the journal has timestamps."""
        starts = [n.recorded_at - (n.eval_s if math.isfinite(n.eval_s) else 0.0)
                  for n in self.nodes.values() if n.recorded_at is not None]
        return min(starts) if starts else None


def gene_diff(child: Node, parent: Node) -> list[tuple[str, Any, Any]]:
    """(gene, parent value, child value) for every gene the child changed."""
    a, b = parent.genes(), child.genes()
    return [(gene, a.get(gene), b.get(gene)) for gene in sorted(set(a) | set(b)) if a.get(gene) != b.get(gene)]


def load_lineage(run_dir: Path) -> Lineage:
    """Every candidate of a run directory. Raises FileNotFoundError naming what is missing."""
    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / JOURNAL_FILE) or read_generations(run_dir).to_pylist()  # JsonlError when damaged
    if not rows and not (run_dir / "generations").is_dir():
        raise FileNotFoundError(f"{run_dir} has neither evidence.jsonl nor generations/*.parquet: not a run directory")
    nodes: dict[str, Node] = {}
    for row in sorted(rows, key=lambda r: (r["generation"], r["index"])):
        nodes[row["genome_hash"]] = _node(row)
    summary = _read_summary(run_dir / SUMMARY_FILE)
    best = summary.best_hash if summary else None
    if best not in nodes:  # a run still going (or stopped before its summary): the fastest correct result
        ok = [n for n in nodes.values() if n.ok]
        best = min(ok, key=lambda n: n.latency_ms).hash if ok else None
    baselines = _read_json(run_dir / "baselines.json")
    timed = [(name, r["latency_ms"]) for name, r in baselines.items()
             if r.get("status") == OK and r.get("latency_ms") is not None]
    return Lineage(run_dir.name, nodes, best, min(timed, key=lambda t: t[1]) if timed else None, summary,
                   tuple(read_retimings(run_dir)))


def _why_not(timings: list[PairedTiming] | None, unexamined: str | None, retimed_any: bool) -> str:
    """Why a faster-looking candidate is not the winner, from its last paired re-timing (or its absence)."""
    if not timings:
        if unexamined is not None:
            return f"not re-timed: {unexamined or 'left unexamined'}"
        return ("not re-timed: the re-timing budget was spent" if retimed_any
                else "not re-timed: paired re-timing was off or did not run; a single timing ranks it")
    t = timings[-1]
    against = t.b[:16]
    interval = f"latency ratio {t.ratio:.3f}, 95% [{t.low:.3f}, {t.high:.3f}]"
    if t.verdict == EQUAL:
        return f"re-timed: equal within noise to {against} ({interval})"
    if t.verdict == SLOWER:
        return f"re-timed: slower than {against} ({interval})"
    if t.verdict == FAILED:
        return f"re-timed: failed against {against} ({t.message[:160] or 'no message'})"
    if t.verdict == FASTER and t.reason == "parent":
        return (f"re-timed against its parent only: faster than {against} ({interval}); its single timing did not"
                " beat the incumbent's then, so it never raced the incumbent")
    return (f"re-timed: faster than {against} ({interval}), but another challenger was confirmed faster still"
            " and it was not re-timed against that one")


def ancestry_lines(lineage: Lineage) -> list[str]:
    """The best engine's ancestry, one line per step: generation, agent, move, latency, gain."""
    if lineage.best is None:
        return [f"{lineage.name}: no correct engine among {len(lineage.nodes)} candidates"]
    steps = lineage.chain()
    best = lineage.nodes[lineage.best]
    lines = [f"ancestry of {best.hash}: {len(steps) - 1} step(s) from its seed; by single timings (one evaluation's"
             f" median each, not claims): {best.latency_ms:.3f} ms"
             + (f", {lineage.baseline[1] / best.latency_ms:.2f}x vs {lineage.baseline[0]}" if lineage.baseline else "")
             + "; gain: speedup over the first parent (latency change)"]
    lines.append(f"{'gen':>4}  {'hash':16}  {'agent':12}  {'latency ms':>10}  {'gain':>20}  move")
    for step in steps:
        node = step.node
        gain = "seed" if step.parent is None else f"{step.speedup:.2f}x ({-step.gain_ms:+.3f} ms)"
        others = [p[:8] for p in node.parents[1:]]
        move = node.move + (f" (second parent {', '.join(others)})" if others else "")
        lines.append(f"{node.generation:>4}  {node.hash:16}  {node.agent:12}  {node.latency_ms:10.3f}  {gain:>20}  {move}")
    return lines


def candidate_table(evaluated: list[Evaluated] | tuple[Evaluated, ...], known: dict[str, Evaluated]) -> list[dict[str, Any]]:
    """One row per candidate of a generation, by index: its lineage and what its evaluation found.

    `known` holds every evaluated genome by hash (the search's), for the first parent's latency."""
    rows = []
    for item in sorted(evaluated, key=lambda e: e.proposal.index):
        p, r = item.proposal, item.result
        first = known.get(p.parents[0]) if p.parents else None
        parent_ms = first.result.latency_ms if first is not None and first.result.ok else None
        latency = r.latency_ms if math.isfinite(r.latency_ms) else None
        rows.append({"index": p.index, "hash": p.hash, "parents": ",".join(p.parents), "agent": p.agent, "move": p.move,
                     "status": r.status, "latency_ms": latency, "parent_latency_ms": parent_ms,
                     "latency_change_ms": latency - parent_ms if r.ok and parent_ms is not None else None,
                     "evaluator": r.evaluator, "message": r.message[:300], **_code_columns(p)})
    return rows


def _code_columns(p) -> dict[str, Any]:
    """A code agent's candidate: its code hash, tokens, cost and where its diff and prompt are (else empty)."""
    metrics, artifacts = p.metrics, p.artifacts
    code = artifacts.get("code_hash", "")
    return {"code_hash": code, "tokens": metrics.get("tokens_in", 0) + metrics.get("tokens_out", 0),
            "cost_usd": metrics.get("cost_usd", 0.0),
            "code_diff": f"diffs/{p.hash}.diff" if code else "", "prompt": artifacts.get("prompt", "")}


def candidate_tags(rows: list[dict[str, Any]]) -> dict[str, str]:
    """MLflow tags `candidate.NN.FIELD` (hash, parents, agent, move, status, latency_ms), which the UI's run
    comparison lines up across generations."""
    tags = {}
    for row in rows:
        for name in CANDIDATE_TAGS:
            value = row[name]
            tags[f"candidate.{row['index']:02d}.{name}"] = (f"{value:.4f}" if isinstance(value, float) else
                                                            "" if value is None else str(value))[:5000]
    return tags


def write_candidate_table(rows: list[dict[str, Any]], path: Path) -> Path:
    """The rows as MLflow's table JSON (`{"columns": [...], "data": [[...]]}`, what `log_table` writes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(rows[0]) if rows else ["index", "hash"]
    table = {"columns": columns, "data": [[row[c] for c in columns] for row in rows]}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(table, allow_nan=False))
    tmp.replace(path)
    return path


def _node(row: dict[str, Any]) -> Node:
    def number(key: str) -> float:
        value = row.get(key)
        return math.nan if value is None else float(value)

    try:
        genome = json.loads(row["genome"])
    except (TypeError, json.JSONDecodeError):
        genome = {}
    return Node(hash=row["genome_hash"], generation=int(row["generation"]), index=int(row["index"]),
                agent=row["agent"], move=row["move"], parents=tuple(row["parents"] or ()), status=row["status"],
                message=row.get("message") or "", latency_ms=number("latency_ms"), evaluator=row.get("evaluator") or "",
                genome=genome, error=row.get("error") or "", eval_s=number("eval_s"), recorded_at=row.get("recorded_at"))


def _read_summary(path: Path) -> Summary | None:
    try:
        return Summary.read(path)
    except (FileNotFoundError, ValueError, TypeError):  # none yet, or half a file of an older version
        return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
