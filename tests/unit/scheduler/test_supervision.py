"""services.scheduler.lifecycle.ModelManager when an instance's worker exits on its own: what
the worker held fails, the instance restarts, and a version left with no instance becomes
UNAVAILABLE, its queued requests failed at once. Fake workers (spawn returns the config, or
fails once asked to), a real repository and real VersionQueues; no process, no socket, no
sleep (the restart backoff is 0)."""

from __future__ import annotations

import asyncio

from protos import model_config_pb2 as mc
from services.common import messages as m
from services.common.errors import Code, TriremeError
from services.common.states import ModelState
from services.scheduler.batcher import BatcherConfig
from services.scheduler.dispatch import Pending, VersionQueue
from services.scheduler.lifecycle import ModelManager

CONFIG = '''backend: "python"
max_batch_size: 0
input [{{ name: "IN", data_type: TYPE_FP32, dims: [2] }}]
output [{{ name: "OUT", data_type: TYPE_FP32, dims: [2] }}]
instance_group [{{ kind: KIND_CPU, count: {count} }}]
'''
NOT_READY = "'m' version 1 is not at ready state"
EXITED = ("model instance '{}' of model 'm' exited unexpectedly (exit code -9); "
          "the request was not completed")


class Workers:
    """A ModelManager whose workers are fakes; records batches sent, failures, changes."""

    def __init__(self, root, count: int) -> None:
        (root / "m" / "1").mkdir(parents=True)
        (root / "m" / "1" / "model.py").write_text("")
        (root / "m" / "config.pbtxt").write_text(CONFIG.format(count=count))
        self.sent: list[tuple[str, list[int]]] = []      # (worker id, req ids)
        self.failed: list[tuple[int, int, str]] = []     # (req id, code, message)
        self.changes: list[list[str]] = []
        self.refuse: str | None = None                   # spawning fails with this text
        self.mm = ModelManager([root], spawn_instance=self._spawn, stop_instance=self._stop,
                               make_queue=self._queue, changed=self.changes.append,
                               restart_backoff_s=0)
        self._ids = 0

    async def _spawn(self, inst, blob, model_dir, autocomplete):
        if self.refuse is not None:
            raise TriremeError(Code.INTERNAL, self.refuse)
        inst.loaded = True
        return mc.ModelConfig.FromString(blob)

    async def _stop(self, inst) -> None:
        pass

    def _queue(self, model, version, cfg):
        return VersionQueue(model, version, BatcherConfig.from_model_config(cfg), self._send,
                            self._fail, lambda *a: None)

    def _send(self, inst, batch: m.ExecuteBatch, frames) -> None:
        self.sent.append((inst.worker_id, [i.req_id for i in batch.items]))

    def _fail(self, p: Pending, code: int, message: str, reason: str) -> None:
        self.failed.append((p.req.req_id, int(code), message))

    def infer(self) -> int:
        self._ids += 1
        req = m.InferRequest(self._ids, "tcp://reply", "m", 1, [])
        self.mm.models["m"].versions[1].queue.enqueue(Pending(b"f", req, []))
        return self._ids

    def state(self) -> tuple[str, str, str]:
        e, = self.mm.index(False)
        return e.version, e.state, e.reason


def run(tmp_path, count: int, refuse: str | None):
    """Load 'm', keep every instance busy, queue one more request, kill the first instance."""
    w = Workers(tmp_path, count)

    async def go():
        await w.mm.load("m")
        busy = [w.infer() for _ in range(count)]
        waiting = w.infer()
        entry = w.mm.models["m"]
        dead = entry.instances[0]
        w.changes.clear()
        w.refuse = refuse
        await w.mm.instance_exited(dead, -9)
        return entry, dead, busy, waiting

    return w, *asyncio.run(go())


def test_failed_restart_of_the_last_instance_makes_the_version_unavailable(tmp_path):
    w, entry, dead, busy, waiting = run(tmp_path, 1, refuse="no worker today")
    assert w.failed == [(busy[0], Code.INTERNAL, EXITED.format(dead.name)),
                        (waiting, Code.UNAVAILABLE, NOT_READY)]
    assert w.state() == ("1", ModelState.UNAVAILABLE, "no worker today")
    assert entry.instances == [] and entry.ready_version(1) is None
    assert w.mm.info("m").versions == {1: ModelState.UNAVAILABLE}
    assert w.changes == [["m"]]


def test_failed_restart_with_instances_left_keeps_the_version_ready(tmp_path):
    w, entry, dead, busy, waiting = run(tmp_path, 2, refuse="no worker today")
    assert w.failed == [(busy[0], Code.INTERNAL, EXITED.format(dead.name))]
    assert waiting not in {r for r, *_ in w.failed} and len(entry.versions[1].queue.batcher) == 1
    assert w.state() == ("1", ModelState.READY, "")
    assert dead not in entry.instances and len(entry.instances) == 1
    assert w.changes == []


def test_restarted_instance_serves_what_waited(tmp_path):
    w, entry, dead, busy, waiting = run(tmp_path, 1, refuse=None)
    assert w.failed == [(busy[0], Code.INTERNAL, EXITED.format(dead.name))]
    assert w.sent[-1] == (dead.worker_id, [waiting])
    assert w.state() == ("1", ModelState.READY, "")
    assert entry.instances == [dead] and dead.loaded


def test_no_restart_once_shutting_down(tmp_path):
    """Shutdown stops every worker; one still executing when its grace (here 0) ends is
    killed and what it held fails, UNAVAILABLE, naming the exit timeout; an exit seen then
    fails nothing more and restarts nothing."""
    w = Workers(tmp_path, 1)

    async def go():
        await w.mm.load("m")
        busy = w.infer()
        dead = w.mm.models["m"].instances[0]
        w.changes.clear()
        await w.mm.shutdown()
        await w.mm.instance_exited(dead, -9)
        return busy, dead

    busy, dead = asyncio.run(go())
    assert w.failed == [(busy, Code.UNAVAILABLE, (
        f"model instance '{dead.name}' of model 'm' was still executing when the exit timeout "
        "of 0 s ended and was stopped: the server is shutting down"))]
    assert w.changes == [] and len(w.sent) == 1
