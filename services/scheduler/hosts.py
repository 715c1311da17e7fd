"""Worker hosts: the places the scheduler puts model instances.

    `trireme serve`      LocalHost: this process spawns the workers itself (ProcessHandle)
    `trireme workers`    RemoteHost: a process elsewhere (a container per GPU, another
                         machine) that said HostHello on the worker socket; it spawns the
                         workers we ask for and reports their exits (services/workers/host.py)

Both hand out handles with ProcessHandle's interface (start, stop, kill, pid, stopping), so
the lifecycle and the watchdog never know where a worker runs. Placement: a KIND_GPU
instance goes to a host that owns its GPU; a KIND_CPU one to the host running the fewest
instances. A host that stops sending heartbeats for HOST_TIMEOUT_S (or whose connection
breaks: it stops too) is lost: each of its workers exits with LOST_EXIT_CODE, which fails
what it held and restarts it elsewhere, or when a host that fits comes (back).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.common import logsettings, shm
from services.common import messages as m
from services.common.errors import Code, TriremeError
from services.common.procutil import TERM_GRACE_S
from services.common.supervisor import ProcessHandle
from services.scheduler.dispatch import Instance

log = logging.getLogger("trireme.hosts")

LOST_EXIT_CODE = -1000   # a worker whose host was lost: its real fate is unknown here
_STOP_SLACK_S = 5.0      # a remote stop: the host's own SIGKILL comes at timeout_s


class NoWorkerHost(TriremeError):
    """No connected host can run the instance (yet): it waits for one."""

    def __init__(self, inst: Instance, hosts: list[str]) -> None:
        where = (f"GPU {inst.device_id}" if inst.kind == "KIND_GPU" else "CPU instances")
        have = ", ".join(hosts) or "none connected"
        super().__init__(Code.UNAVAILABLE,
                         f"no worker host can run instance '{inst.name}' of model '{inst.model}' "
                         f"(it needs a host with {where}; worker hosts: {have})")


OnExit = Callable[[Any, int], Awaitable[None] | None]


class LocalHost:
    """The embedded host of `trireme serve`: workers are this process's children."""

    name = "local"

    def __init__(self, worker_addr: str, worker_args: list[str]) -> None:
        self.worker_addr = worker_addr
        self.worker_args = worker_args
        self.shm_domain = shm.domain()
        self.instances = 0

    def fits(self, inst: Instance) -> bool:
        return True   # every device of this machine is ours

    def describe(self) -> str:
        return "local (every device)"

    def process(self, inst: Instance, on_exit: OnExit) -> ProcessHandle:
        env = {"CUDA_VISIBLE_DEVICES": str(inst.device_id)} if inst.kind == "KIND_GPU" else None
        return ProcessHandle(f"worker {inst.name}", "services.workers.main",
                             ["--scheduler", self.worker_addr, "--worker-id", inst.worker_id,
                              *self.worker_args], on_exit=on_exit, env=env)


class RemoteProcess:
    """A worker on a remote host, behind ProcessHandle's interface: orders go to the host,
    the exit comes back from it (or from the host's loss)."""

    def __init__(self, host: RemoteHost, inst: Instance, on_exit: OnExit) -> None:
        self.host = host
        self.name = f"worker {inst.name} on {host.name}"
        self.worker_id = inst.worker_id
        self.spawn = m.SpawnWorker(inst.worker_id, list(host.worker_args),
                                   cuda_device=inst.device_id if inst.kind == "KIND_GPU" else -1)
        self.on_exit = on_exit
        self.pid = 0
        self.stopping = False
        self._exited: asyncio.Future | None = None

    async def start(self) -> None:
        self._exited = asyncio.get_running_loop().create_future()
        self.host.procs[self.worker_id] = self
        if not self.host.send(self.spawn):
            self.exited(self.pid, LOST_EXIT_CODE)

    def alive(self) -> bool:
        return self._exited is not None and not self._exited.done()

    def kill(self) -> None:
        if self.alive():
            self.host.send(m.StopWorker(self.worker_id, kill=True))

    async def stop(self, timeout: float = TERM_GRACE_S) -> None:
        self.stopping = True
        if not self.alive():
            return
        assert self._exited is not None
        self.host.send(m.StopWorker(self.worker_id, timeout))
        try:
            await asyncio.wait_for(asyncio.shield(self._exited), timeout + _STOP_SLACK_S)
        except TimeoutError:   # the host does not answer: it is as good as lost
            self.exited(self.pid, LOST_EXIT_CODE)

    def exited(self, pid: int, code: int) -> None:
        if self._exited is None or self._exited.done():
            return
        self.pid = pid or self.pid
        self._exited.set_result(code)
        self.host.procs.pop(self.worker_id, None)
        r = self.on_exit(self, code)
        if asyncio.iscoroutine(r):
            asyncio.get_running_loop().create_task(r)


class RemoteHost:
    def __init__(self, identity: bytes, hello: m.HostHello, send: Callable[[bytes, Any], bool],
                 worker_args: list[str]) -> None:
        self.identity = identity
        self.name = hello.name
        self.gpus = set(hello.gpus)
        self.cpu = hello.cpu
        self.shm_domain = hello.shm_domain
        self.worker_args = worker_args
        self._send = send
        self.seen = time.monotonic()
        self.procs: dict[str, RemoteProcess] = {}
        self.instances = 0

    def fits(self, inst: Instance) -> bool:
        return inst.device_id in self.gpus if inst.kind == "KIND_GPU" else self.cpu

    def describe(self) -> str:
        what = [f"GPU {','.join(map(str, sorted(self.gpus)))}"] if self.gpus else []
        return f"{self.name} ({', '.join(what + (['CPU'] if self.cpu else [])) or 'nothing'})"

    def send(self, msg: Any) -> bool:
        return self._send(self.identity, msg)

    def process(self, inst: Instance, on_exit: OnExit) -> RemoteProcess:
        return RemoteProcess(self, inst, on_exit)

    def lost(self) -> None:
        for proc in list(self.procs.values()):
            proc.exited(proc.pid, LOST_EXIT_CODE)


class Hosts:
    """Every host the scheduler can place instances on, and who waits for one."""

    def __init__(self, local: LocalHost | None, send: Callable[[bytes, Any], bool],
                 worker_args: list[str]) -> None:
        self.local = local
        self.remote: dict[bytes, RemoteHost] = {}
        self._send = send
        self._worker_args = worker_args
        self._changed = asyncio.Event()
        self._watch: asyncio.Task | None = None
        self.on_change: Callable[[], None] = lambda: None

    def all(self) -> list[LocalHost | RemoteHost]:
        return ([self.local] if self.local is not None else []) + list(self.remote.values())

    def start(self) -> None:
        self._watch = asyncio.get_running_loop().create_task(self._expire())

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        self.on_change()

    # ---------------------------------------------------------------- messages from hosts
    # (each is an entry of the worker socket's table: worker_side.py)
    def on_heartbeat(self, identity: bytes, msg: m.HostHeartbeat) -> None:
        host = self.remote.get(identity)
        if host is not None:
            host.seen = time.monotonic()
        else:   # we restarted, or declared it lost: it must introduce itself again
            self._send(identity, m.StopWorker("", kill=True))

    def on_hello(self, identity: bytes, msg: m.HostHello) -> None:
        old = self.remote.pop(identity, None)
        if old is not None:   # it reconnected: whatever it ran is gone
            old.lost()
        host = self.remote[identity] = RemoteHost(identity, msg, self._send, self._worker_args)
        log.info("worker host %s joined", host.describe())
        self._send(identity, logsettings.changed())
        self._wake()

    def on_worker_exited(self, identity: bytes, msg: m.WorkerExited) -> None:
        host = self.remote.get(identity)
        proc = host.procs.get(msg.worker_id) if host is not None else None
        if proc is not None:
            proc.exited(msg.pid, msg.code)

    def peer_lost(self, identity: bytes) -> None:
        """A connection to the worker socket closed: a host's means the host is gone."""
        host = self.remote.get(identity)
        if host is not None:
            self._lose(host, "its connection closed")

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(m.HOST_HEARTBEAT_S)
            now = time.monotonic()
            for host in list(self.remote.values()):
                if now - host.seen > m.HOST_TIMEOUT_S:
                    self._lose(host, f"it sent no heartbeat for {now - host.seen:.1f} s")

    def _lose(self, host: RemoteHost, why: str) -> None:
        log.error("worker host %s is lost (%s), with its %d worker(s)", host.name, why,
                  len(host.procs))
        if self.remote.get(host.identity) is host:
            del self.remote[host.identity]
        host.lost()
        self._wake()

    # ---------------------------------------------------------------- placement
    def place(self, inst: Instance) -> LocalHost | RemoteHost:
        fit = [h for h in self.all() if h.fits(inst)]
        if not fit:
            raise NoWorkerHost(inst, [h.describe() for h in self.all()])
        return min(fit, key=lambda h: h.instances)

    def any_host(self) -> bool:
        return bool(self.all())

    async def wait(self, ready: Callable[[], bool]) -> None:
        """Until ``ready()`` holds: checked each time a host joins or is lost."""
        while not ready():
            await self._changed.wait()
