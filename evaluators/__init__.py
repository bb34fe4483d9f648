"""The judge's side of the factory, in rooms by job (each room's face says what it offers):

- `evaluators.sandbox`: what confines an engine's process (zygote, jail and its allow-list view, seccomp,
  cgroups, shared arenas, the call guard). It knows nothing of judges: it launches, builds, calls and kills.
- `evaluators.machine`: what the device is (cores, pinning, versions, device sync) and how it fares (telemetry).
- `evaluators.judge`: what judges an engine: the `Evaluator` (call engines: check cascade and timing; generation
  engines: `judge.generation` and its client `judge.replay`), paired re-timing, the roofline calibration.
- `evaluators.served`: the served twins of the judge's engines (Serve replicas are their clients).
- `evaluators.pool`: the Ray pool of evaluator actors and where they are placed.
- `evaluators.settings`: every option of the evaluators and of the pool, declared once.

Imports flow down that list's order of layers: settings, machine, sandbox, judge, then served and pool
(peers); `tests/test_layout.py` holds it.
"""
