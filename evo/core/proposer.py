"""What an agent is to the search: the `Proposer` protocol, what it is asked and told, and the one
registry of agents by name that configs resolve against.

A proposer is asked once per generation (`ask`) with a `ProposalRequest`: its parents, how many
children are wanted, the archive of every evaluated genome (read-only) and the search's gene effects.
When the generation closes it is told (`tell`) the `Feedback`: every result of the generation, whoever
proposed it, with the full `EvalResult`, and which of them improve on their parent by the one rule
`improves_on_parent`. It declares how many parents it takes (`parents_needed`); the search leaves it
out of a generation whose population holds fewer.

Agents register by name with `@register_proposer` (the built-ins in `operators/` do when
`operators.registry` is imported); `proposer_class` resolves a registered name, or a dotted path
("package.module:Class" or "package.module.Class") so an agent kept outside this project needs no
edit here. No Ray, no operators here: the core only knows the protocol.
"""
from __future__ import annotations

import importlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from evo.core.effects import GeneEffects
from evo.core.records import Evaluated, Outcome, Parent, Proposal


class Archive(Mapping[str, Evaluated]):
    """Every evaluated genome so far by hash, as a proposer sees it: a read-only snapshot (picklable,
    so it travels to agents on Ray actors)."""

    def __init__(self, items: Mapping[str, Evaluated] | None = None) -> None:
        self._items: dict[str, Evaluated] = dict(items or {})

    def __getitem__(self, genome_hash: str) -> Evaluated:
        return self._items[genome_hash]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Archive({len(self._items)} evaluated)"


@dataclass(frozen=True, eq=False)
class ProposalRequest:
    """What a proposer is asked for in one generation."""

    agent: str  # the proposer's name, as in search.agents
    generation: int
    parents: tuple[Parent, ...]  # distinct parents selected from the population, best first
    count: int  # proposals wanted: the agent's share plus a few spares (some children may already be known)
    archive: Archive  # every genome evaluated so far, read-only
    effects: GeneEffects | None = None  # the per-gene effects of every result (search.learning), else None

    @property
    def known(self) -> frozenset[str]:
        """Hashes of the genomes already evaluated: a proposal of one of them is dropped."""
        return frozenset(self.archive)


@dataclass(frozen=True, eq=False)
class Feedback:
    """What every proposer is told when a generation closes."""

    generation: int
    results: tuple[Evaluated, ...]  # every result of the generation, whoever proposed it, failures included
    improved: frozenset[str]  # hashes of the results that improve on their parent (`improves_on_parent`)

    def own(self, agent: str) -> tuple[Evaluated, ...]:
        """The results of `agent`'s proposals, in proposal order."""
        return tuple(e for e in self.results if e.proposal.agent == agent)

    def outcomes(self, agent: str) -> list[Outcome]:
        """Per own result: the move kind it used and whether it improved on its parent."""
        return [Outcome(e.proposal.move_kind, e.proposal.hash in self.improved) for e in self.own(agent)]


def improves_on_parent(item: Evaluated, known: Mapping[str, Evaluated]) -> bool:
    """The one rule for "a child that paid", used for the agents' move statistics and their yields alike.

    A child improves on its parent when it is ok and faster than the fastest of its parents that were
    evaluated (`known`). A parentless proposal (a whole-genome proposer such as the Optuna agent, or a
    seed) has no parent to beat, so it is compared with the best of the generations before its own:
    it pays when it beats the best the search had when it was proposed. (Comparing it with infinity
    instead would count every ok result as a win.)"""
    if item.proposal.parents:
        parent = min((known[h].fitness for h in item.proposal.parents if h in known), default=math.inf)
    else:
        parent = min((e.fitness for e in known.values() if e.proposal.generation < item.proposal.generation),
                     default=math.inf)
    return item.fitness < parent


@runtime_checkable
class Proposer(Protocol):
    """An agent of the search. Constructed as `cls(gene_space, seed, **options)` (options: the agent's
    own settings, e.g. the code agent's); `operators.base.Agent` is a base class that provides all of it."""

    name: str  # the name its proposals carry (the team sets it to the name the config used)
    parents_needed: int  # parents it needs to propose anything (recombination: 2; a whole-genome sampler: 0)

    def ask(self, request: ProposalRequest) -> list[Proposal]:
        """Up to `request.count` new proposals, none of them in `request.known`."""
        ...

    def tell(self, feedback: Feedback) -> None:
        """A generation's results (its own and everyone else's), once the generation closes."""
        ...

    def state(self) -> dict[str, Any]:
        """JSON-safe state that `load_state` restores (a resumed run proposes what the original would have)."""
        ...

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore `state`; a warm start passes only {"stats": ...}, earlier runs' move statistics."""
        ...

    def close(self) -> None:
        """Stop background work, if any."""
        ...

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for background work to finish; whether it did."""
        ...


_REGISTRY: dict[str, type] = {}
_METHODS = ("ask", "tell", "state", "load_state", "close", "wait_idle")


def _lacks(cls: type) -> list[str]:
    """What `cls` lacks of the Proposer protocol (class attributes: a team reads `parents_needed` from the class)."""
    missing = [m for m in _METHODS if not callable(getattr(cls, m, None))]
    needed = getattr(cls, "parents_needed", None)
    if not isinstance(needed, int) or isinstance(needed, bool) or needed < 0:
        missing.append("parents_needed (an int >= 0)")
    return missing


def register_proposer(cls: type) -> type:
    """Class decorator: make `cls` an agent that configs name as `cls.name` in search.agents."""
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name or "." in name or ":" in name:
        raise ValueError(f"{cls.__qualname__}.name is {name!r}; a proposer needs a name without '.' or ':' "
                         f"(those mark a dotted path)")
    missing = _lacks(cls)
    if missing:
        raise TypeError(f"{cls.__qualname__} lacks {missing} of the Proposer protocol (evo.core.proposer)")
    taken = _REGISTRY.get(name)
    if taken is not None and (taken.__module__, taken.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"agent name {name!r} is taken by {taken.__module__}.{taken.__qualname__}; "
                         f"choose another name for {cls.__module__}.{cls.__qualname__}")
    _REGISTRY[name] = cls  # the same class again (a module imported twice) replaces itself
    return cls


def proposer_names() -> tuple[str, ...]:
    """The registered agent names, sorted."""
    return tuple(sorted(_REGISTRY))


def proposer_class(name: str) -> type:
    """The agent class configs call `name`: a registered name, or a dotted path to a class
    ("package.module:Class" or "package.module.Class"). Unknown: ValueError listing the names."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if not isinstance(name, str) or not ("." in name or ":" in name):
        hint = "" if _REGISTRY else " (none registered: the built-in agents register when operators.registry is imported)"
        raise ValueError(f"unknown agent {name!r}; available: {list(proposer_names())}{hint}, or a dotted path "
                         f"to a Proposer class, e.g. mypackage.agents:MyAgent")
    module_name, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"agent {name!r}: could not load class {attr!r} from module {module_name!r} ({exc}); "
                         f"available names: {list(proposer_names())}") from None
    missing = _lacks(cls) if isinstance(cls, type) else []
    if not isinstance(cls, type) or missing:
        raise ValueError(f"agent {name!r} is not a Proposer class (evo.core.proposer)"
                         + (f": it lacks {missing}" if isinstance(cls, type) else f": got {type(cls).__name__}"))
    return cls


__all__ = ["Archive", "Feedback", "ProposalRequest", "Proposer", "improves_on_parent",
           "proposer_class", "proposer_names", "register_proposer"]
