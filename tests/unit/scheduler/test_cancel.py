"""Request cancellation in the scheduler, without processes: the batcher's O(1) cancel and
VersionQueue.cancel (which requests were still queued). The real server, the official
client: tests/e2e/test_cancel.py."""

from __future__ import annotations

import random

import pytest

from services.common.errors import TriremeError
from services.scheduler.batcher import QUEUE_FULL, Batcher, BatcherConfig, QueuePolicy
from tests.unit.scheduler.test_version_queue import LONG, MS, Harness, dyn


def names(b: Batcher, now: int = 0) -> str:
    d = b.next_batch(now)
    return "".join(d.batch)


# ------------------------------------------------------------------------ Batcher.cancel
def test_cancelled_request_leaves_the_batch_and_the_count():
    b = Batcher(dyn(preferred=(2,), max_queue_delay_ns=LONG))
    entries = {n: b.enqueue(n, 0) for n in "abc"}
    assert names(b) == "ab"
    b.enqueue("d", 0)
    assert b.cancel(entries["c"]) == "c"
    assert len(b) == 1
    d = b.next_batch(0)                            # "d" alone waits: "c" is not counted
    assert (d.batch, d.wait_ns) == ([], LONG)
    b.enqueue("e", 0)
    assert names(b) == "de"
    assert len(b) == 0 and b.next_batch(0).wait_ns is None


def test_cancel_in_the_middle_keeps_arrival_order_and_batch_growth():
    b = Batcher(dyn(preferred=(4,), max_queue_delay_ns=LONG))
    entries = [b.enqueue(n, 0) for n in "abcde"]
    b.cancel(entries[1])
    b.cancel(entries[3])
    assert names(b, LONG) == "ace"                 # the delay expired: all that is live


def test_without_dynamic_batching_a_cancelled_request_is_skipped():
    b = Batcher(BatcherConfig(max_batch_size=0))
    first = b.enqueue("a", 0)
    b.enqueue("b", 0)
    b.cancel(first)
    assert names(b) == "b"
    assert len(b) == 0 and names(b) == ""


def test_delay_hook_counts_live_requests_only():
    b = Batcher(dyn(max_queue_delay_ns=0, delay_count=3))
    gone = b.enqueue("a", 0)
    b.enqueue("b", 0)
    b.enqueue("c", 0)
    b.cancel(gone)
    assert names(b) == ""                          # two live: still held
    b.enqueue("d", 0)
    assert names(b) == "bcd"


def test_a_cancel_frees_a_place_in_a_full_queue():
    b = Batcher(dyn(max_queue_delay_ns=LONG, policies={1: QueuePolicy(max_queue_size=2)}))
    gone = b.enqueue("a", 0)
    b.enqueue("b", 0)
    with pytest.raises(TriremeError) as e:
        b.enqueue("c", 0)
    assert e.value.message == QUEUE_FULL
    b.cancel(gone)
    b.enqueue("c", 0)
    assert names(b, LONG) == "bc"


def test_cancelled_request_pushed_back_by_a_delay_policy_is_skipped():
    b = Batcher(dyn(max_batch_size=4, max_queue_delay_ns=LONG, policies={
        1: QueuePolicy(delay_on_timeout=True, default_timeout_us=10)}))
    late = b.enqueue("a", 0)
    assert b.next_batch(20_000).batch == []        # timed out: moved behind on-time requests
    b.enqueue("b", 20_000)
    b.cancel(late)
    assert names(b, 20_000 + LONG) == "b"


def test_drain_returns_live_requests_only():
    b = Batcher(dyn(max_queue_delay_ns=LONG))
    gone = b.enqueue("a", 0)
    b.enqueue("b", 0)
    b.cancel(gone)
    assert b.drain() == ["b"] and len(b) == 0


# ------------------------------------------------------------------- VersionQueue.cancel
def test_queued_requests_are_removed_and_running_ones_reported():
    h = Harness(dyn(max_batch_size=1, max_queue_delay_ns=0))
    i0 = h.instance()
    h.q.add_instance(i0)
    _running, queued, other = h.enqueue(), h.enqueue(), h.enqueue()
    assert h.batches() == [[1]]
    removed, rest = h.q.cancel(b"f1", [1, 2, 99])
    assert removed == [queued] and rest == [1, 99]
    assert h.q.cancel(b"f1", [2]) == ([], [2])     # a second cancel finds nothing
    h.q.batch_done(i0, h.sent[0][1].batch_id)
    assert h.batches() == [[1], [other.req.req_id]]
    assert h.failed == []                          # answering is the scheduler's part


def test_cancel_names_the_frontend_as_well_as_the_id():
    h = Harness(dyn(max_queue_delay_ns=LONG))
    mine = h.enqueue(frontend=b"f1")
    assert h.q.cancel(b"f2", [mine.req.req_id]) == ([], [mine.req.req_id])
    assert h.q.cancel(b"f1", [mine.req.req_id]) == ([mine], [])


def test_dispatched_and_rejected_requests_are_no_longer_cancellable():
    h = Harness(dyn(max_queue_delay_ns=0, policies={1: QueuePolicy(default_timeout_us=100)}))
    i0 = h.instance()
    h.q.add_instance(i0)
    h.enqueue()
    h.enqueue()                                    # waits, then times out
    h.clock.now = 1 * MS
    h.q.batch_done(i0, h.sent[0][1].batch_id)
    assert [r[3] for r in h.failed] == ["REJECTED"]
    assert h.q.cancel(b"f1", [1, 2]) == ([], [1, 2])


def test_cancels_stay_exact_as_the_queue_empties_and_fills_again():
    """The queue's index of waiting requests is built by a cancel and dropped once nothing
    waits; random arrivals, cancels and completions never lose or run a request twice."""
    rng = random.Random(7)
    h = Harness(dyn(max_batch_size=4, max_queue_delay_ns=0,
                    policies={1: QueuePolicy(max_queue_size=50)}))
    i0, i1 = h.instance(0), h.instance(1)
    h.q.add_instance(i0)
    h.q.add_instance(i1)
    sent = set()
    cancelled = set()
    done = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.45:
            try:
                sent.add(h.enqueue().req.req_id)
            except TriremeError:
                pass
        elif op < 0.75 and sent:
            ids = rng.sample(sorted(sent), min(len(sent), rng.randint(1, 3)))
            removed, rest = h.q.cancel(b"f1", ids)
            assert sorted([p.req.req_id for p in removed] + rest) == sorted(ids)
            cancelled.update(p.req.req_id for p in removed)
        else:
            for inst in (i0, i1):
                for batch_id in list(inst.inflight):
                    h.q.batch_done(inst, batch_id)
                    done += 1
    while i0.inflight or i1.inflight:              # run what is left
        inst = i0 if i0.inflight else i1
        h.q.batch_done(inst, next(iter(inst.inflight)))
    ran = [rid for batch in h.batches() for rid in batch]
    assert len(ran) == len(set(ran))                 # nothing ran twice
    assert not set(ran) & cancelled                  # nothing cancelled ran
    assert set(ran) | cancelled == sent              # nothing was lost
    assert len(h.q.batcher) == 0 and cancelled and done
