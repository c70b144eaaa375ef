"""The openai engine does not take a server's word for more than it says: a redirect answered to
a load is not a success, an answer larger than the cap is refused before it is buffered, a
completion with two choices for one prompt is an error (not silently the first), and the log of
a server the engine started is deleted at close unless something failed."""

from __future__ import annotations

import json
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_engine_openai import StandIn, model_dir  # noqa: E402,F401  (the fixture is reused)

from lora_conformance.engines import openai_engine  # noqa: E402
from lora_conformance.engines.base import EngineFailure  # noqa: E402
from lora_conformance.engines.openai_engine import OpenAIEngine  # noqa: E402
from lora_conformance.types import GenerationRequest  # noqa: E402


class Misbehaving(StandIn):
    mode = ""

    def do_POST(self):
        if self.mode == "redirect-load" and self.path.endswith("/load_lora_adapter"):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(303)
            self.send_header("Location", "http://127.0.0.1:1/elsewhere")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.mode in ("two-choices", "huge") and self.path == "/v1/completions":
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = self._complete(body)
            if self.mode == "two-choices":
                answer["choices"] = answer["choices"] * 2
                return self._send(200, answer)
            self.send_response(200)  # a body far over the cap, streamed without a Content-Length
            self.end_headers()
            chunk = b" " * 65536
            try:
                for _ in range(64):
                    self.wfile.write(chunk)
            except OSError:
                pass
            return
        return super().do_POST()


@pytest.fixture
def serve(model_dir):  # noqa: F811
    from transformers import AutoTokenizer

    servers = []

    def start(mode):
        Misbehaving.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        Misbehaving.loaded, Misbehaving.seen, Misbehaving.delay, Misbehaving.flavor = {}, [], 0.0, "vllm"
        Misbehaving.mode = mode
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Misbehaving)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return OpenAIEngine(model_dir, "cpu", "float32", {"url": f"http://127.0.0.1:{httpd.server_address[1]}",
                                                          "validate_adapters": "0"})

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def test_a_redirect_answered_to_a_load_is_not_success(serve):
    engine = serve("redirect-load")
    with pytest.raises(EngineFailure, match="answered 303 redirecting to .*elsewhere"):
        engine.load_adapter("A", Path("/some/adapter"))
    assert "A" not in engine.list_adapters()


def test_two_choices_for_one_prompt_are_an_error(serve):
    engine = serve("two-choices")
    with pytest.raises(EngineFailure, match="2 choices for one prompt; expected exactly 1"):
        engine.generate([GenerationRequest("a dog", None, 2)])


def test_an_answer_over_the_cap_is_refused_without_buffering_it(serve, monkeypatch):
    monkeypatch.setattr(openai_engine, "MAX_RESPONSE_BYTES", 1 << 20)
    engine = serve("huge")
    with pytest.raises(EngineFailure, match="exceeded 1048576 bytes"):
        engine.generate([GenerationRequest("a dog", None, 2)])


def test_server_log_deleted_after_a_clean_close_kept_after_a_failed_start(model_dir):  # noqa: F811
    here = Path(__file__).resolve().parent
    cmd = f"{sys.executable} {here / 'test_engine_openai.py'} --serve --host {{host}} --port {{port}} --model {{model}}"
    e = OpenAIEngine(model_dir, "cpu", "float32", {"server_cmd": cmd, "startup_timeout": "60"})
    log = e._server.log_path
    assert log.exists()
    e.close()
    assert not log.exists(), "a clean run's server log is deleted"
    bad = f"{sys.executable} -c \"import sys; print('boom: bad flag'); sys.exit(3)\" --host {{host}}"
    with pytest.raises(EngineFailure, match=r"log (\S+):") as exc:
        OpenAIEngine(model_dir, "cpu", "float32", {"server_cmd": bad, "startup_timeout": "30"})
    kept = Path(str(exc.value).split("log ", 1)[1].split(":\n", 1)[0])
    assert kept.exists() and "boom" in kept.read_text(), "a failed start's log is kept for the reader"
    kept.unlink()
