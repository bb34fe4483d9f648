"""MemoryLayoutAgent: compute dtype, tensor and state layouts, stored vs recomputed intermediates."""
from __future__ import annotations

from evo.core.proposer import register_proposer
from operators.base import GeneMutationAgent


@register_proposer
class MemoryLayoutAgent(GeneMutationAgent):
    name = "memory"
    domain = "memory"
