"""What a process's Unix sockets show about the direct path (for the fault tests): the
worker's direct listener and the connections frontends opened to it, and what waits unread
on them."""
from __future__ import annotations

import os
import subprocess

import psutil


def direct_sockets(pid: int) -> dict[str, list[int]]:
    """The worker's Unix sockets bound to its direct listener's path, by state:
    {"listening": [inode...], "connected": [inode...]} (psutil names the path; the state
    is /proc/net/unix's St column: 01 unconnected (a listener), 03 connected)."""
    paths = {c.laddr for c in psutil.Process(pid).net_connections(kind="unix")
             if c.laddr.endswith(".direct.sock")}
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    out: dict[str, list[int]] = {"listening": [], "connected": []}
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            cols = line.split()
            if len(cols) < 8 or int(cols[6]) not in inodes or cols[7] not in paths:
                continue
            state = {"01": "listening", "03": "connected"}.get(cols[5])
            if state:
                out[state].append(int(cols[6]))
    return out


def direct_path_of(pid: int) -> str:
    paths = {c.laddr for c in psutil.Process(pid).net_connections(kind="unix")
             if c.laddr.endswith(".direct.sock")}
    assert len(paths) == 1, paths
    return paths.pop()


def queued_bytes(path: str) -> int:
    """Bytes the worker has not read yet on its direct connections (ss: Recv-Q of the
    established sockets whose local address is its listener's path)."""
    out = subprocess.run(["ss", "-x", "-n"], capture_output=True, text=True, check=True).stdout
    total = 0
    for line in out.splitlines():
        cols = line.split()
        if len(cols) >= 5 and cols[0] == "u_str" and cols[1] == "ESTAB" and cols[4] == path:
            total += int(cols[2])
    return total
