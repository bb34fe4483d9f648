"""What a run tells its user as it goes: one line per finished candidate, progress on long phases,
and where those lines go.

Every line of a run goes through the `evo` logger: to the run's output stream (at the verbosity
asked for: `-q` only the final summary and warnings, `-v` debug too) and to `run.log` in its run
directory (everything but debug, unless `-v`). `RunLog` attaches both for one run and detaches them
when it ends; `CandidateLines` is the sink that prints a line per result as it arrives.

Long phases (start-up, baselines, the search's builds and timings, the final re-timing) show their
progress through `RunLog.phase`: on a terminal a tqdm bar kept below the run's lines (when tqdm is
importable); otherwise, as in a log file or a pipe, plain lines: a counter line whenever the output
has been silent for `heartbeat_s` seconds. `-q` shows neither.
"""
from __future__ import annotations

import importlib.util
import logging
import math
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, TextIO

from evo.core.records import Evaluated
from evo.evidence.sink import Sink

LOG_FILE = "run.log"
SUMMARY = logging.INFO + 5  # the final summary: shown even with -q
logging.addLevelName(SUMMARY, "SUMMARY")
QUIET, NORMAL, VERBOSE = -1, 0, 1
log = logging.getLogger("evo.run")


HEARTBEAT_S = 30.0  # a counter line after this long without output (when the output is not a terminal)


class RunLog:
    """The `evo` logger's handlers for one run: the output stream now, `run.log` once the directory exists;
    and the progress of its long phases on that stream (`phase`)."""

    def __init__(self, out: TextIO, verbosity: int = NORMAL, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.root = logging.getLogger("evo")
        self.saved = (self.root.level, self.root.propagate)
        self.level = {QUIET: SUMMARY, NORMAL: logging.INFO}.get(verbosity, logging.DEBUG)
        self.bars = verbosity > QUIET and _is_terminal(out) and importlib.util.find_spec("tqdm") is not None
        self.counters = verbosity > QUIET and not self.bars
        self.heartbeat_s = heartbeat_s
        self.stream = _handler(_StreamHandler(out, self.bars), self.level)
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


    @contextmanager
    def phase(self, name: str, total: int | None = None, unit: str = "", done: int = 0) -> Iterator[Phase]:
        """Progress over one long phase of `total` steps (None: unknown), `done` of them already done;
        the caller advances it. A bar on a terminal, counter lines after silences elsewhere, nothing with -q."""
        phase = Phase(name, total, unit, done)
        bar = None
        if self.bars:
            from tqdm import tqdm

            bar = tqdm(total=total, initial=done, desc=name, unit=f" {unit}" if unit else "it", file=self.stream.stream,
                       leave=False, dynamic_ncols=True, mininterval=0.5,
                       bar_format=None if total is not None else "{desc}: {elapsed}{postfix}")
        stop = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(phase, bar, stop), name=f"progress: {name}", daemon=True)
        if bar is not None or self.counters:
            watcher.start()
        try:
            phase.bar = bar
            yield phase
        finally:
            stop.set()
            if watcher.is_alive():
                watcher.join(timeout=5)
            if bar is not None:
                bar.close()

    def _watch(self, phase: Phase, bar, stop: threading.Event) -> None:
        """Keep the bar's clock moving (terminal), or write a counter line after each silence (elsewhere)."""
        while not stop.wait(1.0 if bar is not None else min(1.0, self.heartbeat_s / 4)):
            if bar is not None:
                bar.refresh()
            elif time.monotonic() - max(self.stream.last_emit, phase.last_change) >= self.heartbeat_s:
                log.info(phase.counter_line())


class Phase:
    """One long phase's count; `advance` after each step (thread-safe enough: the driver advances it)."""

    def __init__(self, name: str, total: int | None, unit: str, done: int = 0) -> None:
        self.name, self.total, self.unit, self.done = name, total, unit, done
        self.started = self.last_change = time.monotonic()
        self.note = ""
        self.bar = None

    def advance(self, steps: int = 1, note: str | None = None) -> None:
        self.done += steps
        self.last_change = time.monotonic()
        if note is not None:
            self.note = note
        if self.bar is not None:
            self.bar.update(steps)
            if note is not None:
                self.bar.set_postfix_str(note, refresh=False)

    def describe(self, note: str) -> None:
        """Change what the phase says about itself (e.g. the generation it is in) without a step."""
        self.note = note
        if self.bar is not None:
            self.bar.set_postfix_str(note)

    def counter_line(self) -> str:
        """e.g. '  ... search: 5/12 evaluations done, generation 1; 41 s in this phase'."""
        parts = [] if self.total is None else [f"{self.done}/{self.total}{' ' + self.unit if self.unit else ''} done"]
        text = ", ".join(parts + ([self.note] if self.note else []))
        return f"  ... {self.name}: {text + '; ' if text else ''}{time.monotonic() - self.started:.0f} s in this phase"


class _StreamHandler(logging.StreamHandler):
    """The run's output stream; with a bar on it, each line is written above the bar (tqdm.write)."""

    def __init__(self, stream: TextIO, bars: bool) -> None:
        super().__init__(stream)
        self.bars = bars
        self.last_emit = time.monotonic()

    def emit(self, record: logging.LogRecord) -> None:
        self.last_emit = time.monotonic()
        if not self.bars:
            return super().emit(record)
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - as logging does: a broken stream must not stop the run
            self.handleError(record)


def _is_terminal(out: TextIO) -> bool:
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


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


class SearchProgress(Sink):
    """Advances the search's progress phase by one per result; says which generation it is in."""

    def __init__(self) -> None:
        self.phase: Phase | None = None  # set by the driver while the search runs

    def on_result(self, evaluated: Evaluated) -> None:
        if self.phase is not None:
            self.phase.advance(note=f"generation {evaluated.proposal.generation}")

    def on_generation(self, report, search) -> None:
        if self.phase is not None:
            self.phase.describe(f"generation {report.generation} done, best {report.best_latency_ms:.3f} ms")
