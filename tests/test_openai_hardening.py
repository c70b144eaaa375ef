"""openai engine hardening: one deadline per request, typed errors for short or
malformed answers, loopback checked on the argument list the server parses, proxies never
used for loopback, the server stopped on every start-up failure, transactional reloads."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_engine_openai import StandIn, model_dir, server  # noqa: E402,F401  (fixtures)

from lora_conformance.engines.base import EngineError, EngineFailure, UnsupportedFeatureError  # noqa: E402
from lora_conformance.engines.openai_engine import OpenAIEngine  # noqa: E402
from lora_conformance.types import GenerationRequest  # noqa: E402

FAKE = HERE / "_fake_openai_server.py"


def _serve(handler_cls):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


class Models(BaseHTTPRequestHandler):
    """Answers /v1/models well; /v1/completions per the class attribute ``mode``."""

    mode = "trickle"
    models: object = {"data": [{"id": "base-model"}]}

    def log_message(self, *a):
        pass

    def _answer(self, raw: bytes, length: int):
        self.send_response(200)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        import json

        raw = json.dumps(self.models).encode()
        self._answer(raw, len(raw))

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"choices": [{"text": "", "logprobs": {"tokens": [], "top_logprobs": []}}]}'
        if self.mode == "short":
            self._answer(body[:10], len(body))
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for b in body:  # one byte every 0.2 s: each read is quick, the whole answer is not
            try:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.2)


def test_one_deadline_per_request_against_a_trickling_server(model_dir):  # noqa: F811
    Models.mode, Models.models = "trickle", {"data": [{"id": "base-model"}]}
    httpd, url = _serve(Models)
    try:
        e = OpenAIEngine(model_dir, "cpu", "float32", {"url": url, "request_timeout": "1"})
        t0 = time.monotonic()
        with pytest.raises(EngineFailure, match="timed out"):
            e.generate([GenerationRequest("a dog", None, 1)])
        took = time.monotonic() - t0
        assert took < 3.0, f"the request took {took:.1f} s; expected about the 1 s deadline"
    finally:
        httpd.shutdown()


def test_short_body_is_a_typed_failure(model_dir):  # noqa: F811
    Models.mode, Models.models = "short", {"data": [{"id": "base-model"}]}
    httpd, url = _serve(Models)
    try:
        e = OpenAIEngine(model_dir, "cpu", "float32", {"url": url, "request_timeout": "5"})
        with pytest.raises(EngineFailure, match="short answer"):
            e.generate([GenerationRequest("a dog", None, 1)])
    finally:
        httpd.shutdown()


@pytest.mark.parametrize("models", [[1, 2], "plain text", {"data": 5}, {"data": []}, {"data": [{"x": 1}]}])
def test_malformed_models_listing_is_a_typed_failure(model_dir, models):  # noqa: F811
    Models.models = models
    httpd, url = _serve(Models)
    try:
        with pytest.raises(EngineFailure, match="/v1/models"):
            OpenAIEngine(model_dir, "cpu", "float32", {"url": url, "request_timeout": "5"})
    finally:
        httpd.shutdown()


@pytest.mark.parametrize("cmd", [
    "serve {model} --host {host} --host 0.0.0.0 --port {port}",
    "serve {model} --host={host} --host=0.0.0.0 --port {port}",
    "serve {model} --host {host} --hos 0.0.0.0 --port {port}",
    "serve {model} --port {port} --lora-modules {lora_modules} --host {host}",
    "serve {model} --port {port}",
])
def test_every_host_the_server_would_parse_must_be_loopback(model_dir, cmd):  # noqa: F811
    args = {"server_cmd": cmd}
    if "lora_modules" in cmd:
        args["lora_modules"] = "a=/x --host=0.0.0.0"
    with pytest.raises(EngineError, match="loopback|not a valid adapter name|name=path"):
        OpenAIEngine(model_dir, "cpu", "float32", args)


def test_proxies_are_not_used_for_loopback(model_dir, server, monkeypatch):  # noqa: F811
    with socket.socket() as s:  # a port nobody listens on: a proxied request would fail
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy"):
        monkeypatch.setenv(var, f"http://127.0.0.1:{dead}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    import urllib.request

    monkeypatch.setattr(urllib.request, "_opener", None)  # urllib caches its proxy settings per process
    e = OpenAIEngine(model_dir, "cpu", "float32", {"url": server})
    assert len(e.generate([GenerationRequest("a dog", None, 2)])[0].token_ids) == 2


@pytest.mark.parametrize("mode", ["empty-models", "malformed-models", "hang"])
def test_started_server_is_stopped_on_every_startup_failure(model_dir, tmp_path, mode):  # noqa: F811
    pidfile = tmp_path / "pid"
    cmd = f"{sys.executable} {FAKE} {mode} {pidfile} --host {{host}} --port {{port}}"
    with pytest.raises(EngineFailure):
        OpenAIEngine(model_dir, "cpu", "float32", {"server_cmd": cmd, "startup_timeout": "4",
                                                   "request_timeout": "2"})
    deadline = time.monotonic() + 10
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_refused_reload_restores_the_previous_adapter(model_dir, server, tmp_path):  # noqa: F811
    e = OpenAIEngine(model_dir, "cpu", "float32", {"url": server, "validate_adapters": "0"})
    e.load_adapter("a1", tmp_path / "a1")
    with pytest.raises(UnsupportedFeatureError):
        e.load_adapter("a1", tmp_path / "dora")  # the stand-in refuses DoRA paths
    assert e.list_adapters() == ["a1"] and StandIn.loaded == {"a1": str(tmp_path / "a1")}


def test_adapters_are_validated_before_the_server_sees_them(model_dir, server, tmp_path):  # noqa: F811
    """With validate_adapters=1 (off by default: the server's own behaviour is what is certified)."""
    from lora_conformance.engines.base import AdapterFormatError

    e = OpenAIEngine(model_dir, "cpu", "float32", {"url": server, "validate_adapters": "1"})
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterFormatError, match="adapter_config.json"):
        e.load_adapter("a1", tmp_path / "empty")
    assert StandIn.loaded == {} and e.list_adapters() == []
