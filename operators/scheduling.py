"""SchedulingAgent: chunk and sub-chunk sizes, intra-chunk algorithm, exponent form, threads."""
from __future__ import annotations

from operators.base import GeneMutationAgent


class SchedulingAgent(GeneMutationAgent):
    name = "scheduling"
    domain = "scheduling"
