"""A fake OpenAI-compatible server that fails start-up in a chosen way (for test_openai_hardening).

python tests/_fake_openai_server.py MODE PIDFILE --host H --port P
MODE: empty-models | malformed-models | hang | ok. Writes its pid to PIDFILE first."""

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODE, PIDFILE = sys.argv[1], sys.argv[2]
ARGS = dict(zip(sys.argv[3::2], sys.argv[4::2]))
ANSWERS = {"empty-models": {"object": "list", "data": []}, "malformed-models": [1, 2],
           "ok": {"data": [{"id": "base-model"}]}}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        if MODE == "hang":
            time.sleep(3600)
        raw = json.dumps(ANSWERS[MODE]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


with open(PIDFILE, "w") as f:
    f.write(str(__import__("os").getpid()))
ThreadingHTTPServer((ARGS["--host"], int(ARGS["--port"])), Handler).serve_forever()
