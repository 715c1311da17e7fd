"""services.scheduler.sequence.SequenceQueue with a fake clock, fake timers and recording
callbacks (test_version_queue.py's harness): Triton's checks and texts, slots and the
backlog, one request per sequence at a time, idle expiry, `oldest` batching."""
from __future__ import annotations

from services.common import messages as m
from services.common.errors import Code
from services.scheduler.batcher import BatcherConfig
from services.scheduler.dispatch import Pending
from services.scheduler.sequence import SequenceConfig, SequenceQueue
from services.scheduler.stats import VersionStats
from tests.unit.scheduler.test_version_queue import MS, Harness

START, END = {"sequence_start": True}, {"sequence_end": True}


class SeqHarness(Harness):
    def __init__(self, seq: SequenceConfig) -> None:
        super().__init__(BatcherConfig(max_batch_size=seq.max_batch))
        self.q = SequenceQueue("m", 1, BatcherConfig(max_batch_size=seq.max_batch), self.send,
                               self.fail, self.call_later, clock=self.clock,
                               stats=VersionStats(), sequence=seq)

    def seq(self, corrid, *flags: dict, **kw) -> Pending:
        params = {"sequence_id": corrid}
        for f in flags:
            params.update(f)
        return self.enqueue(**params, **kw)

    def done(self, i: int = -1) -> None:
        """The batch sent i-th finishes."""
        inst, msg, _ = self.sent[i]
        self.q.batch_done(inst, msg.batch_id)

    def batch(self, i: int = -1) -> list[int | str]:
        return [it.parameters["sequence_id"] for it in self.sent[i][1].items]


def direct(slots: int = 2, **kw) -> SeqHarness:
    h = SeqHarness(SequenceConfig(slots=slots, max_batch=slots, **kw))
    h.q.add_instance(h.instance(0))
    return h


def test_triton_checks_and_texts():
    h = direct()
    h.enqueue()                                      # no sequence_id
    h.seq(0, START)                                  # 0 is "none"
    h.seq("", START)                                 # "" too
    h.seq(7)                                         # no START on a new sequence
    h.seq("abc", END)
    h.seq(8, START, batch_size=2)
    texts = [(code, text) for _, code, text, _ in h.failed]
    no_id = "inference request to model 'm' must specify a non-zero or non-empty correlation ID"
    assert texts == [
        (Code.INVALID_ARG, no_id), (Code.INVALID_ARG, no_id), (Code.INVALID_ARG, no_id),
        (Code.INVALID_ARG, "inference request for sequence 7 to model 'm' must specify the "
                           "START flag on the first request of the sequence"),
        (Code.INVALID_ARG, "inference request for sequence abc to model 'm' must specify the "
                           "START flag on the first request of the sequence"),
        (Code.INVALID_ARG, "inference request to model 'm' must specify batch-size 1 due to "
                           "requirements of sequence batcher")]
    assert h.sent == []


def test_one_request_per_sequence_at_a_time_in_order():
    h = direct()
    a1, a2, a3 = h.seq(1, START), h.seq(1), h.seq(1, END)
    assert h.batch(0) == [1] and h.sent[0][1].items[0].req_id == a1.req.req_id
    assert len(h.sent) == 1                          # a2 waits for a1
    h.done(0)
    assert h.sent[1][1].items[0].req_id == a2.req.req_id
    h.done(1)
    assert h.sent[2][1].items[0].req_id == a3.req.req_id
    h.done(2)
    assert h.q.sequences == {} and h.q.bound["m-w0"] == []


def test_sequences_of_an_instance_batch_together_oldest_first():
    h = direct(slots=4)
    h.seq(1, START)                                  # runs alone: the instance was idle
    h.clock.now += MS
    h.seq(2, START)
    h.seq(3, START)
    h.clock.now += MS
    h.seq(1)
    h.done(0)
    assert h.batch(1) == [2, 3, 1]                   # by their waiting request's arrival


def test_backlog_waits_for_a_slot_and_takes_the_one_freed_by_end():
    h = direct(slots=1)
    h.seq("a", START)
    h.seq("b", START)                                # no slot: backlog
    assert [s.corrid for s in h.q.backlog] == ["b"] and h.batch(0) == ["a"]
    h.done(0)
    assert len(h.sent) == 1                          # a still holds its slot
    h.seq("a", END)
    h.done(1)                                        # a's END ran: b gets the slot
    assert h.batch(2) == ["b"] and not h.q.backlog


def test_idle_sequence_loses_its_slot_and_needs_start_again():
    h = direct(slots=1, idle_ns=100 * MS)
    h.seq(5, START)
    h.done(0)
    h.seq(6, START)                                  # waits in the backlog
    reaper = [t for t in h.timers if not t.cancelled][-1]
    h.clock.now += 100 * MS
    reaper.callback()                                # 5 idle for 100 ms: released
    assert h.batch(1) == [6]
    h.seq(5)                                         # continues a sequence that is gone
    assert h.failed[-1][2].startswith("inference request for sequence 5 to model 'm' must "
                                      "specify the START flag")


def test_a_new_start_with_an_open_id_continues_on_its_slot():
    h = direct(slots=2)
    h.seq(9, START)
    h.done(0)
    h.seq(9, START)                                  # Triton: warns, the new sequence goes on
    assert h.batch(1) == [9] and h.sent[1][0] is h.sent[0][0]


def test_oldest_waits_for_the_queue_delay_unless_preferred_size():
    h = SeqHarness(SequenceConfig(slots=8, max_batch=4, delay_ns=10 * MS,
                                  preferred=frozenset({2})))
    h.q.add_instance(h.instance(0))
    h.seq(1, START)
    assert h.sent == []                              # waits up to 10 ms for company
    h.seq(2, START)                                  # a preferred size: goes now
    assert sorted(h.batch(0)) == [1, 2]
    h.done(0)
    h.seq(3, START)
    h.clock.now += 10 * MS
    [t for t in h.timers if not t.cancelled][-1].callback()
    assert h.batch(1) == [3]


def test_sequences_spread_over_instances_and_die_with_theirs():
    h = direct(slots=1)
    h.q.add_instance(h.instance(1))
    h.seq("x", START)
    h.seq("y", START)
    assert {h.sent[0][0].worker_id, h.sent[1][0].worker_id} == {"m-w0", "m-w1"}
    inst = h.sent[0][0]
    queued = h.seq(h.batch(0)[0])                    # waits behind the running one
    h.q.worker_died(inst, "instance died")
    failed = {(p.req.req_id, text) for p, _, text, _ in h.failed}
    assert (queued.req.req_id, "instance died") in failed
    assert h.batch(0)[0] not in h.q.sequences        # its next request needs a START


def test_cancel_takes_a_queued_request_out_of_its_sequence():
    h = direct()
    h.seq(1, START)
    waiting = h.seq(1)
    removed, rest = h.q.cancel(b"f1", [waiting.req.req_id, 999])
    assert removed == [waiting] and rest == [999]
    assert len(h.q.stats.batcher) == 0


def test_pending_count_and_fail_queued():
    h = direct(slots=1)
    h.seq(1, START)
    h.seq(1)
    h.seq(2, START)
    assert len(h.q.stats.batcher) == 2
    h.q.fail_queued(Code.UNAVAILABLE, "gone")
    assert [t for _, _, t, _ in h.failed] == ["gone", "gone"] and not h.q.sequences


def test_from_model_config():
    from protos import model_config_pb2 as mc
    cfg = mc.ModelConfig(max_batch_size=8)
    cfg.sequence_batching.SetInParent()
    assert SequenceConfig.from_model_config(cfg) == SequenceConfig(slots=8, max_batch=8)
    cfg.sequence_batching.max_sequence_idle_microseconds = 5000
    cfg.sequence_batching.oldest.max_candidate_sequences = 16
    cfg.sequence_batching.oldest.preferred_batch_size.extend([4])
    cfg.sequence_batching.oldest.max_queue_delay_microseconds = 100
    assert SequenceConfig.from_model_config(cfg) == SequenceConfig(
        slots=16, max_batch=8, delay_ns=100_000, preferred=frozenset({4}), idle_ns=5_000_000)
    assert SequenceConfig.from_model_config(mc.ModelConfig(
        sequence_batching={})).slots == 1


def test_items_carry_the_sequence_parameters_to_the_worker():
    h = direct()
    h.seq(42, START, END)
    item: m.BatchItem = h.sent[0][1].items[0]
    assert item.parameters == {"sequence_id": 42, "sequence_start": True, "sequence_end": True}
