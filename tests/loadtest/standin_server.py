"""A stand-in for another project's server in the serve-compare tests: an HTTP front process with one engine child.

``python standin_server.py PORT``. Imports nothing from pdserve (it must run in the clean environment a foreign
server gets). ``GET /health`` and ``POST /v1/completions`` answer 200 (a completion is one JSON body, not a stream);
``GET /v1/models`` lists ``mock-model`` (the mock server's name); ``GET /env`` returns the front's environment;
``GET /burn?s=X`` makes the engine child burn X CPU-seconds and returns what that child measured of its own CPU
(``time.process_time``): the oracle for the CPU accounting of a process tree.
"""

import json
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

ENGINE = """
import sys, time
for line in sys.stdin:
    t0 = time.process_time()
    while time.process_time() - t0 < float(line):
        sum(i * i for i in range(1000))
    print(time.process_time() - t0, flush=True)
"""

engine = subprocess.Popen([sys.executable, "-c", ENGINE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


class Handler(BaseHTTPRequestHandler):
    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        url = urlparse(self.path)
        if url.path == "/env":
            return self._send(dict(__import__("os").environ))
        if url.path == "/burn":
            engine.stdin.write(parse_qs(url.query)["s"][0] + "\n")
            engine.stdin.flush()
            return self._send({"engine_pid": engine.pid, "engine_cpu_s": float(engine.stdout.readline())})
        if url.path == "/v1/models":
            return self._send({"object": "list", "data": [{"id": "mock-model"}]})
        return self._send({"status": "ok"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send({"choices": [{"text": "x"}]})

    def log_message(self, *args) -> None:
        pass


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
