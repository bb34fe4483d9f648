"""The Ray pool: evaluator actors (`actors`: `EvaluatorPool`, one `Evaluator` per actor, replaced when it
dies or hangs) and where they go (`placement`: one per GPU or CPU evaluators on disjoint cores). The only
room of the judge that imports Ray.
"""
from __future__ import annotations

from evaluators.face import offers

OFFERS = {"EvaluatorPool": "actors", "PlacementError": "placement", "plan_slots": "placement"}
__getattr__ = offers(__name__, OFFERS)
