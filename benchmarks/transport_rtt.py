"""Round trip of one small message between two processes: ZeroMQ (DEALER -> ROUTER over
ipc://, as the services use it) beside a plain Unix stream socket, unpinned and with both
processes on one CPU. It is the per-hop floor under the batch-1 latency target: a request
crosses three such hops (frontend -> scheduler -> worker -> frontend).

    python benchmarks/transport_rtt.py [--n 3000]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time

import zmq

PAYLOAD = b"y" * 100     # about one InferRequest header


def zmq_echo(path: str, ready: mp.Event, cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    s = zmq.Context().socket(zmq.ROUTER)
    s.bind(f"ipc://{path}")
    ready.set()
    while True:
        parts = s.recv_multipart()
        if parts[-1] == b"stop":
            return
        s.send_multipart(parts)


def unix_echo(path: str, ready: mp.Event, cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    ready.set()
    conn, _ = srv.accept()
    while data := conn.recv(65536):
        conn.sendall(data)


def measure(kind: str, n: int, cpus: tuple[int | None, int | None]) -> list[float]:
    path = os.path.join(tempfile.mkdtemp(prefix="rtt-"), "s.sock")
    ready = mp.Event()
    server = mp.Process(target=zmq_echo if kind == "zmq" else unix_echo,
                        args=(path, ready, cpus[0]), daemon=True)
    server.start()
    ready.wait(10)
    if cpus[1] is not None:
        os.sched_setaffinity(0, {cpus[1]})
    lat = []
    try:
        if kind == "zmq":
            s = zmq.Context.instance().socket(zmq.DEALER)
            s.connect(f"ipc://{path}")
            for _ in range(n):
                t = time.perf_counter()
                s.send_multipart([b"k", PAYLOAD])
                s.recv_multipart()
                lat.append(time.perf_counter() - t)
            s.send_multipart([b"k", b"stop"])
            s.close(0)
        else:
            c = socket.socket(socket.AF_UNIX)
            c.connect(path)
            for _ in range(n):
                t = time.perf_counter()
                c.sendall(PAYLOAD)
                c.recv(65536)
                lat.append(time.perf_counter() - t)
            c.close()
    finally:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
        server.join(5)
        if server.is_alive():
            server.kill()
    return lat[n // 10:]   # drop the warm-up tenth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000, help="round trips per row")
    args = ap.parse_args()
    print(f"# One-message round trip between two processes ({os.cpu_count()} CPUs, "
          f"pyzmq {zmq.pyzmq_version()}, libzmq {zmq.zmq_version()})\n")
    print("| transport | placement | p50 µs | p99 µs |")
    print("|---|---|---:|---:|")
    for placement, cpus in (("unpinned", (None, None)), ("same CPU", (0, 0)),
                            ("different CPUs", (0, 1))):
        for kind, label in (("zmq", "ZeroMQ DEALER→ROUTER, ipc://"),
                            ("unix", "Unix stream socket")):
            lat = sorted(measure(kind, args.n, cpus))
            print(f"| {label} | {placement} | {statistics.median(lat) * 1e6:.1f} | "
                  f"{lat[int(len(lat) * 0.99)] * 1e6:.1f} |")


if __name__ == "__main__":
    main()
