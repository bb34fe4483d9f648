"""An engine kept open for a Serve replica, in the same sandbox and checked by the same judge as in the
search: `ServedEngine` (`engine`: call engines, one call per request, a sample re-scored) and
`ServedGenerator` (`generator`: generation engines, one engine loop serving every caller, every token
accounted for: `guards` (the policy and the rules checked on every token, the stall deadline, the speed
watch), `verifier` (every token before release under `verify: all`; canaries), `canaries` (requests drawn
like users'), `estimate` (the accuracy contract's running estimate over what the replica checks), `stream` (one
request's tokens as its caller reads them). The replica is the engine's client;
it never runs engine code itself.
"""
from __future__ import annotations

from evaluators.face import offers

OFFERS = {"ServedEngine": "engine", "ServedEngineError": "engine", "ServedGenerator": "generator",
          "ServedGeneratorError": "generator", "Overloaded": "generator", "RequestError": "generator"}
__getattr__ = offers(__name__, OFFERS)
