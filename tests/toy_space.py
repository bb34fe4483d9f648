"""A small gene space with the same conventions as a real workload, for testing the search core."""
from __future__ import annotations

from evo.core.genome import Constraint, Gene, GeneSpace, StagePipeline

STAGES = ("prep", "solve", "out")
PIPELINE = StagePipeline(STAGES, ("eager", "compile"), fuse_docs=("fused", "fused"), backend_doc="backend")


def toy_space() -> GeneSpace:
    genes = [*PIPELINE.backend_genes(), *PIPELINE.fuse_genes()]
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

    return GeneSpace("toy", tuple(genes), (Constraint("sub_chunk", sub_divides), PIPELINE.constraint()),
                     pipeline=PIPELINE)
