"""SchedulingAgent: chunk and sub-chunk sizes, intra-chunk algorithm, exponent form, threads."""
from __future__ import annotations

from evo.core.proposer import register_proposer
from operators.base import GeneMutationAgent


@register_proposer
class SchedulingAgent(GeneMutationAgent):
    name = "scheduling"
    domain = "scheduling"
