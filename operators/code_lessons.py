"""The code agent's lessons: one human-readable Markdown file per (workload, device kind), kept across runs.

Each entry says what was tried on which open stage, what it did to latency and correctness, the
critique's lesson, and where the evidence is (run, generation, genome, code hash, prompt artifact).
The agent reads the newest entries into its prompts and appends one per result of its own; people
may read, edit or prune the file (entries are the sections that start with "## ").
"""
from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

_HEADER = ("# Lessons of the code agent: {workload} on {device}\n\n"
           "Written by engine-factory's code agent (operators/code_agent.py) and read by it at every run on this\n"
           "workload and device kind. Each entry is one change it tried and what the evaluator found. Edit or prune\n"
           "freely; entries are the sections that start with \"## \".\n")
_GENOME = re.compile(r"genome ([0-9a-f]{16})")


def lessons_path(lessons_dir: Path, workload: str, device_kind: str) -> Path:
    """`<lessons_dir>/<workload>-<device kind>.md`, the kind made safe for a file name."""
    slug = re.sub(r"[^a-z0-9]+", "-", f"{workload}-{device_kind}".lower()).strip("-")
    return Path(lessons_dir) / f"{slug}.md"


@dataclass(frozen=True)
class Lesson:
    stage: str
    headline: str  # e.g. "ok, 7.9% faster than its parent"
    change: str  # what was tried (the model's rationale)
    result: str  # status, latency and the parent's, or the evaluator's message
    lesson: str  # the critique
    evidence: str  # run, generation, genome hash, code hash, prompt artifact

    def markdown(self, when: datetime | None = None) -> str:
        stamp = (when or datetime.now(timezone.utc)).strftime("%Y-%m-%d %H:%M UTC")
        return (f"\n## {stamp} · {self.stage} · {self.headline}\n"
                f"- tried: {_one_line(self.change)}\n- result: {_one_line(self.result)}\n"
                f"- lesson: {_one_line(self.lesson)}\n- evidence: {_one_line(self.evidence)}\n")


class LessonBook:
    """The lessons file: appended entry by entry (flushed and fsynced), read back as text."""

    def __init__(self, path: Path, workload: str, device: str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(_HEADER.format(workload=workload, device=device))
            os.replace(tmp, self.path)

    def entries(self) -> list[str]:
        text = self.path.read_text()
        return ["## " + part.strip() for part in re.split(r"^## ", text, flags=re.M)[1:]]

    def recent(self, count: int, stage: str | None = None) -> list[str]:
        """The newest `count` entries, those of `stage` first."""
        entries = self.entries()
        same = [e for e in entries if stage and f" · {stage} · " in e.splitlines()[0]]
        other = [e for e in entries if e not in same]
        return (same[-count:] + other[-count:])[-count:] if count > 0 else []

    def has(self, genome_hash: str) -> bool:
        """Whether an entry already cites this genome (a resumed run does not write it twice)."""
        return genome_hash in {m.group(1) for m in _GENOME.finditer(self.path.read_text())}

    def add(self, lesson: Lesson, genome_hash: str) -> bool:
        with self._lock:
            if self.has(genome_hash):
                return False
            with open(self.path, "a") as f:
                f.write(lesson.markdown())
                f.flush()
                os.fsync(f.fileno())
            return True


def _one_line(text: str, limit: int = 600) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
