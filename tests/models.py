"""Models the tests share: a Kimi Linear spec with the branches cpu_small leaves out, and models saved the way
users hand them over (a `save_pretrained` folder outside /tmp, as the strict sandbox gives engines a private
/tmp, and world-readable, as engines run as nobody and read it themselves)."""
from __future__ import annotations

import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from evo.workloads.kimi_linear.model import DENSE, KDA, MLA, SPARSE, KimiSpec
from evo.workloads.llama_serve.checkpoint import world_readable

ROOT = Path(__file__).resolve().parents[1]

# A Kimi Linear model with every branch cpu_small leaves out: q low rank, 4 expert groups of which 2 kept, no
# renormalisation, 2 shared experts, a 3-tap convolution, MLA first, a sparse first layer, another routed scale
# and epsilon (here, not in a test module: importing test_kimi_linear_reference imports transformers, ~7 s)
KIMI_VARIANT = KimiSpec(vocab=128, hidden=48, layer_types=(MLA, KDA, KDA, MLA),
                        mlp_types=(SPARSE, DENSE, SPARSE, SPARSE), intermediate=96, kda_heads=3, kda_head_dim=16,
                        conv_kernel=3, mla_heads=2, q_lora_rank=24, kv_lora_rank=12, qk_nope_dim=8, qk_rope_dim=8,
                        v_head_dim=12, experts=8, top_k=3, expert_groups=4, topk_groups=2, shared_experts=2,
                        moe_intermediate=16, routed_scaling=1.5, renormalize=False, rms_eps=1e-6, weight_seed=3)


@contextmanager
def saved_pretrained(model, name: str) -> Iterator[Path]:
    """`model.save_pretrained` into runs/.NAME-<random>, world-readable; removed afterwards."""
    folder = ROOT / "runs" / f".{name}-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    try:
        model.save_pretrained(folder)
        world_readable(folder)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
