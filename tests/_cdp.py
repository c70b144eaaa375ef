"""A headless chromium driven through the DevTools protocol over a pipe (``--remote-debugging-pipe``:
commands on fd 3, answers and events on fd 4, each a JSON message ending in NUL). Standard library
only: enough to open a page, run JavaScript in it, and collect what it logged or threw."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from typing import Any, Optional

NETWORK_OFF = ("--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9")


def _above(fd: int, lowest: int) -> int:
    import fcntl

    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)
    os.close(fd)
    return moved


class Browser:
    def __init__(self, executable: str, profile: str, width: int = 1400, height: int = 1000):
        to_browser, self._commands = os.pipe()
        self._answers, from_browser = os.pipe()
        # Above 4, so that dup2 onto 3 and 4 below never meets itself (a no-op that would keep close-on-exec).
        to_browser, from_browser = (_above(fd, 10) for fd in (to_browser, from_browser))

        def wire():  # in the child: the protocol's two descriptors
            os.dup2(to_browser, 3)
            os.dup2(from_browser, 4)

        self.process = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
             "--remote-debugging-pipe", f"--user-data-dir={profile}", f"--window-size={width},{height}", *NETWORK_OFF,
             "about:blank"],
            preexec_fn=wire, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser)
        os.close(from_browser)
        self._buffer, self._next, self.events, self.session = b"", 0, [], None
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._answers], [], [], left)[0]:
                raise TimeoutError("the browser did not answer in time")
            chunk = os.read(self._answers, 1 << 16)
            if not chunk:
                raise RuntimeError("the browser closed the protocol pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: Optional[dict] = None, timeout: float = 60) -> dict:
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if self.session and not method.startswith(("Target.", "Browser.")):
            msg["sessionId"] = self.session
        os.write(self._commands, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            answer = self._message(deadline)
            if answer.get("id") == self._next:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})
            self.events.append(answer)

    def wait_for(self, method: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, event in enumerate(self.events):
                if event.get("method") == method:
                    return self.events.pop(i)
            self.events.append(self._message(deadline))

    def open(self, url: str) -> None:
        self.events = [e for e in self.events if e.get("method") != "Page.loadEventFired"]
        if "loaderId" in self.send("Page.navigate", {"url": url}):  # none: the same page, another fragment
            self.wait_for("Page.loadEventFired")

    def run(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (an exception in it raises here)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def problems(self) -> list[str]:
        """Everything the pages logged to the console, threw, or reported as an error so far."""
        out = []
        for e in self.events:
            params = e.get("params") or {}
            if e.get("method") == "Runtime.consoleAPICalled":
                out.append(f"console.{params.get('type')}: "
                           + " ".join(str(a.get("value", a.get("description"))) for a in params.get("args") or ()))
            elif e.get("method") == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails") or {}
                out.append(f"exception: {(details.get('exception') or {}).get('description') or details.get('text')}")
            elif e.get("method") == "Log.entryAdded":
                entry = params.get("entry") or {}
                out.append(f"log {entry.get('level')}: {entry.get('text')} {entry.get('url') or ''}".rstrip())
        return out

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._commands)
        os.close(self._answers)
