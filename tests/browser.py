"""Headless Chromium driven over the DevTools protocol, to read what a page really rendered.

`chromium --dump-dom` prints only the top document; the MLflow UI shows an HTML artifact inside a
sandboxed iframe, so the test reads that iframe's DOM through the protocol instead. Chromium listens on
127.0.0.1 only (a port it picks, read from DevToolsActivePort); `close` ends the process group it started.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from tests.waiting import wait_for

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         # the MLflow UI's sandboxed artifact iframe in this renderer process, so the page target reaches its DOM
         # and screenshots include it (headless leaves isolated iframes out of screenshots)
         "--disable-features=IsolateSandboxedIframes", "--disable-site-isolation-trials",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0"]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


class Browser:
    """One headless Chromium with one page; `call` sends a DevTools command to that page."""

    def __init__(self, executable: str, width: int = 1400, height: int = 1000) -> None:
        from websockets.sync.client import connect

        self.profile = Path(tempfile.mkdtemp(prefix="chromium-"))
        self.process = subprocess.Popen(
            [executable, *FLAGS, f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            active = wait_for(lambda: (self.profile / "DevToolsActivePort").exists()
                              and (self.profile / "DevToolsActivePort").read_text().split(), 60,
                              "Chromium's DevTools port")
            # entered as a context manager (websockets deprecates plain use); `close` closes it
            self.ws = connect(f"ws://127.0.0.1:{active[0]}{active[1]}", max_size=None, open_timeout=30).__enter__()
            self.next_id, self.session = 0, None
            page = wait_for(lambda: [t for t in self._send("Target.getTargets")["targetInfos"] if t["type"] == "page"],
                            30, "Chromium's first page")
            self.session = self._send("Target.attachToTarget", {"targetId": page[0]["targetId"], "flatten": True})["sessionId"]
            self.call("Page.enable")
        except BaseException:
            self.close()
            raise

    def call(self, method: str, params: dict | None = None) -> dict:
        return self._send(method, params, self.session)

    def _send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        self.ws.send(json.dumps(message))
        while True:  # events arrive in between; skip them
            reply = json.loads(self.ws.recv(timeout=60))
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"DevTools {method} failed: {reply['error']}")
                return reply["result"]

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", {"url": url})

    def evaluate(self, expression: str, context_id: int | None = None):
        params = {"expression": expression, "returnByValue": True}
        if context_id is not None:
            params["contextId"] = context_id
        result = self.call("Runtime.evaluate", params)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]!r} raised: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def frame_evaluate(self, url_prefix: str, expression: str):
        """The value of a JS expression in the first child frame whose URL starts with `url_prefix`;
        None while there is no such frame yet."""
        frames, todo = [], [self.call("Page.getFrameTree")["frameTree"]]
        while todo:
            node = todo.pop()
            frames.append(node["frame"])
            todo.extend(node.get("childFrames", []))
        match = [f for f in frames[1:] if f["url"].startswith(url_prefix)]
        if not match:
            return None
        world = self.call("Page.createIsolatedWorld", {"frameId": match[0]["id"], "worldName": "test"})
        return self.evaluate(expression, world["executionContextId"])

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        Path(path).write_bytes(base64.b64decode(data))

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            try:
                self.ws.close()
            except Exception:
                pass
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=20)
        shutil.rmtree(self.profile, ignore_errors=True)
