"""What the device is and how it fares: device and core selection, pinning, versions stamped on every result,
a device sync for timers (`device`), and the machine's load, clocks and heat around a timing (`telemetry`).

Offers: `device_info`, `select_device`, `cpu_name`, `versions`, `sync`, `Sampler`, `MachineSampler`.
"""
from __future__ import annotations

OFFERS = {"device_info": "device", "select_device": "device", "cpu_name": "device", "versions": "device",
          "sync": "device", "Sampler": "telemetry", "MachineSampler": "telemetry"}


def __getattr__(name: str):
    """The names above, imported from their module on first use (a face imports nothing by itself)."""
    import importlib

    if name not in OFFERS:
        raise AttributeError(f"module {__name__!r} offers {sorted(OFFERS)}, not {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{OFFERS[name]}"), name)
