"""The code agent's prompts: what the model is told about a parent, and how it must answer.

Plain functions from records to chat messages (lists of {"role", "content"}); nothing here calls a
model. The reply format is the one `operators.llm.edits.parse_reply` reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from evo.core.code import END_MARK, START_MARK, OpenStage
from evo.core.records import Evaluated

REPLY_FORMAT = (
    'Reply with exactly one JSON object and nothing else:\n'
    '{"rationale": "<one or two sentences: what you change and why it is faster>", '
    '"edits": [{"search": "<text copied exactly from inside a marked block>", "replace": "<new text>"}]}\n'
    f"Each search text must occur exactly once between a `{START_MARK}` line and its `{END_MARK}` line; "
    "edits apply in order. Only if edits cannot express the change, reply instead with "
    '{"rationale": "...", "rewrite": "<the whole new file>"}.'
)


@dataclass(frozen=True)
class Relative:
    """A result the model should learn from: the parent itself, its other children, earlier tries."""

    role: str  # "parent", "sibling", "earlier try"
    item: Evaluated


def system_prompt(workload: str, device: str, stage: OpenStage) -> str:
    return (
        f"You are an expert performance engineer. You improve one stage of an inference engine for the {workload} "
        f"operator on {device}, written against {stage.language}. The whole engine is built from the file you edit "
        f"and judged by an evaluator that compares every call with a float64 reference on freshly drawn inputs of "
        f"several shapes and distributions, and times the engine; a faster engine that stays correct wins. Results "
        f"that cache answers across calls, skip work for some shapes, or reach for the reference are rejected.\n"
        f"Rules: keep the entry point `{stage.signature()}` and what it returns"
        f"{_also(stage)}; import only "
        f"{', '.join(stage.allowed_imports)}; change only what lies in the marked blocks.\n{REPLY_FORMAT}")


def _also(stage: OpenStage) -> str:
    if not stage.also_defines:
        return ""
    return f", and keep {', '.join(f'`{n}`' for n in stage.also_defines)} with their names and parameters"


def proposal_messages(workload: str, device: str, stage: OpenStage, source: str, parent: Evaluated | None,
                      best_ms: float, relatives: list[Relative], lessons: list[str]) -> list[dict]:
    parts = [f"## Stage `{stage.stage}` (gene `{stage.gene}`)\n{stage.doc}"]
    if parent is not None:
        parts.append(f"## The parent engine {parent.proposal.hash}\n{_result_line(parent)}; the best engine so far "
                     f"runs in {_ms(best_ms)}.\nGenome: {parent.proposal.genome.describe()}")
    if relatives:
        parts.append("## What the evaluator said about the parent and its relatives\n"
                     + "\n".join(f"- {r.role} {r.item.proposal.hash} ({r.item.proposal.agent}: "
                                 f"{_clip(r.item.proposal.move, 160)}): {_result_line(r.item)}" for r in relatives))
    if lessons:
        parts.append("## Lessons from earlier attempts (newest last)\n" + "\n\n".join(lessons))
    parts.append(f"## The current source of this stage\n```python\n{source}\n```")
    parts.append("Propose one change that makes this stage faster while keeping it correct.")
    return [{"role": "system", "content": system_prompt(workload, device, stage)},
            {"role": "user", "content": "\n\n".join(parts)}]


def repair_message(error: str) -> dict:
    return {"role": "user", "content": f"Your reply could not be used: {error}\n\nFix it. {REPLY_FORMAT}"}


def critique_messages(stage: OpenStage, rationale: str, diff: str, child: Evaluated, parent: Evaluated | None) -> list[dict]:
    parent_line = _result_line(parent) if parent is not None else "the hand-written engine (not timed in this run)"
    return [
        {"role": "system", "content": "You review one experiment of an automated performance-engineering search and "
                                      "write the lesson it teaches, for whoever edits this code next."},
        {"role": "user", "content": (
            f"Stage `{stage.stage}`. The change: {rationale}\n\n```diff\n{_clip(diff, 6000)}\n```\n\n"
            f"Parent: {parent_line}.\nChild: {_result_line(child)}.\n\n"
            "In at most three sentences of plain text, say what this result teaches about changing this stage: "
            "what to repeat or avoid, and why.")},
    ]


def _result_line(item: Evaluated) -> str:
    r = item.result
    if r.ok:
        return f"ok, {_ms(r.latency_ms)} (max relative error {r.max_rel_error:.1e})"
    error = f"; error: {_clip(r.error.strip().splitlines()[-1], 300)}" if r.error.strip() else ""
    return f"{r.status}: {_clip(r.message, 400)}{error}"


def _ms(value: float) -> str:
    return f"{value:.3f} ms" if math.isfinite(value) else "no latency"


def _clip(text: str, limit: int) -> str:
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."
