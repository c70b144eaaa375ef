"""What the plugins of served engines share: a server process they start (``ServerProcess``: its
session (process group), its log, its death, its stop, HTTP to it), one HTTP exchange under one
deadline (``exchange``) and the server-sent events their streamed answers come in (``sse_events``)."""

from __future__ import annotations

import http.client
import json
import shlex
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from lora_conformance.processes import stop_process_group
from lora_conformance.engines.base import EngineError, EngineFailure

# How long one /health poll of a starting server may take (s).
HEALTH_POLL_S = 5.0


def sse_events(resp, deadline: float, late: str) -> Iterator[Any]:
    """The JSON object of each ``data:`` line of the HTTP response ``resp`` until ``[DONE]`` or the end of
    the stream; past ``deadline`` (``time.monotonic()``) an EngineFailure saying ``late``."""
    while True:
        if time.monotonic() > deadline:
            raise EngineFailure(late)
        line = resp.readline()
        if not line:
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def exchange(host: str, port: Optional[int], method: str, path: str, body: Any, budget: float, max_bytes: int,
             what: str) -> tuple[int, bytes, Any]:
    """One HTTP exchange (JSON ``body``, or none) under one deadline of ``budget`` seconds for connect,
    send, headers and body together, with no proxy: ``(status, body bytes, headers)``. An answer over
    ``max_bytes``, or shorter than its Content-Length, is an EngineFailure naming ``what``; a passed
    deadline is a TimeoutError (a timer shuts the socket, so a server that trickles bytes cannot hold
    the exchange longer); other transport errors (http.client, OSError, ValueError) pass through."""
    conn = http.client.HTTPConnection(host, port, timeout=budget)
    expired = threading.Event()

    def expire():  # unblocks a recv() that a trickling server keeps alive
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(budget, expire)
    timer.daemon = True
    timer.start()
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.length is not None and resp.length > max_bytes:
            raise EngineFailure(f"{what}: answer of {resp.length} bytes refused (more than {max_bytes} bytes; "
                                "no answer of this API needs that much)")
        chunks, size = [], 0
        while not expired.is_set():
            chunk = resp.read1(65536)
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                raise EngineFailure(f"{what}: answer exceeded {max_bytes} bytes; refused (no answer of this API "
                                    "needs that much)")
            chunks.append(chunk)
        if expired.is_set():
            raise TimeoutError()
        if resp.length:  # the server closed before sending what Content-Length promised
            raise EngineFailure(f"{what}: short answer, {resp.length} byte(s) of the body missing")
        return resp.status, b"".join(chunks), resp.headers
    except (http.client.HTTPException, OSError, ValueError):
        if expired.is_set():
            raise TimeoutError() from None
        raise
    finally:
        timer.cancel()
        conn.close()


def error_message(parsed: Any) -> Any:
    """The message of a server's error answer: ``{"error": {"message": ...}}``, ``{"error": ...}``, or
    the answer itself."""
    if not isinstance(parsed, dict):
        return parsed
    err = parsed.get("error", parsed)
    return err.get("message", err) if isinstance(err, dict) else err


def parse_answer(raw: bytes) -> Any:
    """A JSON answer, its text where it is not JSON (some routes answer in plain text), None when empty."""
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text) if text.strip() else None
    except ValueError:
        return text


class ServerProcess:
    """A server a plugin starts on 127.0.0.1 (``vllm serve``-like: SGLang's launch_server, llama-server):
    ``argv`` in a session (process group) of its own, so ``stop`` ends it with every process it spawned;
    its output in a log file that stays where something failed (the failure's message names it) and is
    removed otherwise; HTTP to it under one deadline per exchange, never through a proxy.

    ``label`` names the server in messages ("SGLang server"), ``owner`` the engine ("engine 'sglang'").
    A subclass maps the server's error answers to typed errors (``error``) and may say more about a
    failed start (``start_failure``). The start returns once ``GET health_route`` answers 2xx, or
    raises EngineFailure (the server exited, or ``startup_timeout`` passed) with the log's words."""

    health_route = "/health"
    poll_s = 1.0  # between /health polls while it starts
    tail_lines = 40  # of the log, in a failure's message

    def __init__(self, argv: list[str], port: int, *, label: str, owner: str, log_prefix: str,
                 startup_timeout: float, request_timeout: float, max_bytes: int,
                 env: Optional[Mapping[str, str]] = None):
        self.label, self.owner = label, owner
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.argv = list(argv)
        self.timeout = request_timeout
        self.max_bytes = max_bytes
        log = tempfile.NamedTemporaryFile("wb", prefix=log_prefix, suffix=".log", delete=False)
        self.log_path = Path(log.name)
        self.keep_log = False
        try:
            self.proc: Optional[subprocess.Popen] = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=None if env is None else dict(env), start_new_session=True)
        except OSError as exc:
            self.log_path.unlink(missing_ok=True)
            raise EngineFailure(f"{owner}: cannot start {shlex.join(self.argv)}: {exc}") from exc
        finally:
            log.close()
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.keep_log = True
            self.stop()
            raise

    # ---- lifetime ---------------------------------------------------------------------------

    def _wait_ready(self, startup_timeout: float) -> None:
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineFailure(f"{self.label} exited with code {self.proc.returncode} during start-up "
                                    f"({shlex.join(self.argv)}){self.start_failure()}")
            try:
                status, _ = self._raw("GET", self.health_route, None, HEALTH_POLL_S)
                if 200 <= status < 300:
                    return
            except (EngineError, OSError, http.client.HTTPException, ValueError):
                pass
            time.sleep(self.poll_s)
        raise EngineFailure(f"{self.label} not healthy on {self.url}{self.health_route} after {startup_timeout:g} s; "
                            f"log {self.log_path}:\n{self.log_tail()}")

    def start_failure(self) -> str:
        """What the log says about a start that ended, after the message's ``during start-up (argv)``."""
        return f"; log {self.log_path}:\n{self.log_tail()}"

    def log_tail(self, n: Optional[int] = None) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-(n or self.tail_lines):])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """End the server's process group (SIGTERM, then SIGKILL); its log goes unless something failed
        or the server died on its own (the log says why). Safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            stop_process_group(proc)
        elif proc is not None and proc.returncode not in (0, -signal.SIGTERM, -signal.SIGKILL):
            self.keep_log = True
        if not self.keep_log:
            self.log_path.unlink(missing_ok=True)

    def died(self) -> Optional[EngineFailure]:
        """Why the server cannot answer (stopped, or exited: the log's tail), or None while it runs."""
        if self.proc is None:
            return EngineFailure(f"{self.owner}: the server is stopped")
        if self.proc.poll() is not None:
            self.keep_log = True
            return EngineFailure(f"{self.label} exited with code {self.proc.returncode}; log {self.log_path}:\n"
                                 f"{self.log_tail()}")
        return None

    # ---- HTTP -------------------------------------------------------------------------------

    def error(self, parsed: Any, what: str) -> EngineError:
        """The typed error for an error answer (``parsed``: its JSON, or its text) of ``what``."""
        return EngineFailure(f"{self.label} {what}: {error_message(parsed)}")

    def exchange(self, method: str, route: str, body: Any = None, timeout: Optional[float] = None) -> tuple[int, Any]:
        """``(status, parsed answer)`` of one exchange with the running server; a dead server, a broken
        exchange or a passed deadline is an EngineFailure that says which."""
        died = self.died()
        if died is not None:
            raise died
        budget = timeout or self.timeout
        try:
            status, raw = self._raw(method, route, body, budget)
        except EngineError:
            raise
        except (http.client.HTTPException, OSError, ValueError) as exc:
            raise self._transport_failure(f"{method} {route}", exc, budget) from None
        return status, parse_answer(raw)

    def request(self, method: str, route: str, body: Any = None, timeout: Optional[float] = None) -> Any:
        """The parsed answer of a 2xx exchange; an error answer is ``error``'s typed error."""
        status, parsed = self.exchange(method, route, body, timeout)
        return self.checked(status, parsed, f"{method} {route}")

    def checked(self, status: int, parsed: Any, what: str) -> Any:
        """``parsed`` where ``status`` is 2xx; else ``error``'s typed error (4xx, 5xx) or an EngineFailure."""
        if status >= 400:
            raise self.error(parsed, f"{what} answered {status}")
        if not 200 <= status < 300:
            raise EngineFailure(f"{self.label} {what}: answered {status}; expected 2xx")
        return parsed

    def stream(self, route: str, body: Any) -> Iterator[Any]:
        """The JSON objects of a server-sent-event answer to ``POST route`` (``data: {...}`` lines) until
        ``[DONE]``, all under the request deadline."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        deadline = time.monotonic() + self.timeout
        try:
            conn.request("POST", route, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status >= 400:
                raise self.error(parse_answer(resp.read(self.max_bytes)),
                                 f"POST {route} (stream) answered {resp.status}")
            yield from sse_events(resp, deadline, f"{self.label} streamed {route} did not finish within "
                                                  f"{self.timeout:g} s")
        except EngineError:
            raise
        except (http.client.HTTPException, OSError, ValueError) as exc:
            raise self._transport_failure(f"streamed {route}", exc, self.timeout) from None
        finally:
            conn.close()

    def _raw(self, method: str, route: str, body: Any, budget: float) -> tuple[int, bytes]:
        status, raw, _ = exchange("127.0.0.1", self.port, method, route, body, budget, self.max_bytes,
                                  f"{self.label} {method} {route}")
        return status, raw

    def _transport_failure(self, what: str, exc: Exception, budget: float) -> EngineError:
        """What a broken exchange means: the server's death where it died, else a timeout or the error."""
        died = self.died()
        if died is not None:
            return died
        if isinstance(exc, TimeoutError):  # socket.timeout too
            return EngineFailure(f"{self.label} {what}: no complete answer within {budget:g} s")
        return EngineFailure(f"{self.label} {what}: {type(exc).__name__}: {exc}")
