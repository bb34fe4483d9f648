"""What confines an engine: a fresh process per candidate, forked from a zygote, in a jail (namespaces,
an allow-list view of the files, seccomp, cgroups), reached only through its channel and shared arenas,
with the workload's reference and baselines guarded. It knows nothing of judges: a judge asks it to launch,
build, call, step and kill an engine, and reads what comes back (`EngineProcess`).

Offers: `EngineProcess`, `EngineProcessError`, `CallResult`, `SANDBOXES` (the confinement levels),
`probe_strict` (can this machine confine), `workload_modules`.
"""
from __future__ import annotations

from evaluators.face import offers

OFFERS = {"EngineProcess": "process", "EngineProcessError": "process", "CallResult": "process",
          "SANDBOXES": "process", "probe_strict": "process", "workload_modules": "process"}
__getattr__ = offers(__name__, OFFERS)
