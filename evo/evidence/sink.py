"""The evidence sink: what subscribes to a search, with every hook declared once and empty by default.

The driver passes its sinks to `evo.core.loop.run_search` as one ordered list: each hook is called
in list order (the journal and Parquet file are on disk before anything reports them), and `close`
is called in reverse order when the run ends, however it ends (a sink may use what the ones before
it wrote, so it closes before them). A sink overrides only the hooks it needs.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from evo.core.records import Evaluated
    from evo.core.search import GenerationReport, Search
    from evo.evidence.summary import Summary

log = logging.getLogger("evo.evidence")

FINISHED, KILLED, FAILED = "FINISHED", "KILLED", "FAILED"  # how a run ended (MLflow's run statuses)


class Sink:
    """Base class of the search's subscribers (satisfies `evo.core.loop.Sink`)."""

    def on_result(self, evaluated: Evaluated) -> None:
        """One result, as it arrives (in any order within a generation)."""

    def on_generation(self, report: GenerationReport, search: Search) -> None:
        """A generation is complete: every proposal of it has its one result."""

    def close(self, summary: Summary | None = None, status: str = FINISHED) -> None:
        """The run ended with `status` (FINISHED, KILLED or FAILED); `summary` is None when it failed
        before one was made."""


def close_all(sinks: Iterable[Sink], summary: Summary | None, status: str) -> None:
    """Close `sinks` in reverse order; one that raises is logged and the others are still closed."""
    for sink in reversed(list(sinks)):
        try:
            sink.close(summary, status)
        except Exception:  # noqa: BLE001 - teardown must reach every sink; the error is logged
            log.exception("closing %s failed", type(sink).__name__)


class SinkList:
    """A run's sinks in their order. Iterating gives them in order (pass it to `run_search`); as a context
    manager it closes them in reverse when the run ends, with what `end` recorded (else FAILED, no summary)."""

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks: tuple[Sink, ...] = tuple(sinks)
        self.summary: Summary | None = None
        self.status = FAILED

    def __iter__(self):
        return iter(self.sinks)

    def end(self, summary: Summary, status: str) -> None:
        """The run ended with `status` and `summary` (closing happens on leaving the `with` block)."""
        self.summary, self.status = summary, status

    def __enter__(self) -> SinkList:
        return self

    def __exit__(self, *exc_info) -> None:
        close_all(self.sinks, self.summary, self.status)
