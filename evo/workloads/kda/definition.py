"""Constants of KDA's definition that the oracle and the engines share (engine-side: the engine's
process imports this module, never the reference's)."""
from __future__ import annotations

L2NORM_EPS = 1e-6  # q and k are scaled by 1 / sqrt(sum x^2 + L2NORM_EPS) over their last dim
