"""What judges an engine, through the sandbox's one entry (`evaluators.sandbox.EngineProcess`):

- `Evaluator` (`evaluator`): builds a candidate in its sandbox, checks it against the float64 reference on
  fresh inputs (`check`), times it (`timing`), and hands a generation workload to `GenerationJudge`
  (`generation`), which judges it as a client over request traces (`replay`);
- `retime` (`paired`): paired, interleaved re-timing of several held engines; `Calibration`: the roofline;
- `SyntheticEvaluator` (`synthetic`): a deterministic stand-in for tests of the search;
- `RequestIds`: the id sequence a generation engine sees from the judge and from Serve alike.
"""
from __future__ import annotations

OFFERS = {"Evaluator": "evaluator", "GenerationJudge": "generation", "objective_of": "generation",
          "replay": "replay", "score": "replay", "request_problems": "replay", "ConfinedGenerator": "replay",
          "retime": "paired", "Calibration": "calibration", "SyntheticEvaluator": "synthetic",
          "RequestIds": "request_ids", "check_engine": "check"}


def __getattr__(name: str):
    """The names above, imported from their module on first use (a face imports nothing by itself)."""
    import importlib

    if name not in OFFERS:
        raise AttributeError(f"module {__name__!r} offers {sorted(OFFERS)}, not {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{OFFERS[name]}"), name)
