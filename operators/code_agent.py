"""CodeAgent: a language model proposes, repairs and critiques the source of a workload's open stages.

The agent works like the others (parents in, proposals out, `observe` every result) but its moves are
code: for a parent and one open stage (`evo.core.code.OpenStage`) it asks an OpenAI-compatible chat
endpoint (`operators.llm.client`) for a search/replace edit within the source's marked blocks (a full
rewrite as the fallback), applies and checks it here without running it (`evo.core.code.check_source`),
and on failure sends the error back for a repair, a bounded number of times. A child is the parent
with that stage's code gene set to the new source's hash; the source travels with the proposal and
runs only in an evaluator's isolated engine process.

It never blocks a generation: `propose` hands over the proposals finished so far and queues new
work on background threads, so the other agents keep proposing while the model thinks. After each
result of its own that failed, or that the search found faster than its parent (with intensification:
confirmed by a paired re-timing), it asks the model for the lesson (the critique) and appends it to
the lessons file of the (workload, device kind), which later runs read; a correct result that was not
found faster gets no lesson (its single timing proves nothing). Every exchange is kept as a JSON artifact in
the run directory (`agent/`), secrets redacted; calls, tokens, dollars and wall time are counted per
candidate (in its `metrics` and `artifacts`) and for the run, against the budget in the settings.
"""
from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from evo.core.code import CodeError, CodeStore, OpenStage, check_source, code_hash
from evo.core.effects import GeneEffects
from evo.core.genome import GeneSpace, Genome, GenomeError
from evo.core.proposer import Feedback, register_proposer
from evo.core.records import Evaluated, Proposal, split_notes
from evo.workloads import get_workload
from evo.workloads.base import DeviceInfo
from operators.base import Agent, Parent
from operators.code_lessons import Lesson, LessonBook
from operators.code_prompts import Relative, critique_messages, proposal_messages, repair_message
from operators.code_settings import CodeAgentSettings
from operators.llm.client import ChatClient, LlmError, Usage, redact
from operators.llm.edits import EditError, apply_change, parse_reply, unified_diff

AGENT_DIR = "agent"  # in the run directory: one JSON artifact per exchange, and log.jsonl
CODE_DIR = "code"  # in the run directory: the code store (evo.core.code.CodeStore)


@dataclass(frozen=True)
class _Job:
    number: int
    parent: Parent
    stage: OpenStage
    seed: int


@dataclass(frozen=True)
class _Mine:
    """What the agent remembers of a proposal of its own until its result arrives."""

    stage: str
    rationale: str
    parent_source_hash: str
    artifact: str


@register_proposer
class CodeAgent(Agent):
    name = "code"
    domain = ""

    def __init__(self, gene_space: GeneSpace, seed: int, *, settings: CodeAgentSettings, workload: str,
                 preset: str, device: DeviceInfo, run_dir: str, lessons_path: str,
                 environ: Mapping[str, str] | None = None) -> None:
        super().__init__(gene_space, seed)
        self.settings = settings
        found = get_workload(workload)
        stages = found.open_stages(found.presets()[preset], device)
        allowed = set(gene_space.code_gene_names()) & set(settings.stages or gene_space.code_gene_names())
        self.stages = {s.gene: s for s in stages if s.gene in allowed}
        if not self.stages:
            raise ValueError(f"the code agent has nothing to edit: workload {workload!r} declares open stages "
                             f"{[s.gene for s in stages]}, the gene space has code genes "
                             f"{list(gene_space.code_gene_names())}, code_agent.stages is {settings.stages}")
        self.domains = {g.name: g.domain for g in gene_space.code_genes}
        self.workload, self.device = workload, f"{device.kind} ({device.name})"
        self.run_dir = Path(run_dir)
        self.store = CodeStore(self.run_dir / CODE_DIR)
        self.artifacts = self.run_dir / AGENT_DIR
        self.artifacts.mkdir(parents=True, exist_ok=True)
        self.lessons = LessonBook(Path(lessons_path), workload, self.device)
        self.client = ChatClient(settings.llm, environ)
        self.spent = Usage()
        self.failures: dict[str, int] = {}  # why jobs ended without a proposal -> how often
        self.jobs = 0
        self.history: dict[str, Evaluated] = {}  # every result seen, by genome hash
        self.mine: dict[str, _Mine] = {}  # own proposals awaiting their result
        self.ready: list[Proposal] = []
        self.handed: dict[str, Proposal] = {}  # given to the search at the last propose, by hash
        self.best_ms = math.inf
        self._known: set[str] = set()
        self._unproven: set[str] = set()  # own correct results not confirmed faster than their parent: no lesson
        self._lock = threading.RLock()
        self._futures: list[Future] = []
        self._pool = ThreadPoolExecutor(max_workers=settings.concurrency, thread_name_prefix="code-agent")

    # -- the agent contract ----------------------------------------------------------------------
    def move_kinds(self, parent: Genome) -> list[str]:
        return [f"edit:{gene}" for gene in self.stages]

    def propose(self, parents: list[Parent], n: int, generation: int,
                exclude: frozenset[str] = frozenset(), effects: GeneEffects | None = None) -> list[Proposal]:
        """The proposals finished since the last call (at most `n`), and new work queued for `parents`."""
        with self._lock:
            self._known |= set(exclude)
            self._futures = [f for f in self._futures if not f.done()]
            # what the search took last time but did not evaluate (it asks for spares) is offered again
            returned = [p for h, p in self.handed.items() if h not in self._known]
            fresh = [p for p in returned + self.ready if p.hash not in self._known]
            handed, self.ready = fresh[:n], fresh[n:]
            self.handed = {p.hash: p for p in handed}
            queued = len(self._futures)
            # the stages each parent's children may carry code for (e.g. Triton kernels only under engine=triton)
            codable = [(p, stages) for p in parents if (stages := self._codable(p.genome))]
            for i in range(max(0, self.settings.queue - queued)):
                if not codable or self.settings.budget.exhausted(self.spent):
                    break
                parent, stages = codable[i % len(codable)]
                self.jobs += 1
                job = _Job(self.jobs, parent, self._pick_stage(stages), int(self.rng.integers(2**31)))
                self._futures.append(self._pool.submit(self._guard, self._propose_one, job))
        return [replace(p, generation=generation) for p in handed]

    def tell(self, feedback: Feedback) -> None:
        """As every agent; and a correct result of its own that the search did not find faster than its
        parent (`feedback.improved`: with intensification, confirmed by a paired re-timing) gets no
        lesson: its single timing claims an effect nobody measured (a comment-only edit "9% faster")."""
        with self._lock:
            self._unproven |= {e.proposal.hash for e in feedback.own(self.name)
                               if e.result.ok and e.proposal.hash not in feedback.improved}
        super().tell(feedback)

    def observe(self, results: tuple[Evaluated, ...]) -> None:
        with self._lock:
            for item in results:
                self.history[item.proposal.hash] = item
                if item.result.ok:
                    self.best_ms = min(self.best_ms, item.result.latency_ms)
                self._known.add(item.proposal.hash)
                mine = self.mine.pop(item.proposal.hash, None)
                if mine is not None and item.proposal.hash in self._unproven:
                    self._unproven.discard(item.proposal.hash)
                    self._write_record({"id": f"critique-{item.proposal.hash}", "kind": "critique",
                                        "stage": mine.stage, "genome": item.proposal.hash,
                                        "outcome": "no lesson: correct, but not found faster than its parent "
                                                   "(equal within noise, or not re-timed)"})
                elif mine is not None:
                    self._futures.append(self._pool.submit(self._guard, self._critique, item, mine))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no work is queued or running (tests and the end of a run); whether it got there."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if all(f.done() for f in self._futures):
                    return True
            time.sleep(0.05)
        return False

    # -- one proposal --------------------------------------------------------------------------
    def _propose_one(self, job: _Job) -> None:
        stage, parent = job.stage, job.parent
        parent_source = self._source_of(parent.genome, stage)
        with self._lock:
            parent_item = self.history.get(parent.genome.hash)
            relatives = self._relatives(parent.genome.hash, stage.gene)
            best_ms = min(self.best_ms, parent.fitness)
        messages = proposal_messages(self.workload, self.device, stage, parent_source, parent_item, best_ms,
                                     relatives, self.lessons.recent(self.settings.lessons_in_prompt, stage.stage))
        record: dict[str, Any] = {"id": f"proposal-{job.number:05d}", "kind": "proposal", "stage": stage.gene,
                                  "parent": parent.genome.hash, "model": self.settings.llm.model, "exchanges": []}
        used = Usage()
        outcome, child, change = "no reply", None, None
        for attempt in range(1 + self.settings.max_repairs):
            reason = self.settings.budget.exhausted(self.spent)
            if reason:
                outcome = f"budget spent: {reason}"
                break
            try:
                reply = self.client.chat(messages, seed=job.seed + attempt)
            except LlmError as exc:
                used = self._spend(used, exc.usage)
                record["exchanges"].append({"messages": messages, "error": f"{exc.kind}: {exc.message}",
                                            "usage": exc.usage.to_dict()})
                outcome = f"llm {exc.kind}: {exc.message}"
                if exc.kind not in ("over_limit", "empty"):  # transport failures: the client already retried
                    break
                messages = [*messages, repair_message(f"{exc.message}; keep the reply short")]
                continue
            used = self._spend(used, reply.usage)
            record["exchanges"].append({"messages": messages, "reply": reply.text, "usage": reply.usage.to_dict(),
                                        "finish_reason": reply.finish_reason})
            try:
                change = parse_reply(reply.text)
                new_source = apply_change(parent_source, change)
                check_source(new_source, stage)
                child = self._child(parent.genome, stage, new_source)
                outcome = f"proposed {child.hash}"
                break
            except (EditError, CodeError, GenomeError) as exc:
                outcome = f"{type(exc).__name__}: {exc}"
                record["exchanges"][-1]["error"] = outcome
                messages = [*messages, {"role": "assistant", "content": reply.text}, repair_message(str(exc))]
        record.update(outcome=outcome, usage=used.to_dict())
        artifact = self._write_record(record)
        if child is None:
            kind = outcome.split(":")[0]
            with self._lock:
                self.failures[kind] = self.failures.get(kind, 0) + 1
            return
        new_hash = self.store.put(new_source)  # text only: the agent reads it back for critiques and children
        metrics = {**used.to_dict(), "repairs": len(record["exchanges"]) - 1}
        artifacts = {"model": self.settings.llm.model, "prompt": artifact, "stage": stage.gene, "code_hash": new_hash,
                     "parent_code": code_hash(parent_source), "rationale": change.rationale}
        proposal = Proposal(genome=child, parents=(parent.genome.hash,), agent=self.name,
                            move=f"{stage.stage}: {_clip(change.rationale, 160)}", move_kind=f"edit:{stage.gene}",
                            generation=0, sources=((new_hash, new_source),), metrics=metrics, artifacts=artifacts)
        with self._lock:
            self.mine[child.hash] = _Mine(stage.gene, change.rationale, code_hash(parent_source), artifact)
            self.ready.append(proposal)

    def _child(self, parent: Genome, stage: OpenStage, source: str) -> Genome:
        data = parent.to_dict()
        data[self.domains[stage.gene]][stage.gene] = code_hash(source)
        child = self.gene_space.validate(Genome.from_dict(data))
        with self._lock:
            if child.hash in self._known or child.hash == parent.hash:
                raise EditError("this exact code was already evaluated; propose a different change")
        return child

    def _codable(self, genome: Genome) -> list[str]:
        """The code genes a child of this genome may set (the workload's constraints decide)."""
        legal = []
        for gene in self.stages:
            data = genome.to_dict()
            data[self.domains[gene]][gene] = "0" * 16
            if self.gene_space.is_legal(Genome.from_dict(data)):
                legal.append(gene)
        return legal

    def _source_of(self, genome: Genome, stage: OpenStage) -> str:
        digest = genome.values().get(stage.gene)
        return self.store.get(digest) if digest else stage.seed()

    def _relatives(self, parent_hash: str, gene: str) -> list[Relative]:
        items: list[Relative] = []
        if parent_hash in self.history:
            items.append(Relative("parent", self.history[parent_hash]))
        siblings = [e for e in self.history.values() if parent_hash in e.proposal.parents]
        tries = [e for e in self.history.values()
                 if e.proposal.agent == self.name and e.proposal.move_kind == f"edit:{gene}" and e not in siblings]
        items += [Relative("sibling", e) for e in siblings[-self.settings.relatives:]]
        items += [Relative("earlier try", e) for e in tries[-self.settings.relatives:]]
        return items[: 1 + self.settings.relatives]

    def _pick_stage(self, genes: list[str]) -> OpenStage:
        """Thompson sampling over the stages' edits that paid (wins) or did not (losses)."""
        draws = [self.rng.beta(self._wins(f"edit:{g}") + 1, self._losses(f"edit:{g}") + 1) for g in genes]
        return self.stages[genes[max(range(len(genes)), key=draws.__getitem__)]]

    # -- critique and lessons -------------------------------------------------------------------
    def _critique(self, item: Evaluated, mine: _Mine) -> None:
        stage = self.stages[mine.stage]
        parent_hash = item.proposal.parents[0] if item.proposal.parents else ""
        with self._lock:
            parent = self.history.get(parent_hash)
        child_source = self._source_of(item.proposal.genome, stage)
        parent_source = (self.store.get(mine.parent_source_hash) if self.store.has(mine.parent_source_hash)
                         else stage.seed())
        diff = unified_diff(parent_source, child_source, f"{mine.parent_source_hash}.py", f"{code_hash(child_source)}.py")
        lesson_text = "no critique asked (code_agent.critique is false)"
        record: dict[str, Any] = {"id": f"critique-{item.proposal.hash}", "kind": "critique", "stage": stage.gene,
                                  "genome": item.proposal.hash, "exchanges": []}
        reason = self.settings.budget.exhausted(self.spent)
        if self.settings.critique and reason:
            lesson_text = f"no critique: budget spent ({reason})"
        elif self.settings.critique:
            messages = critique_messages(stage, mine.rationale, diff, item, parent)
            try:
                reply = self.client.chat(messages, seed=int(item.proposal.hash[:7], 16))
                record["usage"] = self._spend(Usage(), reply.usage).to_dict()
                lesson_text = reply.text.strip()
                record["exchanges"].append({"messages": messages, "reply": reply.text, "usage": reply.usage.to_dict()})
            except LlmError as exc:
                record["usage"] = self._spend(Usage(), exc.usage).to_dict()
                lesson_text = f"critique failed ({exc.kind}: {exc.message})"
                record["exchanges"].append({"messages": messages, "error": lesson_text, "usage": exc.usage.to_dict()})
        critique_artifact = self._write_record({**record, "outcome": lesson_text})
        self.lessons.add(Lesson(
            stage=stage.stage, headline=_headline(item, parent), change=mine.rationale, result=_result(item, parent),
            lesson=redact(lesson_text, self.client.secrets()),
            evidence=f"run {self.run_dir.name}, generation {item.proposal.generation}, genome {item.proposal.hash}, "
                     f"code {code_hash(child_source)}, prompt {mine.artifact}, critique {critique_artifact}"),
            item.proposal.hash)

    # -- bookkeeping ----------------------------------------------------------------------------
    def _spend(self, used: Usage, usage: Usage) -> Usage:
        with self._lock:
            self.spent = self.spent + usage
        return used + usage

    def _write_record(self, record: dict[str, Any]) -> str:
        """Write one exchange record (secrets redacted) and its line in log.jsonl; its run-relative path."""
        secrets = self.client.secrets()
        text = redact(json.dumps(record, indent=1, sort_keys=True, default=str), secrets)
        path = self.artifacts / f"{record['id']}.json"
        path.write_text(text)
        line = {k: record.get(k) for k in ("id", "kind", "stage", "parent", "genome", "outcome", "usage")}
        with self._lock, open(self.artifacts / "log.jsonl", "a") as log:
            log.write(redact(json.dumps(line, sort_keys=True, default=str), secrets) + "\n")
        return f"{AGENT_DIR}/{path.name}"

    @staticmethod
    def _guard(fn, *args) -> None:
        """Background work must never raise into nowhere: a programming error is logged with the job."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - recorded, the search goes on
            import traceback

            print(f"code agent: {type(exc).__name__}: {exc}\n{traceback.format_exc()}", flush=True)

    # -- saved state ----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        with self._lock:
            return {**super().state(), "spent": self.spent.to_dict(), "jobs": self.jobs, "failures": dict(self.failures),
                    "ready": [_proposal_dict(p) for p in [*self.handed.values(), *self.ready]
                              if p.hash not in self._known],
                    "mine": {h: asdict(m) for h, m in self.mine.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        with self._lock:
            if "spent" in state:  # a resumed run (a warm start passes only stats)
                self.spent = Usage.from_dict(state["spent"])
                self.jobs = int(state.get("jobs", 0))
                self.failures = dict(state.get("failures", {}))
                self.ready = [_proposal_from(d) for d in state.get("ready", [])]
                self.mine = {h: _Mine(**m) for h, m in state.get("mine", {}).items()}


def _proposal_dict(p: Proposal) -> dict[str, Any]:
    return {"genome": p.genome.to_json(), "parents": list(p.parents), "move": p.move, "move_kind": p.move_kind,
            "sources": [list(s) for s in p.sources], "notes": p.notes_json()}


def _proposal_from(d: dict[str, Any]) -> Proposal:
    metrics, artifacts = split_notes(d["notes"])  # the agent's state keeps them as evidence's notes JSON
    return Proposal(genome=Genome.from_json(d["genome"]), parents=tuple(d["parents"]), agent=CodeAgent.name,
                    move=d["move"], generation=0, move_kind=d["move_kind"],
                    sources=tuple(tuple(s) for s in d["sources"]), metrics=metrics, artifacts=artifacts)


def _headline(item: Evaluated, parent: Evaluated | None) -> str:
    if not item.result.ok:
        return item.result.status
    if parent is not None and parent.result.ok:
        change = item.result.latency_ms / parent.result.latency_ms - 1
        return f"ok, {abs(change) * 100:.1f}% {'faster' if change < 0 else 'slower'} than its parent"
    return "ok"


def _result(item: Evaluated, parent: Evaluated | None) -> str:
    r = item.result
    parent_ms = f" (parent {parent.result.latency_ms:.3f} ms)" if parent is not None and parent.result.ok else ""
    if r.ok:
        return f"ok, {r.latency_ms:.3f} ms{parent_ms}, max relative error {r.max_rel_error:.1e}"
    return f"{r.status}: {r.message}"


def _clip(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
