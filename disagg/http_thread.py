"""The HTTP server's thread: uvicorn serving an ASGI app (disagg/http.py's) on a socket
bound up front, so port 0 tells which port it took before anything is served; and the
check that the HTTP packages are installed."""

from __future__ import annotations

import socket
import threading
import time


def require_http():
    missing = []
    for name, dist in (("starlette", "starlette"), ("uvicorn", "uvicorn"),
                       ("prometheus_client", "prometheus-client")):
        try:
            __import__(name)
        except ImportError:
            missing.append(dist)
    if missing:
        raise ImportError(f"serve --http needs {', '.join(missing)}: pip install "
                          f"{' '.join(missing)} (or pip install -e . in the checkout)")


class HTTPServer:
    """uvicorn serving `app` on its own thread. The socket is bound at construction
    (port 0 picks a free one; `port` tells which)."""

    def __init__(self, app, host: str, port: int):
        require_http()
        import uvicorn
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise OSError(f"cannot listen on {host}:{port} ({e.strerror}); pick another "
                          f"--http HOST:PORT") from None
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=10)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "HTTPServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.url} within "
                                   f"{timeout_s:g}s")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop accepting, let open responses finish (up to the graceful timeout), join."""
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()
