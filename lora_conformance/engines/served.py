"""What the plugins of served engines share: the server-sent events their streamed answers come in,
and stopping a server started in a process group (session) of its own."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Any, Iterator, Optional

from lora_conformance.processes import stop_process_group  # noqa: F401 (the served engines stop their servers with it)
from lora_conformance.engines.base import EngineFailure


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
