"""What judges an engine, through the sandbox's one entry (`evaluators.sandbox.EngineProcess`):

- `Evaluator` (`evaluator`): builds a candidate in its sandbox, checks it against the float64 reference on
  fresh inputs (`check`), times it (`timing`), and hands a generation workload to `GenerationJudge`
  (`generation`), which judges it as a client over request traces (`replay`);
- `retime` (`paired`): paired, interleaved re-timing of several held engines; `Calibration`: the roofline;
- `SyntheticEvaluator` (`synthetic`): a deterministic stand-in for tests of the search;
- `RequestIds`: the id sequence a generation engine sees from the judge and from Serve alike.
"""
from __future__ import annotations

from evaluators.face import offers

OFFERS = {"Evaluator": "evaluator", "GenerationJudge": "generation", "objective_of": "generation",
          "replay": "replay", "score": "replay", "request_problems": "replay", "ConfinedGenerator": "replay",
          "retime": "paired", "Calibration": "calibration", "SyntheticEvaluator": "synthetic",
          "RequestIds": "request_ids", "check_engine": "check"}
__getattr__ = offers(__name__, OFFERS)
