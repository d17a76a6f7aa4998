"""Running `specgen serve`: the listening socket (bound before the models load, so a port in
use is said at once), uvicorn over the app, and a clean stop on SIGINT or SIGTERM: no new
requests, the running generation ended within one step, exit within seconds."""

from __future__ import annotations

import ipaddress
import signal
import socket
from typing import Callable

from speccli.errors import UsageError

# Seconds uvicorn waits for open connections after a stop signal before it closes them.
GRACEFUL_SECONDS = 3
LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one), or a UsageError saying why not."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must lie in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise UsageError(
            f"cannot resolve --host {host!r}: {error.strerror}", "use an address such as 127.0.0.1"
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        hint = "pick another with --port N (0: any free port)" if port else "check --host"
        raise UsageError(f"cannot listen on {host}:{port}: {error.strerror}", hint) from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def run(app, sock: socket.socket, on_stop: Callable[[], None]) -> None:
    """Serve `app` on `sock` until SIGINT or SIGTERM; `on_stop` runs as the signal arrives
    (it must not block: it cancels the generation that runs)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            on_stop()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=GRACEFUL_SECONDS,
        loop="asyncio",
    )
    # uvicorn raises the signal it caught again once it has stopped, to the handler that was
    # there before: this no-op, so that a stop asked for is a clean exit.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        Server(config).run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
