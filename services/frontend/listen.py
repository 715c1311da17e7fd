"""Where a frontend's HTTP and gRPC servers listen. The frontends of one `trireme serve`
share sockets it bound and handed down (--http-listen-fd, --grpc-listen-fd): the kernel
spreads the connections over the processes that accept on them, and no other process can
join, because the sockets are bound without SO_REUSEPORT, so a second server, or a stray
`trireme frontend`, on the same ports fails to bind instead of taking part of the traffic.
A frontend run alone binds its own, shared with other frontends only when it is told to
(--reuse-port: the compose topology's frontends, one network namespace, one port pair).
grpc.aio (--grpc-impl aio) binds by address only: its frontends share by SO_REUSEPORT."""
from __future__ import annotations

import os
import socket
from typing import Any

BACKLOG = 1024


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port that the frontend processes inherit (raises
    OSError, EADDRINUSE when another process holds the port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
