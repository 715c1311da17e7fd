"""Where a frontend's HTTP and gRPC servers listen. `trireme serve` binds one socket per
frontend and port itself and hands each frontend its own (--http-listen-fd,
--grpc-listen-fd): SO_REUSEPORT on them lets the kernel spread the connections over the
frontends, and a frontend restarted gets the same socket back, its waiting connections
kept. A second server probes the ports with a plain bind first and stops; a stray
`trireme frontend` binds without SO_REUSEPORT unless told to (--reuse-port, which the
compose topology's frontends pass to share one port pair), so it cannot take part of a
server's traffic by accident. grpc.aio (--grpc-impl aio) binds by address only: its
frontends share by SO_REUSEPORT."""
from __future__ import annotations

import os
import socket
from typing import Any

BACKLOG = 1024


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port for one frontend to inherit, SO_REUSEPORT set so
    that its siblings' join it (raises OSError, EADDRINUSE when another process holds the
    port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, port))
        s.listen(BACKLOG)
        s.set_inheritable(True)
    except BaseException:
        s.close()
        raise
    return s


def where(host: str, port: int, fd: int, reuse_port: bool) -> dict[str, Any]:
    """loop.create_server's keywords for a server listening on the inherited socket ``fd``
    (a duplicate: the server closes its own) or else on host:port."""
    if fd >= 0:
        return {"sock": socket.socket(fileno=os.dup(fd))}
    return {"host": host or None, "port": port, "reuse_port": reuse_port}
