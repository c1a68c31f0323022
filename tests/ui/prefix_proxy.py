"""A reverse proxy for tests: serves PREFIX/... by forwarding /... to an upstream server (the
way a proxy in front of `paged serve --root-path PREFIX` does), streaming replies through."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}


@contextmanager
def prefix_proxy(upstream: str, prefix: str) -> Iterator[str]:
    """Yields the proxy's base URL (http://127.0.0.1:PORT); PREFIX/x reaches upstream /x."""

    class Handler(BaseHTTPRequestHandler):  # HTTP/1.0: each reply ends when it closes
        def forward(self) -> None:
            if not self.path.startswith(prefix + "/"):
                self.send_error(404)
                return
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
            url = upstream + self.path.removeprefix(prefix)
            with httpx.stream(self.command, url, headers=headers, content=body, timeout=120) as r:
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in HOP:
                        self.send_header(k, v)
                self.end_headers()
                try:
                    for chunk in r.iter_raw():
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the browser went away (a stopped reply): closing r aborts upstream

        do_GET = do_POST = forward

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
