"""A clean stop on SIGTERM (what `ray job stop` sends) or Ctrl-C: stop dispatching, keep what finished.

The search loop and the evaluator pool poll `STOP`. Results that finished are already in the
journal; the interrupted generation stays resumable with `python -m evo resume RUN_DIR`.
"""
from __future__ import annotations

import signal
import threading

STOP = threading.Event()


def install_handlers() -> None:
    """Turn SIGTERM and SIGINT into a stop request (call from the main thread)."""
    def request_stop(signum, frame) -> None:
        if STOP.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means now
        STOP.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
