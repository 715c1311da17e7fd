"""The execution watchdog (services/scheduler/watchdog.py) and what the ModelManager does
with what it catches, the bounded unload and the bounded shutdown (lifecycle.py).

The Watchdog and the VersionQueues share an injected clock and a fake call_later: a sweep
is a plain call, "time passes" is an assignment. The ModelManager tests use fake workers
(spawn returns the config; a fake process handle records kill()) and real VersionQueues,
as test_supervision.py does; no process, no socket."""

from __future__ import annotations

import asyncio

import pytest

from protos import model_config_pb2 as mc
from services.common import messages as m
from services.common.errors import Code, TriremeError
from services.common.states import ModelState
from services.scheduler.batcher import BatcherConfig
from services.scheduler.dispatch import Instance, Pending, VersionQueue
from services.scheduler.lifecycle import ModelManager
from services.scheduler.watchdog import MAX_PERIOD_S, Watchdog, execution_limit, execution_timeout_text
from tests.unit.scheduler.test_version_queue import Clock
from tests.unit.scheduler.test_version_queue import Timer as QueueTimer

S = 1_000_000_000   # ns


class Timer(QueueTimer):
    def fire(self) -> None:   # as the loop does: a timer that ran is no longer armed
        self.cancelled = True
        self.callback()


class Timers(list):
    def __call__(self, delay: float, callback) -> Timer:
        t = Timer(delay, callback)
        self.append(t)
        return t

    def armed(self) -> list[Timer]:
        return [t for t in self if not t.cancelled]


# ------------------------------------------------------------------ the watchdog alone
class Harness:
    """A VersionQueue (no batching) with fake instances and a Watchdog on the same clock."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.timers = Timers()
        self.failed: list[tuple[int, int, str]] = []
        self.sent: list[tuple[str, int]] = []
        self.q = VersionQueue("m", 1, BatcherConfig(), self._send, self._fail, Timers(),
                              clock=self.clock)
        self.caught: list[tuple[VersionQueue, Instance, float]] = []
        self.wd = Watchdog(lambda q, i, s: self.caught.append((q, i, s)), self.timers, self.clock)
        self._ids = 0

    def _send(self, inst, batch: m.ExecuteBatch, frames) -> None:
        self.sent.append((inst.worker_id, batch.batch_id))

    def _fail(self, p: Pending, code: int, message: str, reason: str) -> None:
        self.failed.append((p.req.req_id, int(code), message))

    def instance(self, n: int) -> Instance:
        inst = Instance(f"w{n}", f"m_0_{n}", "m", 1, "KIND_CPU")
        self.q.add_instance(inst)
        return inst

    def infer(self) -> int:
        self._ids += 1
        req = m.InferRequest(self._ids, "tcp://reply", "m", 1, [])
        self.q.enqueue(Pending(b"f", req, [], arrival_ns=self.clock.now))
        return self._ids


def test_off_watches_nothing_and_arms_no_timer():
    h = Harness()
    h.instance(0)
    h.wd.watch(h.q, 0)
    h.infer()
    h.clock.now = 3600 * S
    assert h.wd.watched == {} and h.timers == []
    assert h.wd.sweep() == [] and h.caught == []


def test_sweep_catches_only_an_execution_past_its_limit():
    h = Harness()
    i0, _, i2 = h.instance(0), h.instance(1), h.instance(2)
    h.wd.watch(h.q, 2.0)
    h.infer()                                   # on i0 at t = 0
    h.clock.now = 1 * S
    h.infer()                                   # on i1 at t = 1 s; i2 stays idle
    assert [w for w, _ in h.sent] == ["w0", "w1"]
    h.clock.now = 2 * S - 1
    assert h.wd.sweep() == []
    h.clock.now = 2 * S                         # i0 has run exactly 2 s
    assert h.wd.sweep() == [(i0, 2.0)]
    assert h.caught == [(h.q, i0, 2.0)]
    assert i2.inflight == {}


def test_a_finished_batch_restarts_the_count():
    h = Harness()
    i0 = h.instance(0)
    h.wd.watch(h.q, 2.0)
    h.infer()
    h.clock.now = int(1.5 * S)
    h.q.batch_done(i0, h.sent[0][1])
    h.infer()                                   # the next batch starts at 1.5 s
    h.clock.now = int(3.4 * S)
    assert h.wd.sweep() == []
    h.clock.now = int(3.5 * S)
    assert h.wd.sweep() == [(i0, 2.0)]


def test_the_sweep_period_follows_the_smallest_limit_and_stops_with_the_last_watch():
    h = Harness()
    other = VersionQueue("n", 1, BatcherConfig(), h._send, h._fail, Timers(), clock=h.clock)
    h.wd.watch(h.q, 2.0)
    assert h.wd.period_s == MAX_PERIOD_S and [t.delay for t in h.timers.armed()] == [MAX_PERIOD_S]
    h.wd.watch(other, 0.4)
    assert h.wd.period_s == pytest.approx(0.05)
    (armed,) = h.timers.armed()
    assert armed.delay == pytest.approx(0.05)
    armed.fire()                                # a sweep re-arms while something is watched
    (again,) = h.timers.armed()
    assert again is not armed and again.delay == pytest.approx(0.05)
    h.wd.unwatch(other)
    assert h.wd.period_s == MAX_PERIOD_S and h.timers.armed() == [again]
    h.wd.unwatch(h.q)
    assert h.timers.armed() == []


def test_the_timer_sweeps():
    h = Harness()
    i0 = h.instance(0)
    h.wd.watch(h.q, 1.0)
    h.infer()
    h.clock.now = 1 * S
    h.timers.armed()[0].fire()
    assert h.caught == [(h.q, i0, 1.0)]


def test_hot_path_does_not_touch_the_watchdog():
    """Arrivals and dispatches cost the watchdog nothing: it reads the dispatch time the
    queue records anyway, at its own pace."""
    h = Harness()
    i0 = h.instance(0)
    h.wd.watch(h.q, 1.0)
    before = list(h.timers)
    for _ in range(50):
        h.infer()
        h.q.batch_done(i0, h.sent[-1][1])
    assert h.timers == before and h.caught == []


def _cfg(param: str | None) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name="m")
    if param is not None:
        cfg.parameters["execution_timeout_secs"].string_value = param
    return cfg


@pytest.mark.parametrize(("param", "server", "limit"), [
    (None, 0.0, 0.0), (None, 2.0, 2.0), ("1.5", 0.0, 1.5), ("0", 2.0, 0.0), (" 3 ", 2.0, 3.0)])
def test_execution_limit_the_parameter_overrides_the_flag(param, server, limit):
    assert execution_limit(_cfg(param), server) == limit


@pytest.mark.parametrize("bad", ["", "soon", "-1", "nan", "inf"])
def test_execution_limit_refuses_what_is_not_seconds(bad):
    with pytest.raises(TriremeError) as ei:
        execution_limit(_cfg(bad), 0.0)
    assert ei.value.code == Code.INVALID_ARG
    assert ei.value.message == (f"model 'm': parameter 'execution_timeout_secs' must be a number "
                                f"of seconds >= 0 (0: no limit), got '{bad}'")


# ------------------------------------------------------------------ with the ModelManager
CONFIG = '''backend: "python"
max_batch_size: 0
input [{{ name: "IN", data_type: TYPE_FP32, dims: [2] }}]
output [{{ name: "OUT", data_type: TYPE_FP32, dims: [2] }}]
instance_group [{{ kind: KIND_CPU, count: {count} }}]
{extra}'''
NOT_READY = "'m' version 1 is not at ready state"


class Handle:
    def __init__(self) -> None:
        self.killed = False

    def kill(self) -> None:
        self.killed = True


class Workers:
    """A ModelManager on fake workers, the fake clock and fake timers."""

    def __init__(self, root, count: int = 1, param: str | None = None, flag: float = 2.0,
                 unload_timeout_s: float = 30.0) -> None:
        extra = ("" if param is None else
                 f'parameters {{ key: "execution_timeout_secs" value {{ string_value: "{param}" }} }}\n')
        (root / "m" / "1").mkdir(parents=True)
        (root / "m" / "1" / "model.py").write_text("")
        (root / "m" / "config.pbtxt").write_text(CONFIG.format(count=count, extra=extra))
        self.clock = Clock()
        self.timers = Timers()
        self.sent: list[tuple[str, list[int]]] = []
        self.failed: list[tuple[int, int, str]] = []
        self.changes: list[list[str]] = []
        self.stopped: list[str] = []
        self.refuse: str | None = None
        self.mm = ModelManager([root], spawn_instance=self._spawn, stop_instance=self._stop,
                               make_queue=self._queue, changed=self.changes.append,
                               restart_backoff_s=0, execution_timeout_s=flag,
                               unload_timeout_s=unload_timeout_s, call_later=self.timers,
                               clock=self.clock)
        self._ids = 0

    async def _spawn(self, inst, blob, model_dir, autocomplete):
        if self.refuse is not None:
            raise TriremeError(Code.INTERNAL, self.refuse)
        inst.loaded = True
        inst.handle = Handle()
        return mc.ModelConfig.FromString(blob)

    async def _stop(self, inst) -> None:
        self.stopped.append(inst.worker_id)

    def _queue(self, model, version, cfg):
        return VersionQueue(model, version, BatcherConfig.from_model_config(cfg), self._send,
                            self._fail, Timers(), clock=self.clock)

    def _send(self, inst, batch: m.ExecuteBatch, frames) -> None:
        self.sent.append((inst.worker_id, [i.req_id for i in batch.items]))

    def _fail(self, p: Pending, code: int, message: str, reason: str) -> None:
        self.failed.append((p.req.req_id, int(code), message))

    @property
    def vs(self):
        return self.mm.models["m"].versions[1]

    def infer(self) -> int:
        self._ids += 1
        req = m.InferRequest(self._ids, "tcp://reply", "m", 1, [])
        self.vs.queue.enqueue(Pending(b"f", req, []))
        return self._ids


def test_load_watches_with_the_models_limit(tmp_path):
    w = Workers(tmp_path, param="0.5")
    asyncio.run(w.mm.load("m"))
    assert w.mm.watchdog.watched == {w.vs.queue: 0.5}


def test_load_with_the_watchdog_off_watches_nothing(tmp_path):
    w = Workers(tmp_path, flag=0.0)
    asyncio.run(w.mm.load("m"))
    assert w.mm.watchdog.watched == {} and w.timers == []


def test_invalid_parameter_fails_the_load(tmp_path):
    w = Workers(tmp_path, param="soon")

    async def go():
        with pytest.raises(TriremeError) as ei:
            await w.mm.load("m")
        return ei.value
    err = asyncio.run(go())
    assert err.code == Code.INVALID_ARG and "'execution_timeout_secs'" in err.message
    (e,) = w.mm.index(False)
    assert e.state == ModelState.UNAVAILABLE and w.stopped   # its first worker was stopped


def test_caught_instance_is_killed_its_request_fails_and_it_restarts(tmp_path):
    w = Workers(tmp_path)

    async def go():
        await w.mm.load("m")
        inst = w.mm.models["m"].instances[0]
        hung = w.infer()
        waiting = w.infer()                     # queued behind it: waits for the restart
        w.changes.clear()
        w.clock.now = 2 * S
        assert w.mm.watchdog.sweep() == [(inst, 2.0)]
        text = execution_timeout_text(inst, 2.0)
        assert text == ("model instance 'm_0_0' of model 'm' exceeded the execution timeout "
                        "of 2 s and was restarted")
        assert inst.handle.killed and not inst.loaded
        assert w.failed == [(hung, Code.UNAVAILABLE, text)]
        # no live instance: not ready (LOADING, saying why), told to the frontends
        assert (w.vs.state, w.vs.reason) == (ModelState.LOADING, text)
        assert w.mm.models["m"].ready_version(1) is None and w.changes == [["m"]]
        assert w.mm.info("m").versions == {1: ModelState.LOADING}
        assert w.mm.watchdog.sweep() == []      # caught once
        await w.mm.instance_exited(inst, -9)    # the SIGKILL's exit: the restart path
        assert (w.vs.state, w.vs.reason) == (ModelState.READY, "")
        assert w.changes == [["m"], ["m"]]
        assert w.sent[-1] == (inst.worker_id, [waiting])
        assert w.failed == [(hung, Code.UNAVAILABLE, text)]   # nothing failed twice
        assert w.mm.watchdog.watched == {w.vs.queue: 2.0}     # still watched
    asyncio.run(go())


def test_with_another_instance_live_the_version_stays_ready(tmp_path):
    w = Workers(tmp_path, count=2)

    async def go():
        await w.mm.load("m")
        a, b = w.mm.models["m"].instances
        w.infer()
        w.clock.now = 1 * S
        w.infer()
        w.changes.clear()
        w.clock.now = 2 * S
        assert w.mm.watchdog.sweep() == [(a, 2.0)]
        assert w.vs.state == ModelState.READY and w.changes == []
        assert a.handle.killed and not b.handle.killed
    asyncio.run(go())


def test_failed_restart_after_a_catch_makes_the_version_unavailable(tmp_path):
    w = Workers(tmp_path)

    async def go():
        await w.mm.load("m")
        inst = w.mm.models["m"].instances[0]
        w.infer()
        waiting = w.infer()
        w.clock.now = 3 * S
        w.mm.watchdog.sweep()
        w.refuse = "no worker today"
        await w.mm.instance_exited(inst, -9)
        assert (w.vs.state, w.vs.reason) == (ModelState.UNAVAILABLE, "no worker today")
        assert w.failed[-1] == (waiting, Code.UNAVAILABLE, NOT_READY)
    asyncio.run(go())


def test_unload_kills_what_still_executes_at_its_timeout(tmp_path):
    w = Workers(tmp_path, count=2, flag=0.0, unload_timeout_s=0.05)

    async def go():
        await w.mm.load("m")
        busy, idle = w.mm.models["m"].instances
        hung = w.infer()
        await w.mm.unload("m")
        assert busy.handle.killed and not idle.handle.killed
        assert w.failed == [(hung, Code.UNAVAILABLE, (
            "model instance 'm_0_0' of model 'm' was still executing when the unload timeout "
            "of 0.05 s ended and was stopped"))]
        assert sorted(w.stopped) == sorted([busy.worker_id, idle.worker_id])
        assert busy.retired and idle.retired
        await w.mm.instance_exited(busy, -9)    # the kill's exit: no restart
        assert w.mm.index(False)[0].state == ModelState.UNAVAILABLE
        assert w.sent == [(busy.worker_id, [hung])]
    asyncio.run(go())


def test_unload_waits_for_a_batch_that_finishes_in_time(tmp_path):
    w = Workers(tmp_path, flag=0.0, unload_timeout_s=30.0)

    async def go():
        await w.mm.load("m")
        inst = w.mm.models["m"].instances[0]
        w.infer()
        batch_id = next(iter(inst.inflight))
        asyncio.get_running_loop().call_later(0.01, w.vs.queue.batch_done, inst, batch_id)
        await asyncio.wait_for(w.mm.unload("m"), 5)
        assert not inst.handle.killed and w.failed == []
    asyncio.run(go())


def test_shutdown_grace_lets_work_finish(tmp_path):
    w = Workers(tmp_path, flag=0.0)

    async def go():
        await w.mm.load("m")
        inst = w.mm.models["m"].instances[0]
        w.infer()
        queued = w.infer()
        loop = asyncio.get_running_loop()

        def done():   # each batch finishes a moment after it started
            if inst.inflight:
                w.vs.queue.batch_done(inst, next(iter(inst.inflight)))
                loop.call_later(0.01, done)
        loop.call_later(0.01, done)
        await asyncio.wait_for(w.mm.shutdown(30.0), 5)
        assert not inst.handle.killed and w.failed == []
        assert w.sent[-1] == (inst.worker_id, [queued])
    asyncio.run(go())


def test_shutdown_waits_for_the_frontends_within_its_grace(tmp_path):
    w = Workers(tmp_path, flag=0.0)

    async def go():
        await w.mm.load("m")
        loop = asyncio.get_running_loop()
        fronts = loop.create_future()
        loop.call_later(0.05, fronts.set_result, None)
        t0 = loop.time()
        await asyncio.wait_for(w.mm.shutdown(30.0, fronts), 5)
        assert fronts.done() and loop.time() - t0 < 5
        never = loop.create_future()          # frontends that never end: the grace does
        w2 = Workers(tmp_path / "other", flag=0.0)
        await w2.mm.load("m")
        t0 = loop.time()
        await w2.mm.shutdown(0.1, never)
        assert 0.1 <= loop.time() - t0 < 2
    asyncio.run(go())


def test_caught_while_unloading_no_restart_no_state_change(tmp_path):
    w = Workers(tmp_path, unload_timeout_s=30.0)

    async def go():
        await w.mm.load("m")
        inst = w.mm.models["m"].instances[0]
        hung = w.infer()
        unloading = asyncio.ensure_future(w.mm.unload("m"))
        await asyncio.sleep(0)                  # the unload is waiting for the batch
        w.changes.clear()
        w.clock.now = 5 * S
        w.mm.watchdog.sweep()
        assert inst.handle.killed
        assert w.failed == [(hung, Code.UNAVAILABLE, execution_timeout_text(inst, 2.0))]
        await asyncio.wait_for(unloading, 5)  # nothing in flight any more: it ends at once
        await w.mm.instance_exited(inst, -9)
        assert w.mm.index(False)[0].state == ModelState.UNAVAILABLE
        assert w.changes == [["m"]]             # the unload's, not a LOADING one
    asyncio.run(go())
