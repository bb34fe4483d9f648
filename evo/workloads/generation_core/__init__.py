"""One generation core for every generation engine here (the generation contract, `evo.workloads.generation`),
in vLLM's shape: a scheduler that never sees a model, over two parts an engine brings.

- `Scheduler` (`scheduler.py`): admission, prefill (whole or chunked), one batched decode a step, stops and
  aborts, the decoding requests kept in the pool's first rows; what it reads of the genes is a
  `SchedulerPolicy`;
- `Pool` (`pool.py`): rows of per-request memory, reserved, released, moved and swapped: llama_serve's KV
  slots or blocks, or Kimi Linear's recurrent state and caches (SGLang's `MambaPool` beside its
  `ReqToTokenPool`);
- `ModelRunner` (`runner.py`): a prompt chunk of one row, one decode step of the first rows together (and,
  to speculate, a verify forward of several tokens a row); each token chosen by `pick_tokens` (`picking.py`),
  greedy or the request's seeded draw.
A lever written here serves every model whose runner offers it: speculation by prompt lookup (`drafting.py`)
is the first; multi-step decoding would be next.
"""
from __future__ import annotations

from evo.workloads.generation_core.drafting import prompt_lookup
from evo.workloads.generation_core.picking import pick_tokens
from evo.workloads.generation_core.pool import Pool
from evo.workloads.generation_core.ragged import Ragged
from evo.workloads.generation_core.runner import ModelRunner, Pick
from evo.workloads.generation_core.scheduler import Scheduler, SchedulerPolicy

__all__ = ["ModelRunner", "Pick", "Pool", "Ragged", "Scheduler", "SchedulerPolicy", "pick_tokens", "prompt_lookup"]
