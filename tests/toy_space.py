"""A small gene space with the same conventions as a real workload, for testing the search core."""
from __future__ import annotations

from evo.core.genome import Constraint, Gene, GeneSpace

STAGES = ("prep", "solve", "out")


def toy_space() -> GeneSpace:
    genes = [Gene(f"backend_{s}", "fusion", ("eager", "compile"), "eager", "backend") for s in STAGES]
    genes += [Gene(f"fuse_{a}_{b}", "fusion", (False, True), False, "fused") for a, b in zip(STAGES, STAGES[1:])]
    genes += [
        Gene("chunk_size", "scheduling", (16, 32, 64, 128), 64, "chunk"),
        Gene("sub_chunk_size", "scheduling", (8, 16, 32, 64), 16, "sub chunk"),
        Gene("algorithm", "scheduling", ("a", "b", "c"), "a", "algorithm"),
        Gene("layout", "memory", ("head_major", "time_major"), "head_major", "layout"),
        Gene("store", "memory", (True, False), True, "store"),
    ]

    def sub_divides(v):
        if v["sub_chunk_size"] > v["chunk_size"]:
            return f"sub_chunk_size={v['sub_chunk_size']} must be <= chunk_size={v['chunk_size']}"
        return None

    def fused_share_backend(v):
        for a, b in zip(STAGES, STAGES[1:]):
            if v[f"fuse_{a}_{b}"] and v[f"backend_{a}"] != v[f"backend_{b}"]:
                return f"fused stages {a} and {b} must share a backend"
        return None

    return GeneSpace("toy", tuple(genes), (Constraint("sub_chunk", sub_divides),
                                           Constraint("fused_backend", fused_share_backend)))
