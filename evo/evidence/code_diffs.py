"""Code in the evidence: sources into the run's code store before evaluation, diffs for lineage review.

`SourceResolver` is what the driver hands the evaluator pool: for a proposal, it stores the new
sources the proposal carries (text only, nothing runs) and returns {hash: source} for every code
gene of the genome. `CodeDiffs` is a sink that, after each generation, writes the unified diff of
every child whose code differs from its first parent's (`lineage/gen_NNNN/diffs/<child>.diff`) and
lists the files MLflow should get with that generation: the diffs, the new sources and the agent's
prompt records.
"""
from __future__ import annotations

from pathlib import Path

from evo.core.code import CodeError, CodeStore, OpenStage, code_hash
from evo.core.records import Evaluated, Proposal
from evo.evidence.sink import Sink
from operators.llm.edits import unified_diff


class SourceResolver:
    def __init__(self, store: CodeStore, code_genes: tuple[str, ...]) -> None:
        self.store, self.code_genes = store, code_genes

    def __call__(self, proposal: Proposal) -> dict[str, str]:
        for digest, source in proposal.sources:
            if code_hash(source) == digest:  # a mismatch is never stored: the judge reports the missing source
                self.store.put(source)
        try:
            return self.store.sources_for(proposal.genome.values(), self.code_genes)
        except CodeError:  # not stored: the judge names the missing source in a build_error
            return {}


class CodeDiffs(Sink):
    def __init__(self, run_dir: Path, store: CodeStore, stages: tuple[OpenStage, ...]) -> None:
        self.run_dir, self.store = Path(run_dir), store
        self.stages = {s.gene: s for s in stages}
        self.files: dict[int, list[tuple[Path, str]]] = {}  # generation -> (file, MLflow artifact folder)

    def on_generation(self, report, search) -> None:
        files: list[tuple[Path, str]] = []
        for item in report.evaluated:
            parent = search.known.get(item.proposal.parents[0]) if item.proposal.parents else None
            diff = self.diff(item, parent)
            if not diff:
                continue
            path = self.run_dir / "lineage" / f"gen_{report.generation:04d}" / "diffs" / f"{item.proposal.hash}.diff"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(diff)
            files.append((path, "diffs"))
            for digest in self._codes(item):
                if self.store.has(digest):
                    files.append((self.store.path(digest), "code"))
            prompt = item.proposal.artifacts.get("prompt")
            if prompt and (self.run_dir / prompt).exists():
                files.append((self.run_dir / prompt, "agent"))
        self.files[report.generation] = files

    def diff(self, child: Evaluated, parent: Evaluated | None) -> str:
        """The unified diff of each open stage whose code differs between parent and child ('' if none)."""
        parts = []
        mine, theirs = child.proposal.genome.values(), parent.proposal.genome.values() if parent else {}
        for gene, stage in self.stages.items():
            new, old = mine.get(gene), theirs.get(gene)
            if new == old or (new is None and parent is None):
                continue
            header = (f"# {gene}: {old or 'hand-written'} -> {new or 'hand-written'}"
                      f" (parent {parent.proposal.hash if parent else '-'}, child {child.proposal.hash})\n")
            parts.append(header + unified_diff(self._source(old, stage), self._source(new, stage),
                                               f"{old or 'hand-written'}.py", f"{new or 'hand-written'}.py"))
        return "\n".join(parts)

    def _source(self, digest: str | None, stage: OpenStage) -> str:
        if digest is None:
            return stage.seed()
        try:
            return self.store.get(digest)
        except CodeError as exc:
            return f"# source unavailable: {exc}\n"

    def _codes(self, item: Evaluated) -> list[str]:
        values = item.proposal.genome.values()
        return [values[g] for g in self.stages if values.get(g)]

