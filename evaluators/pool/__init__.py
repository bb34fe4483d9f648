"""The Ray pool: evaluator actors (`actors`: `EvaluatorPool`, one `Evaluator` per actor, replaced when it
dies or hangs) and where they go (`placement`: one per GPU or CPU evaluators on disjoint cores). The only
room of the judge that imports Ray.
"""
from __future__ import annotations

OFFERS = {"EvaluatorPool": "actors", "PlacementError": "placement", "plan_slots": "placement"}


def __getattr__(name: str):
    """The names above, imported from their module on first use (a face imports nothing by itself)."""
    import importlib

    if name not in OFFERS:
        raise AttributeError(f"module {__name__!r} offers {sorted(OFFERS)}, not {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{OFFERS[name]}"), name)
