"""Tripwires on the functions an engine must not call (the workload's reference, its baselines).

Installed once, in the engine's own process, before the engine is built, and never taken down: that
process exists only to run one engine, so nothing legitimate there calls the reference.

A guard replaces the *code object* of each forbidden function (`func.__code__`), so every name the
function is reachable by — an alias imported before the guard went up, a bound method, a reference
kept in a closure or a dict — runs the guard instead of the function. Callables without Python code
(builtins) are replaced on their owner by name. A guard reports the call to the judge first (so an
engine that swallows the error is still caught) and then raises `ForbiddenCall`; it never computes
the answer, so catching the error gains nothing.
"""
from __future__ import annotations

import functools
import types
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:  # the guards are installed before any workload code is imported
    from evo.workloads.base import Workload

REPORT_NAME = "__evo_report_forbidden_call__"  # injected into each guarded function's globals


class ForbiddenCall(RuntimeError):
    """The engine called the workload's reference or a baseline instead of computing its answer."""


def install_guards(targets: Iterable[tuple[object, str]], report: Callable[[str], None]) -> list[str]:
    """Guard every `owner.attr`; `report(label)` runs on each forbidden call. Returns the labels guarded."""
    labels = []
    for owner, attr in targets:
        label = f"{getattr(owner, '__name__', type(owner).__name__)}.{attr}"
        value = _raw_attribute(owner, attr)
        function = _python_function(value)
        code = _guard_code(label, function) if function is not None else None
        if code is not None:
            function.__globals__[REPORT_NAME] = _reporter(report)
            function.__code__ = code
        else:
            setattr(owner, attr, _guard_callable(label, report))
        labels.append(label)
    return labels


def _raw_attribute(owner: object, attr: str) -> object:
    """owner.attr as stored (a class's staticmethod/classmethod object, not the bound result)."""
    for holder in (owner, *getattr(type(owner), "__mro__", ())):
        if attr in getattr(holder, "__dict__", {}):
            return holder.__dict__[attr]
    return getattr(owner, attr)


def _python_function(value: object) -> types.FunctionType | None:
    """The plain Python function behind a function, method, static/class method, partial or wrapper."""
    seen = 0
    while seen < 16:
        seen += 1
        if isinstance(value, types.FunctionType):
            return value
        if isinstance(value, (types.MethodType, staticmethod, classmethod)):
            value = value.__func__
        elif isinstance(value, functools.partial):
            value = value.func
        elif hasattr(value, "__wrapped__"):
            value = value.__wrapped__
        else:
            return None
    return None


def _reporter(report: Callable[[str], None]) -> Callable[[str], None]:
    def forbidden(label: str) -> None:
        try:
            report(label)
        finally:
            raise ForbiddenCall(f"engine called {label}")
    return forbidden


def _guard_code(label: str, function: types.FunctionType) -> types.CodeType | None:
    """A code object with the function's free variables (a code swap must keep them) whose body only
    reports `label`; None if they cannot be matched."""
    freevars = function.__code__.co_freevars
    touch = f"    ({', '.join(freevars)},)\n" if freevars else ""
    source = (
        f"def _outer():\n"
        + "".join(f"    {name} = None\n" for name in freevars)
        + "    def guard(*args, **kwargs):\n"
        + f"        {REPORT_NAME}({label!r})\n"
        + touch.replace("    (", "        (")
        + "    return guard\n"
    )
    namespace: dict = {}
    exec(compile(source, f"<guard {label}>", "exec"), namespace)
    code = namespace["_outer"]().__code__
    return code if code.co_freevars == freevars else None


def _guard_callable(label: str, report: Callable[[str], None]) -> Callable:
    forbidden = _reporter(report)

    def guard(*args: object, **kwargs: object) -> None:
        forbidden(label)
    return guard


def forbidden_targets(workload: Workload, load: bool = True) -> list[tuple[object, str]]:
    """(owner, attribute) pairs an engine must not call: the workload's `reference`, `reference_for` and
    `reference_and_scales` methods, plus whatever the workload declares through `forbidden_callables()` (by
    default nothing more), with `lazy` owners resolved and dotted attributes walked down to their last owner. With `load` False
    (in an engine's process) a lazy module that is not loaded is left out: nothing there can reach it."""
    from evo.workloads.lazy import lazy

    targets: list[tuple[object, str]] = [(workload, name) for name in
                                         ("reference", "reference_for", "reference_and_scales")]
    for owner, attr in workload.forbidden_callables():
        if isinstance(owner, lazy):
            owner = owner.load() if load else owner.loaded()
            if owner is None:
                continue
        *path, name = attr.split(".")
        for step in path:
            owner = getattr(owner, step)
        targets.append((owner, name))
    return targets


def hidden_paths(workload: Workload) -> tuple[str, ...]:
    """What an untrusted engine's view of the files leaves out (`evaluators.sandbox.jail`), so it cannot load a
    fresh, unguarded copy of what it may not call: the source and compiled files of every module that
    owns a forbidden callable (the reference's and the baselines' modules) and of every workload's
    judge-only modules (`evo.workloads.lazy`) declared in this process, the judge's own package, and
    the project's git objects (they hold every version of those files)."""
    from evo.workloads.lazy import judge_only_files

    owners = [owner for owner, _ in forbidden_targets(workload)]
    sources = [Path(o.__file__) for o in owners if isinstance(o, types.ModuleType) and getattr(o, "__file__", None)]
    paths: list[Path] = []
    for source in [*sources, *map(Path, judge_only_files())]:  # every workload's oracles, not only this one's
        paths.append(source)
        paths.extend(sorted(source.parent.glob(f"__pycache__/{source.stem}.*.pyc")))
    judge = Path(__file__).resolve().parents[1]  # evaluators/: every room of the judge
    paths.append(judge)
    if (judge.parent / ".git").exists():
        paths.append(judge.parent / ".git")
    return tuple(dict.fromkeys(str(p.resolve()) for p in paths))
