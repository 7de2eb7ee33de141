"""The server's listening socket, bound before the model loads: a port in use (or a host this machine does
not have) is a one-line error at once, not after minutes of loading and a "serving on" line that was not so.
"""

from __future__ import annotations

import socket

from k2lab.errors import K2LabError

__all__ = ["bind", "serve_on"]


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` (``SO_REUSEADDR``, as uvicorn binds); port 0 takes a free one,
    which ``sock.getsockname()[1]`` names. ``K2LabError`` when the address cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise K2LabError(
            f"cannot serve on {host}:{port}: the host does not resolve ({error.strerror})"
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise K2LabError(f"cannot serve on {host}:{port}: {error.strerror}") from None
    return sock


def serve_on(app: object, sock: socket.socket) -> None:
    """Run ``app`` with uvicorn on the bound ``sock`` until interrupted (uvicorn listens on it)."""
    import uvicorn

    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])  # type: ignore[arg-type]
