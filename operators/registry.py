"""The built-in agents, registered by name in the core's one registry (`evo.core.proposer`) on import.

Each agent module registers its class with `@register_proposer`; importing this module imports them
all, so `proposer_class("fusion")` (and a config's `search.agents`) resolves. An agent of your own
needs no edit here: register it the same way in your module, or name it by dotted path.
"""
from __future__ import annotations

from evo.core.proposer import proposer_class, proposer_names
from operators import code_agent, fusion, integration, levers, memory_layout, optuna_agent, scheduling  # noqa: F401

__all__ = ["proposer_class", "proposer_names"]
