"""The llama workload with the `cheat` gene of tests/cheats.py (`CheatWorkload`), for the evaluator's full
path: `Evaluator("tests.llama_cheats", "cpu_small", ...)`. Its cheats: `cheats.LLAMA_DOMAIN_CHEATS`."""
from __future__ import annotations

from evo.workloads.llama import WORKLOAD as _llama
from tests.cheats import CheatWorkload

WORKLOAD = CheatWorkload(_llama, "llama_cheats")
