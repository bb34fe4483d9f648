"""What a run tells its user as it goes: one line per finished candidate, and where those lines go.

Every line of a run goes through the `evo` logger: to the run's output stream (at the verbosity
asked for: `-q` only the final summary and warnings, `-v` debug too) and to `run.log` in its run
directory (everything but debug, unless `-v`). `RunLog` attaches both for one run and detaches them
when it ends; `CandidateLines` is the sink that prints a line per result as it arrives.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TextIO

from evo.core.records import Evaluated
from evo.evidence.sink import Sink

LOG_FILE = "run.log"
SUMMARY = logging.INFO + 5  # the final summary: shown even with -q
logging.addLevelName(SUMMARY, "SUMMARY")
QUIET, NORMAL, VERBOSE = -1, 0, 1
log = logging.getLogger("evo.run")


class RunLog:
    """The `evo` logger's handlers for one run: the output stream now, `run.log` once the directory exists."""

    def __init__(self, out: TextIO, verbosity: int = NORMAL) -> None:
        self.root = logging.getLogger("evo")
        self.saved = (self.root.level, self.root.propagate)
        self.level = {QUIET: SUMMARY, NORMAL: logging.INFO}.get(verbosity, logging.DEBUG)
        self.stream = _handler(logging.StreamHandler(out), self.level)
        self.file: logging.FileHandler | None = None
        self.root.addHandler(self.stream)
        self.root.setLevel(min(self.level, logging.INFO))
        self.root.propagate = False  # the run's lines are shown once, here, not again by the root logger

    def attach_file(self, run_dir: Path) -> Path:
        """Also write every line (debug only with -v) to `run_dir/run.log`, appending (a resumed run adds to it)."""
        path = Path(run_dir) / LOG_FILE
        self.file = _handler(logging.FileHandler(path, encoding="utf-8"), min(self.level, logging.INFO))
        self.file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.root.addHandler(self.file)
        return path

    def close(self) -> None:
        for handler in (self.stream, self.file):
            if handler is not None:
                self.root.removeHandler(handler)
                handler.flush()
                if handler is self.file:
                    handler.close()
        self.root.setLevel(self.saved[0])
        self.root.propagate = self.saved[1]


def _handler(handler: logging.Handler, level: int) -> logging.Handler:
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter("%(message)s"))
    return handler


class CandidateLines(Sink):
    """One line per finished candidate, as results arrive: generation, agent and move, hash, status,
    latency, and the ratio of its parent's latency to its own (>1: faster than its parent)."""

    PREFIX = "cand "

    def __init__(self, known: dict[str, float] | None = None) -> None:
        self.latency: dict[str, float] = dict(known or {})  # genome hash -> latency in ms (inf: failed)

    def on_result(self, evaluated: Evaluated) -> None:
        log.info(self.line(evaluated))

    def line(self, evaluated: Evaluated) -> str:
        proposal, result = evaluated.proposal, evaluated.result
        self.latency[proposal.hash] = evaluated.fitness
        parents = [self.latency[p] for p in proposal.parents if p in self.latency]
        best_parent = min(parents, default=math.nan)
        if result.ok and math.isfinite(best_parent):
            versus = f"{best_parent / result.latency_ms:5.2f}x vs parent"
        else:
            versus = "seed" if not proposal.parents else "-"
        latency = f"{result.latency_ms:8.3f} ms" if result.ok else f"{'-':>8s}   "
        move = " ".join(proposal.move.split())
        why = "" if result.ok else f" ({' '.join(result.message.split())[:60]})"
        return (f"{self.PREFIX}gen {proposal.generation:3d} | {proposal.hash[:12]} | {result.status:13s} | "
                f"{latency} | {versus:16s} | {proposal.agent}: {move[:70]}{why}")
