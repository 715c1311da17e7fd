"""The messages between the scheduler and the worker hosts (`trireme workers`) on its worker
socket: a host offers itself, keeps a heartbeat, and spawns and stops worker processes.
Registered and encoded with every other message by services/common/messages.py, which
re-exports them."""
from __future__ import annotations

from services.common.msgbase import Msg


class HostHello(Msg):
    """A worker host (`trireme workers`) offers itself: the scheduler places instances on it."""
    name: str
    pid: int
    gpus: list[int] = []           # the GPU ids (a config's `gpus: [k]`) it owns
    cpu: bool = True               # it runs KIND_CPU instances too
    shm_domain: str = ""


class HostHeartbeat(Msg):
    """Sent every HOST_HEARTBEAT_S: a host silent for longer than HOST_TIMEOUT_S is lost."""
    name: str


class SpawnWorker(Msg):
    """Start one worker process (python -m services.workers.main) with these arguments, on
    the host's own scheduler address."""
    worker_id: str
    args: list[str]
    env: dict[str, str] = {}
    cuda_device: int = -1          # a KIND_GPU instance's GPU id (the host maps it to CUDA's)


class StopWorker(Msg):
    """SIGTERM, then SIGKILL after ``timeout_s``; ``kill``: SIGKILL now. An empty
    ``worker_id`` is the scheduler saying it does not know the host (it restarted, or gave
    the host up as lost): the host stops every worker and says HostHello again."""
    worker_id: str
    timeout_s: float = 10.0
    kill: bool = False


class WorkerExited(Msg):
    worker_id: str
    pid: int
    code: int


HOST_HEARTBEAT_S = 1.0
HOST_TIMEOUT_S = 3.5
