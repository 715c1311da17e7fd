"""`trireme workers`: a worker host. It offers this machine (or container, or GPU) to a
scheduler, then spawns and supervises the worker processes of the instances the scheduler
places on it, one process per instance, as `trireme serve` does for its own.

    host ──HostHello (name, GPUs, CPU, shm domain)──▶ scheduler
         ◀──SpawnWorker / StopWorker───────────────
         ──WorkerExited, HostHeartbeat────────────▶
    worker processes ──connect──▶ the same scheduler address (they load and serve as usual)

When the scheduler goes away its workers exit on their own (their connection closes) and
the host stops any still running: a scheduler that comes back starts from a clean host,
which introduces itself again when the connection is back.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

from services.common import logsettings, shm, transport
from services.common import messages as m
from services.common.procutil import TERM_GRACE_S, set_title
from services.common.supervisor import ProcessHandle

log = logging.getLogger("trireme.host")


class WorkerHost:
    def __init__(self, scheduler_addr: str, name: str, gpus: dict[int, int], cpu: bool,
                 worker_args: list[str]) -> None:
        self.scheduler_addr = scheduler_addr
        self.name = name
        self.gpus = gpus                  # GPU id (a config's `gpus: [k]`) -> CUDA ordinal here
        self.cpu = cpu
        self.worker_args = worker_args
        self.workers: dict[str, ProcessHandle] = {}
        self.domain = shm.domain()
        self._conn: transport.Connection | None = None
        self._connected = False
        # What the scheduler sends a host, and who handles it: the connection's one table
        self._handlers: dict[type, Callable[[Any], None]] = {
            m.SpawnWorker: self._on_spawn,
            m.StopWorker: self._on_stop,
            m.LogSettingsChanged: self._on_log_settings,
        }

    async def run(self, stop: asyncio.Event) -> None:
        for seg in shm.sweep_stale():
            log.info("removed stale shared-memory segment %s", seg)
        self._conn = transport.connect(self.scheduler_addr, self._on_message,
                                       identity=f"host/{self.name}".encode(),
                                       on_state=self._on_state)
        beat = asyncio.get_running_loop().create_task(self._heartbeat())
        log.info("worker host %s (GPUs %s, CPU %s) serving scheduler %s", self.name,
                 sorted(self.gpus) or "none", "yes" if self.cpu else "no", self.scheduler_addr)
        await stop.wait()
        beat.cancel()
        await self._stop_all()
        self._conn.close()

    def _send(self, msg: object) -> None:
        if self._connected and self._conn is not None:
            self._conn.send(m.encode(msg))   # not queued while away: a new scheduler knows none of it

    def _hello(self) -> None:
        self._send(m.HostHello(self.name, os.getpid(), sorted(self.gpus), self.cpu, self.domain))

    def _on_state(self, connected: bool) -> None:
        self._connected = connected
        if connected:
            log.info("connected to the scheduler at %s", self.scheduler_addr)
            self._hello()
        else:
            log.warning("lost the scheduler: stopping %d worker(s) until it is back",
                        len(self.workers))
            asyncio.get_running_loop().create_task(self._stop_all())

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(m.HOST_HEARTBEAT_S)
            self._send(m.HostHeartbeat(self.name))

    def _on_message(self, parts: list) -> None:
        msg, _ = m.decode(parts)
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("unexpected %s from the scheduler", type(msg).__name__)
            return
        handler(msg)

    def _on_spawn(self, msg: m.SpawnWorker) -> None:
        asyncio.get_running_loop().create_task(self._spawn(msg))

    def _on_log_settings(self, msg: m.LogSettingsChanged) -> None:
        logsettings.apply(msg.settings)   # (its workers inherit them)

    def _on_stop(self, msg: m.StopWorker) -> None:
        loop = asyncio.get_running_loop()
        if not msg.worker_id:   # the scheduler does not know us (any more)
            loop.create_task(self._reintroduce())
            return
        h = self.workers.get(msg.worker_id)
        if h is None:
            self._send(m.WorkerExited(msg.worker_id, 0, 0))   # gone already
        elif msg.kill:
            h.kill()
        else:
            loop.create_task(h.stop(msg.timeout_s))

    async def _spawn(self, msg: m.SpawnWorker) -> None:
        env = None
        if msg.cuda_device >= 0:
            env = {"CUDA_VISIBLE_DEVICES": str(self.gpus.get(msg.cuda_device, msg.cuda_device))}
        h = ProcessHandle(f"worker {msg.worker_id}", "services.workers.main",
                          ["--scheduler", self.scheduler_addr, "--worker-id", msg.worker_id,
                           *self.worker_args, *msg.args], on_exit=self._exited, env=env)
        self.workers[msg.worker_id] = h
        try:
            await h.start()
        except OSError as e:
            log.error("cannot start worker %s: %s", msg.worker_id, e)
            del self.workers[msg.worker_id]
            self._send(m.WorkerExited(msg.worker_id, 0, 127))

    async def _exited(self, h: ProcessHandle, code: int) -> None:
        worker_id = h.args[h.args.index("--worker-id") + 1]
        if self.workers.get(worker_id) is h:
            del self.workers[worker_id]
        self._send(m.WorkerExited(worker_id, h.pid, code))

    async def _stop_all(self) -> None:
        await asyncio.gather(*(h.stop(TERM_GRACE_S) for h in list(self.workers.values())))

    async def _reintroduce(self) -> None:
        await self._stop_all()
        self._hello()


def _gpus(value: str) -> dict[int, int]:
    """--gpus 0,1 (GPU ids, which are also the CUDA ordinals here) or 1=0 (GPU id 1 is CUDA
    device 0 here: a container given only GPU 1 sees it as its device 0)."""
    out: dict[int, int] = {}
    try:
        for item in filter(None, value.split(",")):
            gid, _, ordinal = item.partition("=")
            out[int(gid)] = int(ordinal or gid)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected GPU ids like 0,1 or id=ordinal pairs like 1=0, got '{value}'") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trireme workers",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="a worker host: runs the model instances a "
                                            "scheduler places on this machine")
    p.add_argument("--scheduler", required=True,
                   help="the scheduler's worker address (its --worker-addr), e.g. "
                        "stream://scheduler:8011")
    p.add_argument("--name", default=socket.gethostname(),
                   help="this host's name in the scheduler's logs (its hostname)")
    p.add_argument("--gpus", type=_gpus, default={},
                   help="GPUs this host runs KIND_GPU instances on: ids as in a config's "
                        "`gpus: [k]`, or id=ordinal pairs when CUDA numbers them differently here")
    p.add_argument("--cpu", action="store_true",
                   help="run KIND_CPU instances (the default when --gpus is not given)")
    p.add_argument("--no-shm", action="store_true",
                   help="workers send every tensor inline (normally decided at run time)")
    logsettings.add_log_args(p)   # (then the scheduler's: it says when they change)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logsettings.configure(logsettings.from_args(args))
    set_title(f"trireme workers {args.name}")
    host = WorkerHost(args.scheduler, args.name, args.gpus, args.cpu or not args.gpus,
                      ["--no-shm"] if args.no_shm else [])

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await host.run(stop)

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
