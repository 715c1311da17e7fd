"""Child processes behind a thin handle: spawn, signal, wait. The scheduler's state machines
hold handles, never Popen objects, so the OS calls stay in one place."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable

from services.common import shm
from services.common.procutil import TERM_GRACE_S

log = logging.getLogger("trireme.supervisor")


class ProcessHandle:
    """One child process running ``python -m <module> <args>``."""

    def __init__(self, name: str, module: str, args: list[str],
                 on_exit: Callable[[ProcessHandle, int], Awaitable[None] | None] | None = None,
                 env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = ()) -> None:
        self.name = name
        self.module = module
        self.args = args
        self.on_exit = on_exit
        self.pass_fds = pass_fds          # descriptors the child inherits (listening sockets)
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None
        self.stopping = False
        self._waiter: asyncio.Task | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    async def start(self) -> None:
        env = dict(os.environ)
        if self.env:
            env.update(self.env)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", self.module, *self.args, "--parent-pid", str(os.getpid()),
            env=env, stdin=asyncio.subprocess.DEVNULL, pass_fds=self.pass_fds)
        self._waiter = asyncio.get_running_loop().create_task(self._wait())

    async def _wait(self) -> None:
        assert self.proc is not None
        code = await self.proc.wait()
        # Whatever the child left in /dev/shm dies with it.
        for seg in shm.unlink_segments_of(self.proc.pid):
            log.info("unlinked %s left by %s", seg, self.name)
        if not self.stopping:
            (log.warning if code else log.info)("%s (pid %d) exited with code %s",
                                                self.name, self.proc.pid, code)
        if self.on_exit is not None:
            r = self.on_exit(self, code)
            if asyncio.iscoroutine(r):
                await r

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.alive():
            assert self.proc is not None    # alive() says so
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL now: for a child that cannot be asked (it hangs in its work). Its exit
        reaches ``on_exit`` as any other; stop() after it waits for the reaping."""
        self.signal(signal.SIGKILL)

    async def stop(self, timeout: float = TERM_GRACE_S) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; returns once the child is reaped."""
        if self.stopping and self._waiter is not None:   # a stop is already under way
            await asyncio.shield(self._waiter)
            return
        self.stopping = True
        if not self.alive():
            if self._waiter:
                await self._waiter
            return
        assert self._waiter is not None     # start() sets it along with proc
        self.signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(self._waiter), timeout)
        except TimeoutError:
            self.kill()
            await asyncio.shield(self._waiter)
