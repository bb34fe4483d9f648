"""The search loop: ask, evaluate, tell, report. Executors and sinks are passed in.

An executor turns proposals into (proposal, result) pairs in any order (`LocalExecutor` in-process,
`evaluators.pool.actors.EvaluatorPool` on Ray). Sinks subscribe to results and generations, called in list
order; disk sinks come first so evidence is on disk before anything is reported. `Sink` below is all
the loop needs; `evo.evidence.sink.Sink` is the base class with every hook, empty by default.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Protocol

from evo.core.faults import crash_point
from evo.core.records import EvalResult, Evaluated, Proposal
from evo.core.search import GenerationReport, Search


class Executor(Protocol):
    def run(self, proposals: list[Proposal]) -> Iterator[tuple[Proposal, EvalResult]]: ...


class Sink(Protocol):
    def on_result(self, evaluated: Evaluated) -> None: ...
    def on_generation(self, report: GenerationReport, search: Search) -> None: ...


class LocalExecutor:
    """Evaluates proposals one after another with a plain evaluator object in this process."""

    def __init__(self, evaluator) -> None:
        self.evaluator = evaluator
        self.sources_of = lambda proposal: dict(proposal.sources)  # code hash -> source (evo.core.code)

    def run(self, proposals: list[Proposal]) -> Iterator[tuple[Proposal, EvalResult]]:
        for proposal in proposals:
            sources = self.sources_of(proposal)  # only genomes with code genes need sources
            genome = proposal.genome.to_json()
            yield proposal, self.evaluator.evaluate(genome, sources) if sources else self.evaluator.evaluate(genome)


def run_search(search: Search, executor: Executor, sinks: Iterable[Sink] = (),
               should_stop=lambda: False) -> list[GenerationReport]:
    """Run generations until the budget is spent or `should_stop()`; return their reports."""
    sinks = list(sinks)
    reports = []
    while not search.done() and not should_stop():
        proposals = search.ask()
        if not proposals:
            break
        crash_point("propose")
        for proposal, result in executor.run(proposals):
            evaluated = search.tell(proposal, result)
            for sink in sinks:
                sink.on_result(evaluated)
            crash_point("evaluate")
        if search.pending:  # the executor stopped early: the generation stays open, resumable
            break
        report = search.end_generation()
        for sink in sinks:
            sink.on_generation(report, search)
        reports.append(report)
    return reports
