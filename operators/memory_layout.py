"""MemoryLayoutAgent: compute dtype, tensor and state layouts, stored vs recomputed intermediates."""
from __future__ import annotations

from operators.base import GeneMutationAgent


class MemoryLayoutAgent(GeneMutationAgent):
    name = "memory"
    domain = "memory"
