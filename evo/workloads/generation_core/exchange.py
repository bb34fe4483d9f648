"""The gene `steps_per_exchange`: how many scheduling steps an engine runs each time the judge or Serve asks it
for tokens (vLLM's multi-step scheduling, SGLang's overlap of scheduling with the step).

Each exchange with a sandboxed engine costs a round trip over its channel and a freeze and thaw of its process
(~0.1-1 ms, `evaluators.sandbox.process`); at a few milliseconds a step that is a large share. With k steps per
exchange the engine runs up to k steps back to back (fewer when a step makes no token) and hands back every
token they made, in order; the judge stamps them all when the exchange ends, as a client receiving them would. What it
costs: a request sent meanwhile waits for the exchange to end (TTFT), a client's tokens arrive in bursts of up
to k (ITL), and the engine may compute tokens past the one after which a client went away (the judge drops them
and aborts the request). The judge takes k from the genome it verified, never from the engine.
"""
from __future__ import annotations

from evo.core.genome import Gene

STEPS_PER_EXCHANGE = (1, 2, 4, 8)


def exchange_gene() -> Gene:
    return Gene("steps_per_exchange", "scheduling", STEPS_PER_EXCHANGE, 1,
                "scheduling steps the engine runs per exchange with the judge or Serve, every token they make handed "
                "back together (fewer round trips to the sandboxed process; a request sent meanwhile waits for the "
                "exchange, tokens arrive in bursts of up to this many)")
