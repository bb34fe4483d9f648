"""An engine kept open for a Serve replica, in the same sandbox and checked by the same judge as in the
search: `ServedEngine` (`engine`: call engines, one call per request, a sample re-scored) and
`ServedGenerator` (`generator`: generation engines, one engine loop serving every caller, every token
accounted for). The replica is the engine's client; it never runs engine code itself.
"""
from __future__ import annotations

OFFERS = {"ServedEngine": "engine", "ServedEngineError": "engine", "ServedGenerator": "generator",
          "ServedGeneratorError": "generator", "Overloaded": "generator", "RequestError": "generator"}


def __getattr__(name: str):
    """The names above, imported from their module on first use (a face imports nothing by itself)."""
    import importlib

    if name not in OFFERS:
        raise AttributeError(f"module {__name__!r} offers {sorted(OFFERS)}, not {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{OFFERS[name]}"), name)
