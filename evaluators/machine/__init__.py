"""What the device is and how it fares: device and core selection, pinning, versions stamped on every result,
a device sync for timers (`device`), and the machine's load, clocks and heat around a timing (`telemetry`).

Offers: `device_info`, `select_device`, `cpu_name`, `versions`, `sync`, `Sampler`, `MachineSampler`.
"""
from __future__ import annotations

from evaluators.face import offers

OFFERS = {"device_info": "device", "select_device": "device", "cpu_name": "device", "versions": "device",
          "sync": "device", "Sampler": "telemetry", "MachineSampler": "telemetry"}
__getattr__ = offers(__name__, OFFERS)
