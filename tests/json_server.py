"""A JSON server on 127.0.0.1 for the tests of served models: a subclass says how it answers (``answer``); the server
keeps every request and stops with ``close``."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JSONServer:
    """Answers each POST with ``answer(path, body)``'s ``(status, JSON object)``, each GET with ``get``'s.
    ``requests`` keeps each request's ``(path, body (None for a GET), Authorization header)``; ``url`` is the
    server's base address."""

    def __init__(self):
        self.requests: list[tuple[str, dict, str | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append((self.path, body, self.headers.get("Authorization")))
                self.send(*server.answer(self.path, body))

            def do_GET(self):
                server.requests.append((self.path, None, self.headers.get("Authorization")))
                self.send(*server.get(self.path, self.headers.get("Authorization")))

            def send(self, status: int, answer: dict) -> None:
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def answer(self, path: str, body: dict) -> tuple[int, dict]:
        """The HTTP status and the JSON object that answer a POST to ``path`` with ``body``."""
        raise NotImplementedError

    def get(self, path: str, authorization: str | None) -> tuple[int, dict]:
        """The HTTP status and the JSON object that answer a GET of ``path`` (none by default: 404)."""
        return 404, {"error": f"no route {path}"}

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
