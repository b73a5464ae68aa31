#!/usr/bin/env python3
"""A stand-in for llama.cpp's llama-server in the served part's tests: the same flags
(-m, --host, --port, -np, -c, -t, ...), /health, /v1/models and a streamed
/v1/chat/completions that sends ``max_tokens`` token chunks and the usage, each
token a fixed 2 ms apart. Standard library only."""

from __future__ import annotations

import argparse
import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"data": [{"id": "fake.gguf"}]})
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = int(body["max_tokens"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(obj) -> None:
            data = f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        for i in range(n):
            time.sleep(0.002)
            send({"choices": [{"index": 0, "delta": {"content": f"t{i} "},
                               "logprobs": {"content": [{"token": f"t{i}", "logprob": -0.1}]}}]})
        send({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": n}})
        send("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("-np", type=int, default=1)
    p.add_argument("-c", type=int, default=4096)
    p.add_argument("-t", type=int, default=1)
    p.add_argument("-tb", type=int, default=1)
    p.add_argument("-cb", action="store_true")
    p.add_argument("--no-webui", action="store_true")
    p.add_argument("--log-disable", action="store_true")
    args = p.parse_args()
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
