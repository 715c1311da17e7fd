"""services.scheduler.dispatch.VersionQueue, driven by a fake clock, a fake call_later and
list-recording callbacks: no event loop, no sleeping (the batcher itself: test_batcher.py)."""

from __future__ import annotations

import pytest

from services.common import messages as m
from services.common.errors import Code, TriremeError
from services.scheduler.batcher import QUEUE_FULL, TIMEOUT_EXPIRED, BatcherConfig, QueuePolicy
from services.scheduler.dispatch import Instance, Pending, VersionQueue, log_request
from services.scheduler.stats import VersionStats

US = 1_000
MS = 1_000_000
LONG = 10_000 * MS          # a queue delay no test reaches by accident


def dyn(**kw) -> BatcherConfig:
    kw.setdefault("max_batch_size", 8)
    return BatcherConfig(dynamic=True, **kw)


class Clock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


class Timer:
    def __init__(self, delay: float, callback) -> None:
        self.delay, self.callback, self.cancelled = delay, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class Harness:
    """A VersionQueue with fake instances, clock and timers; records what it sends."""

    def __init__(self, config: BatcherConfig, limiter=None, model: str = "m", stats=None) -> None:
        self.clock = Clock()
        self.sent: list[tuple[Instance, m.ExecuteBatch, list]] = []
        self.failed: list[tuple[Pending, int, str, str]] = []
        self.timers: list[Timer] = []
        self.q = VersionQueue(model, 1, config, self.send, self.fail, self.call_later,
                              limiter=limiter, clock=self.clock, stats=stats)
        self._req = 0

    def send(self, inst, msg, frames) -> None:
        self.sent.append((inst, msg, frames))

    def fail(self, p, code, message, reason) -> None:
        self.failed.append((p, code, message, reason))

    def call_later(self, delay: float, callback) -> Timer:
        t = Timer(delay, callback)
        self.timers.append(t)
        return t

    def instance(self, n: int = 0, kind: str = "KIND_CPU", device: int = 0,
                 config=None) -> Instance:
        return Instance(f"{self.q.model}-w{n}", f"{self.q.model}_0_{n}", self.q.model, 1, kind,
                        device_id=device, config=config)

    def request(self, frontend: bytes = b"f1", batch_size: int = 1, frames: int = 0,
                **params) -> Pending:
        self._req += 1
        inputs = [m.TensorRef("x", "FP32", [batch_size, 3], 12 * batch_size,
                              frame=0 if frames else -1)]
        req = m.InferRequest(self._req, "tcp://reply", self.q.model, 1, inputs,
                             parameters=params, batch_size=batch_size)
        return Pending(frontend, req, [b"\0" * 12] * frames, arrival_ns=self.clock.now)

    def enqueue(self, *a, **kw) -> Pending:
        p = self.request(*a, **kw)
        self.q.enqueue(p)
        return p

    def batches(self) -> list[list[int]]:
        return [[it.req_id for it in msg.items] for _, msg, _ in self.sent]


def test_preserve_ordering_numbers_each_frontends_requests_on_one_stream():
    h = Harness(dyn(max_batch_size=3, max_queue_delay_ns=0, preserve_ordering=True))
    other = Harness(dyn(max_batch_size=3, max_queue_delay_ns=0, preserve_ordering=True))
    ps = [h.enqueue(f) for f in (b"f1", b"f2", b"f1", b"f1", b"f2")]
    i0 = h.instance(0)
    h.q.add_instance(i0)
    (_, first, _), = h.sent
    h.q.batch_done(i0, first.batch_id)
    assert h.batches() == [[1, 2, 3], [4, 5]]
    stream = ps[0].stream
    assert stream > 0 and all(p.stream == stream for p in ps)
    assert [(p.frontend, p.order) for p in ps] == [
        (b"f1", 1), (b"f2", 1), (b"f1", 2), (b"f1", 3), (b"f2", 2)]
    items = [it for _, msg, _ in h.sent for it in msg.items]
    assert [(it.stream, it.order) for it in items] == [(stream, 1), (stream, 1), (stream, 2),
                                                       (stream, 3), (stream, 2)]
    assert other.q._stream not in (0, stream)     # each version queue has its own stream


def test_without_preserve_ordering_no_stream():
    h = Harness(dyn(max_queue_delay_ns=0))
    h.q.add_instance(h.instance())
    p = h.enqueue()
    assert (p.stream, p.order) == (0, 0)
    assert (h.sent[0][1].items[0].stream, h.sent[0][1].items[0].order) == (0, 0)


def test_timer_is_armed_with_the_batchers_wait_and_firing_dispatches():
    h = Harness(dyn(preferred=(4,), max_queue_delay_ns=1 * MS))
    i0 = h.instance()
    h.q.add_instance(i0)
    assert h.timers == []                         # nothing queued: no timer
    h.clock.now = 10 * US
    h.enqueue()
    assert h.sent == [] and len(h.timers) == 1
    assert h.timers[0].delay == pytest.approx(1e-3)
    h.clock.now = 510 * US
    h.enqueue()                                   # re-armed for the rest of the delay
    assert h.timers[0].cancelled and not h.timers[1].cancelled
    assert h.timers[1].delay == pytest.approx(500e-6)
    h.clock.now = 1010 * US
    h.timers[1].callback()
    assert h.batches() == [[1, 2]]
    (inst, msg, _), = h.sent
    assert inst is i0 and list(i0.inflight) == [msg.batch_id]
    assert all(p.dispatch_ns == 1010 * US for p in i0.inflight[msg.batch_id])
    assert i0 not in h.q.idle


def test_two_idle_instances_run_two_batches():
    h = Harness(dyn(max_batch_size=2, max_queue_delay_ns=0))
    for _ in range(5):
        h.enqueue()
    i0, i1 = h.instance(0), h.instance(1)
    h.q.add_instance(i0)
    h.q.add_instance(i1)
    assert h.batches() == [[1, 2], [3, 4]]
    assert [s[0] for s in h.sent] == [i0, i1]
    assert h.q.idle == [] and len(h.q.batcher) == 1
    assert h.q.busy


def test_batch_done_returns_the_instance_and_pumps():
    h = Harness(dyn(max_batch_size=2, max_queue_delay_ns=0))
    i0 = h.instance()
    h.q.add_instance(i0)
    h.enqueue()
    for _ in range(3):
        h.enqueue()                               # i0 is busy: these wait
    assert h.batches() == [[1]]
    h.q.batch_done(i0, h.sent[0][1].batch_id)
    assert h.batches() == [[1], [2, 3]]
    h.q.batch_done(i0, h.sent[1][1].batch_id)
    h.q.batch_done(i0, h.sent[2][1].batch_id)
    assert h.batches() == [[1], [2, 3], [4]]
    assert h.q.idle == [i0] and i0.inflight == {} and not h.q.busy


def test_batch_frames_are_renumbered_per_message():
    h = Harness(dyn(max_batch_size=4, max_queue_delay_ns=0))
    for _ in range(3):
        h.enqueue(frames=1)
    h.q.add_instance(h.instance())
    (_, msg, frames), = h.sent
    assert [it.inputs[0].frame for it in msg.items] == [0, 1, 2]
    assert len(frames) == 3


def test_timed_out_request_fails_with_request_timeout_expired():
    h = Harness(dyn(max_queue_delay_ns=0, policies={1: QueuePolicy(default_timeout_us=100)}))
    i0 = h.instance()
    h.q.add_instance(i0)
    h.enqueue()                                   # runs at once on i0
    late = h.enqueue()                            # waits: i0 is busy
    h.clock.now = 1 * MS
    h.q.batch_done(i0, h.sent[0][1].batch_id)
    assert h.failed == [(late, Code.UNAVAILABLE, TIMEOUT_EXPIRED, "REJECTED")]
    assert h.batches() == [[1]]


def test_queue_full_raises_without_queueing():
    h = Harness(dyn(max_queue_delay_ns=LONG, policies={1: QueuePolicy(max_queue_size=1)}))
    h.enqueue()
    with pytest.raises(TriremeError) as ei:
        h.enqueue()
    assert (ei.value.code, ei.value.message) == (Code.UNAVAILABLE, QUEUE_FULL)
    assert len(h.q.batcher) == 1


def test_priority_and_timeout_come_from_request_parameters():
    h = Harness(dyn(max_batch_size=1, max_queue_delay_ns=0, priority_levels=2,
                    default_priority=2, policies={
                        1: QueuePolicy(default_timeout_us=1000, allow_timeout_override=True),
                        2: QueuePolicy()}))
    h.enqueue(priority=2)
    h.enqueue(priority=1, timeout=10)             # jumps the queue, then times out
    h.enqueue(priority=1)
    h.enqueue(priority=True)                      # not an int: the default level
    h.clock.now = 100 * US
    i0 = h.instance()
    h.q.add_instance(i0)
    assert [p.req.req_id for p, *_ in h.failed] == [2]
    for _ in range(3):
        h.q.batch_done(i0, h.sent[-1][1].batch_id)
    assert h.batches() == [[3], [1], [4]]


def test_worker_died_fails_each_held_request_once():
    h = Harness(dyn(max_batch_size=2, max_queue_delay_ns=0))
    i0, i1 = h.instance(0), h.instance(1)
    held = [h.enqueue(), h.enqueue()]
    h.q.add_instance(i0)
    assert h.batches() == [[1, 2]]
    queued = h.enqueue()                          # i0 busy, no other instance yet
    h.q.worker_died(i0, "instance died")
    assert h.failed == [(p, Code.INTERNAL, "instance died", "OTHER") for p in held]
    assert i0.inflight == {} and i0.worker_id not in h.q.instances and i0 not in h.q.idle
    h.q.worker_died(i0, "again")                  # nothing held any more: nothing failed twice
    h.q.batch_done(i0, h.sent[0][1].batch_id)     # a late BatchDone does not revive it
    assert len(h.failed) == 2 and i0 not in h.q.idle
    h.q.add_instance(i1)                          # the queued request was kept
    assert h.batches() == [[1, 2], [queued.req.req_id]]


def test_fail_queued_cancels_the_timer_and_fails_what_waits():
    h = Harness(dyn(preferred=(4,), max_queue_delay_ns=1 * MS))
    h.q.add_instance(h.instance())
    ps = [h.enqueue(), h.enqueue()]
    h.q.fail_queued(Code.UNAVAILABLE, "gone")
    assert h.timers[-1].cancelled
    assert h.failed == [(p, Code.UNAVAILABLE, "gone", "OTHER") for p in ps]
    assert len(h.q.batcher) == 0 and not h.q.busy


def test_arrival_cost_does_not_grow_when_no_instance_is_idle():
    h = Harness(dyn(preferred=(4,), max_queue_delay_ns=1 * MS))
    calls = 0
    real = h.q.batcher.next_batch

    def counting(now):
        nonlocal calls
        calls += 1
        return real(now)

    h.q.batcher.next_batch = counting
    for _ in range(10_000):                       # no instance at all
        h.enqueue()
    assert calls == 0 and h.timers == []
    i0 = h.instance()
    h.q.add_instance(i0)                          # one batch, then i0 is busy
    assert calls == 1 and h.batches() == [[1, 2, 3, 4]]
    for _ in range(10_000):                       # the only instance is busy
        h.enqueue()
    assert calls == 1
    assert len(h.q.batcher) == 20_000 - 4


# ------------------------------------------------------------------------ shape tensors
def _shape_request(req_id: int, s: m.TensorRef, frames: list) -> Pending:
    """A request with a data input x and a shape tensor s."""
    req = m.InferRequest(req_id, "tcp://reply", "m", 1, [m.TensorRef("x", "FP32", [1, 3], 12), s])
    return Pending(b"f1", req, frames)


def test_shape_tensor_bytes_come_from_the_request_frames():
    h = Harness(dyn(max_queue_delay_ns=LONG, equal_shape_inputs=frozenset({"x", "s"}),
                    shape_tensors=frozenset({"s"})))
    two_three, two_five = b"\2\0\0\0\3\0\0\0", b"\2\0\0\0\5\0\0\0"
    shared = [b"x" * 12, memoryview(two_three)]   # one message's frames: x, then s
    inline = lambda i: m.TensorRef("s", "INT32", [2], 8, frame=i)          # noqa: E731
    in_shm = m.TensorRef("s", "INT32", [2], 8, segment="trireme-1-frontend-0", offset=64)
    for p in [_shape_request(1, in_shm, []),
              _shape_request(2, inline(1), shared),
              _shape_request(3, inline(0), [two_three]),
              _shape_request(4, inline(0), [two_five]),
              _shape_request(5, in_shm, []),
              _shape_request(6, in_shm, [])]:
        h.q.enqueue(p)
    i0 = h.instance()
    h.q.add_instance(i0)
    for _ in range(3):
        h.q.batch_done(i0, h.sent[-1][1].batch_id)
    # Equal values batch (2, 3: frame 1 of one message, frame 0 of another); 4 differs;
    # one in shared memory is batched with nothing.
    assert h.batches() == [[1], [2, 3], [4], [5]]


def test_no_shape_tensors_no_contents_read():
    h = Harness(dyn(max_queue_delay_ns=0, equal_shape_inputs=frozenset({"x"})))
    calls = []
    h.q.batcher.enqueue = lambda *a, **kw: calls.append(kw) or type(h.q.batcher).enqueue(
        h.q.batcher, *a, **kw)
    h.enqueue(frames=1)
    assert calls[0]["contents"] is None and calls[0]["shapes"] == {"x": [1, 3]}


# ------------------------------------------------------------------------ pending count
def test_pending_count_is_what_waits_not_what_runs():
    """Triton's nv_inference_pending_request_count: up when a request is queued, down when
    an instance takes it (not when it finishes), and down for one that leaves the queue."""
    stats = VersionStats()
    h = Harness(dyn(max_batch_size=1, max_queue_delay_ns=0,
                    policies={1: QueuePolicy(default_timeout_us=100)}), stats=stats)
    assert stats.pending == 0
    h.enqueue()
    expiring = h.enqueue()
    late = h.enqueue()
    assert stats.pending == 3                     # no instance yet: all three wait
    i0 = h.instance()
    h.q.add_instance(i0)
    assert h.batches() == [[1]] and stats.pending == 2   # one runs, two wait
    h.q.cancel(b"f1", [late.req.req_id])
    assert stats.pending == 1
    h.clock.now = 1 * MS                          # the other one has timed out
    h.q.batch_done(i0, h.sent[-1][1].batch_id)
    assert stats.pending == 0
    assert h.failed == [(expiring, Code.UNAVAILABLE, TIMEOUT_EXPIRED, "REJECTED")]
    h.enqueue()
    assert stats.pending == 0                     # taken at once by the idle instance


def test_log_request_prefixes_only_a_request_with_an_id():
    assert log_request("", QUEUE_FULL) == QUEUE_FULL
    assert log_request("abc", QUEUE_FULL) == "[request id: abc] " + QUEUE_FULL
