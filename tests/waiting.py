"""Polling for something a test started in another process to come about."""
import time


def wait_for(predicate, timeout: float, what: str, tolerate: tuple[type[BaseException], ...] = (),
             poll_s: float = 0.5):
    """The first truthy value of `predicate()`, polled every `poll_s` seconds (0.5: another process; shorter
    where a test times how soon something came about); errors in `tolerate` count as "not yet". Fails the
    test after `timeout` seconds naming `what` it waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except tolerate:
            pass
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
