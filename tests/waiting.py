"""Polling for something a test started in another process to come about."""
import time


def wait_for(predicate, timeout: float, what: str, tolerate: tuple[type[BaseException], ...] = ()):
    """The first truthy value of `predicate()`, polled every 0.5 s; errors in `tolerate` count as
    "not yet". Fails the test after `timeout` seconds naming `what` it waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except tolerate:
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
