"""services.scheduler.batcher, over an injected clock.

The Batcher never reads a clock: every call takes ``now_ns``, so each test gives an exact
arrival pattern and the exact batches Triton's DynamicBatchScheduler::GetDynamicBatch and
PriorityQueue would form for it. VersionQueue: test_version_queue.py.
"""

from __future__ import annotations

import pytest
from google.protobuf import text_format

from protos import model_config_pb2 as mc
from services.common.errors import Code, TriremeError
from services.scheduler.batcher import QUEUE_FULL, Batcher, BatcherConfig, QueuePolicy

US = 1_000
MS = 1_000_000
LONG = 10_000 * MS          # a queue delay no test reaches by accident


def dyn(**kw) -> BatcherConfig:
    kw.setdefault("max_batch_size", 8)
    return BatcherConfig(dynamic=True, **kw)


def fill(b: Batcher, names: str, now: int = 0, step: int = 0, **kw) -> None:
    """Queue one request per character of ``names``, ``step`` ns apart from ``now``."""
    for i, n in enumerate(names):
        b.enqueue(n, now + i * step, **kw)


def batch(b: Batcher, now: int) -> str:
    d = b.next_batch(now)
    assert d.rejected == []
    return "".join(d.batch)


# ------------------------------------------------------------------------ preferred sizes
def test_single_request_waits_for_the_rest_of_the_delay():
    b = Batcher(dyn(preferred=(2, 6), max_queue_delay_ns=10 * MS))
    b.enqueue("a", 0)
    d = b.next_batch(3 * MS)
    assert (d.batch, d.rejected, d.wait_ns) == ([], [], 7 * MS)
    assert len(b) == 1


def test_reaching_a_preferred_size_sends_at_once():
    b = Batcher(dyn(preferred=(2, 6), max_queue_delay_ns=LONG))
    fill(b, "ab")
    d = b.next_batch(0)
    assert (d.batch, d.wait_ns) == (["a", "b"], None)
    assert len(b) == 0
    assert b.next_batch(0).wait_ns is None        # empty: nothing to wait for


def test_seven_queued_sends_six_then_the_rest_after_its_delay():
    b = Batcher(dyn(preferred=(2, 6), max_batch_size=8, max_queue_delay_ns=LONG))
    fill(b, "abcdefg", step=US)
    assert batch(b, 10 * US) == "abcdef"
    # "g" arrived at 6 us: it waits for the rest of its own delay, then goes alone.
    assert b.next_batch(10 * US).wait_ns == LONG - 4 * US
    assert batch(b, 6 * US + LONG - 1) == ""
    assert batch(b, 6 * US + LONG) == "g"


def test_five_unit_requests_send_the_preferred_prefix():
    # Triton remembers the largest *prefix* that is a preferred size: with [2, 6] five
    # single requests give 2 at once (then 2 again), not one batch of 5.
    b = Batcher(dyn(preferred=(2, 6), max_queue_delay_ns=LONG))
    fill(b, "abcde")
    assert batch(b, 0) == "ab"
    assert batch(b, 0) == "cd"
    assert b.next_batch(0).wait_ns == LONG


def test_five_without_a_preferred_prefix_waits_then_goes_whole():
    b = Batcher(dyn(preferred=(2, 6), max_queue_delay_ns=1 * MS))
    b.enqueue("x", 0, batch_size=3)
    b.enqueue("y", 100 * US, batch_size=2)        # 3, then 5: no prefix is preferred
    d = b.next_batch(200 * US)
    assert (d.batch, d.wait_ns) == ([], 800 * US)  # measured from the oldest, "x"
    assert batch(b, 1 * MS) == "xy"


def test_delay_expiry_exactly_at_the_boundary_sends():
    b = Batcher(dyn(preferred=(4,), max_queue_delay_ns=100 * US))
    b.enqueue("a", 5 * US)
    assert b.next_batch(105 * US - 1).wait_ns == 1
    assert batch(b, 105 * US) == "a"              # age == delay: exceeded


def test_delay_zero_sends_whatever_is_pending():
    b = Batcher(dyn(preferred=(4,), max_queue_delay_ns=0))
    b.enqueue("a", 0)
    assert batch(b, 0) == "a"
    fill(b, "bcd")
    assert batch(b, 0) == "bcd"


def test_preferred_size_wins_over_a_larger_pending_batch():
    # 1+1 = 2 is preferred, 2+4 = 6 is not (and 6 > the largest preferred, 4): send 2.
    b = Batcher(dyn(preferred=(2, 4), max_queue_delay_ns=LONG))
    b.enqueue("a", 0)
    b.enqueue("b", 0)
    b.enqueue("c", 0, batch_size=4)
    assert batch(b, 0) == "ab"
    assert batch(b, 0) == "c"                     # 4 is preferred


def test_crossing_the_largest_preferred_size_marks_the_batch():
    # 3 is not preferred, but 3+3 would pass the largest preferred size (4): Triton marks
    # the cursor there and sends the 3 while it is within the delay, not 6.
    b = Batcher(dyn(preferred=(4,), max_batch_size=8, max_queue_delay_ns=LONG))
    fill(b, "ab", batch_size=3)
    assert batch(b, 0) == "a"
    assert b.next_batch(0).wait_ns == LONG


def test_after_the_delay_the_largest_pending_batch_goes():
    # Delay exceeded: the preferred prefix no longer matters, everything that fits goes.
    b = Batcher(dyn(preferred=(2, 6), max_queue_delay_ns=1 * MS))
    fill(b, "abc")
    assert batch(b, 1 * MS) == "abc"


# ------------------------------------------------------------------------ max_batch_size
def test_max_batch_size_with_multi_row_requests():
    b = Batcher(dyn(max_batch_size=8, max_queue_delay_ns=1 * MS))
    fill(b, "abc", batch_size=3)
    assert batch(b, 0) == "ab"                    # 3+3; another 3 would make 9 > 8
    d = b.next_batch(0)
    assert (d.batch, d.wait_ns) == ([], 1 * MS)
    assert batch(b, 1 * MS) == "c"


def test_request_as_large_as_max_batch_size_goes_alone():
    b = Batcher(dyn(max_batch_size=4, max_queue_delay_ns=LONG))
    b.enqueue("a", 0, batch_size=4)
    b.enqueue("b", 0)
    assert batch(b, 0) == "a"
    assert b.next_batch(0).wait_ns == LONG


def test_no_preferred_sizes_behaves_as_max_batch_size():
    b = Batcher(dyn(preferred=(), max_batch_size=4, max_queue_delay_ns=LONG))
    fill(b, "abc")
    assert b.next_batch(0).wait_ns == LONG        # 3 < 4: wait for more
    b.enqueue("d", 0)
    assert batch(b, 0) == "abcd"
    fill(b, "efghi")
    assert batch(b, 0) == "efgh"
    assert b.next_batch(0).batch == []


# ------------------------------------------------------------------------ shapes
def _model(inputs: str, batching: str = "dynamic_batching { max_queue_delay_microseconds: 1000 }",
           max_batch_size: int = 8) -> mc.ModelConfig:
    return text_format.Parse(f'name: "m" backend: "python" max_batch_size: {max_batch_size} '
                             f'{inputs} {batching}', mc.ModelConfig())


VAR = 'input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]'
RAGGED = 'input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]'
FIXED = 'input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]'


def _shaped(cfg: BatcherConfig, *dims: int) -> Batcher:
    b = Batcher(cfg)
    for i, d in enumerate(dims):
        b.enqueue("abcdefgh"[i], 0, shapes={"x": [1, d]})
    return b


def test_variable_dim_input_splits_at_a_shape_change():
    cfg = BatcherConfig.from_model_config(_model(VAR))
    assert cfg.equal_shape_inputs == {"x"}
    b = _shaped(cfg, 3, 3, 5, 5)
    assert batch(b, 0) == "ab"                    # the break sends at once
    assert b.next_batch(0).wait_ns == 1 * MS      # "cd" can still grow
    assert batch(b, 1 * MS) == "cd"


def test_batch_dimension_is_not_part_of_the_shape():
    b = Batcher(BatcherConfig.from_model_config(_model(VAR)))
    b.enqueue("a", 0, batch_size=2, shapes={"x": [2, 3]})
    b.enqueue("b", 0, batch_size=1, shapes={"x": [1, 3]})
    assert batch(b, 1 * MS) == "ab"


def test_allow_ragged_batch_does_not_split():
    cfg = BatcherConfig.from_model_config(_model(RAGGED))
    assert cfg.equal_shape_inputs == frozenset()
    b = _shaped(cfg, 3, 3, 5, 5)
    assert b.next_batch(0).wait_ns == 1 * MS
    assert batch(b, 1 * MS) == "abcd"


def test_fixed_dims_input_never_splits():
    cfg = BatcherConfig.from_model_config(_model(FIXED))
    assert cfg.equal_shape_inputs == frozenset()
    b = _shaped(cfg, 3, 4)                        # shapes are not even looked at
    assert batch(b, 1 * MS) == "ab"


def test_shape_tensor_is_always_equal_shape():
    # Triton enforces equal shapes for every shape tensor, allow_ragged_batch or not.
    cfg = BatcherConfig.from_model_config(_model(
        'input [ { name: "x" data_type: TYPE_INT32 dims: [ 1 ] is_shape_tensor: true '
        'allow_ragged_batch: true } ]'))
    assert cfg.equal_shape_inputs == {"x"}


SHAPE_TENSOR = ('input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] }, '
                '        { name: "s" data_type: TYPE_INT32 dims: [ 2 ] is_shape_tensor: true } ]')


def _int32(*values: int) -> bytes:
    return b"".join(v.to_bytes(4, "little", signed=True) for v in values)


def test_shape_tensors_are_batched_only_with_equal_contents():
    # Triton (RequiredEqualInputs::HasEqualInputs): equal shape *and* equal values.
    cfg = BatcherConfig.from_model_config(_model(SHAPE_TENSOR))
    assert cfg.shape_tensors == {"s"} and cfg.equal_shape_inputs == {"x", "s"}
    b = Batcher(cfg)
    for name, values in zip("abcde", [(2, 3), (2, 3), (2, 5), (2, 5), (2, 3)]):
        b.enqueue(name, 0, shapes={"x": [1, 4], "s": [2]}, contents={"s": _int32(*values)})
    assert batch(b, 0) == "ab"                    # c's values differ: the break sends at once
    assert batch(b, 0) == "cd"
    assert b.next_batch(0).wait_ns == 1 * MS      # e can still grow
    assert batch(b, 1 * MS) == "e"


def test_shape_tensor_values_are_compared_whole():
    # [2, 3] and [2, 5] as int32 share their first byte, then a zero byte: Triton's strncmp
    # would call them equal. Every byte counts here.
    b = Batcher(BatcherConfig.from_model_config(_model(SHAPE_TENSOR)))
    b.enqueue("a", 0, shapes={"x": [1, 4], "s": [2]}, contents={"s": _int32(2, 3)})
    b.enqueue("b", 0, shapes={"x": [1, 4], "s": [2]}, contents={"s": _int32(2, 5)})
    assert batch(b, 0) == "a"


def test_shape_tensor_keeps_its_whole_shape():
    # A shape tensor has no batch dimension: its first dimension is compared too, and the
    # other inputs still drop theirs.
    b = Batcher(BatcherConfig.from_model_config(_model(SHAPE_TENSOR)))
    b.enqueue("a", 0, batch_size=2, shapes={"x": [2, 4], "s": [2]}, contents={"s": _int32(2, 3)})
    b.enqueue("b", 0, shapes={"x": [1, 4], "s": [2]}, contents={"s": _int32(2, 3)})
    b.enqueue("c", 0, shapes={"x": [1, 4], "s": [3]}, contents={"s": _int32(2, 3, 1)})
    b.enqueue("d", 0, shapes={"x": [1, 5], "s": [3]}, contents={"s": _int32(2, 3, 1)})
    assert [batch(b, 1 * MS) for _ in range(3)] == ["ab", "c", "d"]


def test_shape_tensor_without_contents_is_batched_with_nothing():
    # Contents the caller could not read (a tensor in shared memory) never compare equal,
    # as Triton treats contents it cannot compare in place; an empty tensor is a value.
    b = Batcher(BatcherConfig.from_model_config(_model(SHAPE_TENSOR)))
    b.enqueue("a", 0, shapes={"x": [1, 4], "s": [2]}, contents={"s": _int32(2, 3)})
    b.enqueue("b", 0, shapes={"x": [1, 4], "s": [2]})
    b.enqueue("c", 0, shapes={"x": [1, 4], "s": [2]})
    b.enqueue("d", 0, shapes={"x": [1, 4], "s": [0]}, contents={"s": b""})
    b.enqueue("e", 0, shapes={"x": [1, 4], "s": [0]}, contents={"s": b""})
    assert [batch(b, 1 * MS) for _ in range(4)] == ["a", "b", "c", "de"]


def test_without_shape_tensors_contents_are_not_needed():
    cfg = BatcherConfig.from_model_config(_model(VAR))
    assert cfg.shape_tensors == frozenset()
    b = Batcher(cfg)
    assert not b.shape_tensors
    b.enqueue("a", 0, shapes={"x": [1, 3]})
    b.enqueue("b", 0, shapes={"x": [1, 3]}, contents={"x": b"ignored"})
    assert batch(b, 1 * MS) == "ab"


def test_optional_input_splits_on_a_different_set_of_inputs():
    cfg = BatcherConfig.from_model_config(_model(
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] }, '
        '        { name: "y" data_type: TYPE_FP32 dims: [ 3 ] optional: true } ]'))
    assert cfg.has_optional_input
    b = Batcher(cfg)
    b.enqueue("a", 0, shapes={"x": [1, 3]})
    b.enqueue("b", 0, shapes={"x": [1, 3]})
    b.enqueue("c", 0, shapes={"x": [1, 3], "y": [1, 3]})
    assert batch(b, 0) == "ab"
    assert batch(b, 1 * MS) == "c"


# ------------------------------------------------------------------------ priorities
def test_priority_level_one_is_batched_first():
    b = Batcher(dyn(max_batch_size=2, max_queue_delay_ns=0, priority_levels=2,
                    default_priority=2))
    b.enqueue("a", 0, priority=2)
    b.enqueue("b", 1, priority=2)
    b.enqueue("c", 2, priority=1)
    assert batch(b, 10) == "ca"
    assert batch(b, 10) == "b"


def test_priority_zero_or_above_levels_means_the_default_level():
    b = Batcher(dyn(max_batch_size=1, max_queue_delay_ns=0, priority_levels=3,
                    default_priority=2))
    assert [b.level_of(p) for p in (0, 1, 2, 3, 4, 99)] == [2, 1, 2, 3, 2, 2]
    b.enqueue("a", 0, priority=3)
    b.enqueue("b", 1, priority=7)                 # -> 2
    b.enqueue("c", 2, priority=0)                 # -> 2
    b.enqueue("d", 3, priority=1)
    assert [batch(b, 10) for _ in range(4)] == ["d", "b", "c", "a"]


def test_without_priority_levels_priorities_are_ignored():
    b = Batcher(dyn(max_batch_size=1, max_queue_delay_ns=0))
    b.enqueue("a", 0, priority=5)
    b.enqueue("b", 1, priority=1)
    assert [batch(b, 2), batch(b, 2)] == ["a", "b"]


# ------------------------------------------------------------------------ timeouts
def test_reject_policy_rejects_expired_requests():
    b = Batcher(dyn(preferred=(4,), max_queue_delay_ns=1 * MS,
                    policies={1: QueuePolicy(default_timeout_us=100)}))
    b.enqueue("a", 0)
    b.enqueue("b", 50 * US)
    d = b.next_batch(50 * US)
    assert (d.batch, d.rejected, d.wait_ns) == ([], [], 50 * US)   # bounded by a's deadline
    d = b.next_batch(100 * US + 1)
    assert (d.batch, d.rejected) == ([], ["a"])
    assert d.wait_ns == 150 * US - (100 * US + 1)                  # now b's deadline
    assert len(b) == 1
    d = b.next_batch(150 * US + 1)
    assert (d.batch, d.rejected, d.wait_ns) == ([], ["b"], None)
    assert len(b) == 0


def test_rejected_requests_come_with_the_batch_that_follows_them():
    b = Batcher(dyn(max_batch_size=2, max_queue_delay_ns=0,
                    policies={1: QueuePolicy(default_timeout_us=100)}))
    b.enqueue("a", 0)
    b.enqueue("b", 200 * US)
    d = b.next_batch(200 * US)
    assert (d.batch, d.rejected) == (["b"], ["a"])


def test_delay_policy_moves_expired_behind_on_time_requests():
    b = Batcher(dyn(max_batch_size=8, preferred=(3,), max_queue_delay_ns=1 * MS,
                    policies={1: QueuePolicy(delay_on_timeout=True, default_timeout_us=100)}))
    b.enqueue("a", 0)
    b.enqueue("b", 200 * US)
    b.enqueue("c", 200 * US)
    assert batch(b, 200 * US) == "bca"            # a expired: behind b and c, not rejected


def test_delayed_request_is_still_sent_and_has_no_deadline_left():
    b = Batcher(dyn(max_batch_size=2, max_queue_delay_ns=1 * MS,
                    policies={1: QueuePolicy(delay_on_timeout=True, default_timeout_us=100)}))
    b.enqueue("a", 0)
    b.enqueue("b", 200 * US)
    b.enqueue("c", 200 * US)
    assert batch(b, 200 * US) == "bc"
    d = b.next_batch(200 * US)
    assert (d.batch, d.rejected, d.wait_ns) == ([], [], 800 * US)  # its age still counts
    assert batch(b, 1 * MS) == "a"


def test_delay_policy_only_reorders_within_its_level():
    b = Batcher(dyn(max_batch_size=1, max_queue_delay_ns=0, priority_levels=2,
                    default_priority=2,
                    policies={1: QueuePolicy(delay_on_timeout=True, default_timeout_us=100),
                              2: QueuePolicy()}))
    b.enqueue("a", 0, priority=1)
    b.enqueue("b", 0, priority=2)
    b.enqueue("c", 200 * US, priority=1)
    assert [batch(b, 200 * US) for _ in range(3)] == ["c", "a", "b"]


@pytest.mark.parametrize("default_us, override, request_us, expect_wait", [
    (100, True, 50, 50 * US),         # shorter: applies
    (100, True, 500, 100 * US),       # longer: the default stays
    (100, False, 50, 100 * US),       # override not allowed
    (0, True, 50, 1 * MS),            # no default timeout: a request cannot add one
    (100, True, 0, 100 * US),         # no request timeout: the default
])
def test_timeout_override_only_shortens(default_us, override, request_us, expect_wait):
    b = Batcher(dyn(preferred=(4,), max_queue_delay_ns=1 * MS, policies={1: QueuePolicy(
        default_timeout_us=default_us, allow_timeout_override=override)}))
    b.enqueue("a", 0, timeout_us=request_us)
    assert b.next_batch(0).wait_ns == expect_wait
    d = b.next_batch(expect_wait + 1)
    if expect_wait < 1 * MS:
        assert (d.batch, d.rejected) == ([], ["a"])
    else:
        assert (d.batch, d.rejected) == (["a"], [])


def test_wait_is_bounded_by_the_nearest_deadline_of_the_pending_batch():
    b = Batcher(dyn(preferred=(8,), max_queue_delay_ns=1 * MS, policies={1: QueuePolicy(
        default_timeout_us=900, allow_timeout_override=True)}))
    b.enqueue("a", 0)                             # deadline 900 us
    b.enqueue("b", 100 * US, timeout_us=300)      # deadline 400 us: the nearest
    b.enqueue("c", 200 * US)                      # deadline 1100 us
    assert b.next_batch(200 * US).wait_ns == 200 * US
    d = b.next_batch(400 * US + 1)
    assert (d.batch, d.rejected) == ([], ["b"])
    assert d.wait_ns == 900 * US - (400 * US + 1)


def test_request_within_its_timeout_is_not_rejected():
    b = Batcher(dyn(max_queue_delay_ns=0, policies={1: QueuePolicy(default_timeout_us=100)}))
    b.enqueue("a", 0)
    d = b.next_batch(100 * US - 1)
    assert (d.batch, d.rejected) == (["a"], [])


# ------------------------------------------------------------------------ queue size
def test_max_queue_size_is_per_level():
    b = Batcher(dyn(max_queue_delay_ns=LONG, priority_levels=2, default_priority=2,
                    policies={1: QueuePolicy(max_queue_size=2), 2: QueuePolicy(max_queue_size=1)}))
    b.enqueue("a", 0, priority=1)
    b.enqueue("b", 0, priority=1)
    with pytest.raises(TriremeError) as ei:
        b.enqueue("c", 0, priority=1)
    assert ei.value.code == Code.UNAVAILABLE
    assert str(ei.value) == QUEUE_FULL == "Exceeds maximum queue size"
    b.enqueue("d", 0, priority=2)                 # another level: room
    with pytest.raises(TriremeError):
        b.enqueue("e", 0, priority=0)             # default level 2 is full now
    assert len(b) == 3
    assert batch(b, LONG) == "abd"
    b.enqueue("f", 0, priority=1)                 # room again


def test_delayed_requests_count_toward_the_queue_size():
    b = Batcher(dyn(max_batch_size=1, preferred=(1,), max_queue_delay_ns=LONG,
                    policies={1: QueuePolicy(delay_on_timeout=True, default_timeout_us=1,
                                             max_queue_size=2)}))
    b.enqueue("a", 0)
    b.enqueue("b", 0)
    assert batch(b, 10 * US) == "a"               # both expired: a and b are now delayed
    b.enqueue("c", 10 * US)
    with pytest.raises(TriremeError):
        b.enqueue("d", 10 * US)


# ------------------------------------------------------------------------ delay hook
def test_delay_scheduler_hook_holds_until_n_are_queued_once():
    b = Batcher(dyn(max_queue_delay_ns=0, delay_count=3))
    b.enqueue("a", 0)
    assert (b.next_batch(0).batch, b.next_batch(0).wait_ns) == ([], None)
    b.enqueue("b", 0)
    assert b.next_batch(LONG).batch == []         # not even an expired delay sends
    b.enqueue("c", 0)
    assert batch(b, 0) == "abc"
    b.enqueue("d", 0)                             # the hook is spent: normal behaviour
    assert batch(b, 0) == "d"


def test_delay_scheduler_hook_from_model_config():
    cfg = BatcherConfig.from_model_config(_model(FIXED), delay_count=2)
    assert cfg.delay_count == 2
    b = Batcher(cfg)
    b.enqueue("a", 0)
    assert b.next_batch(1 * MS).batch == []
    b.enqueue("b", 0)
    assert batch(b, 1 * MS) == "ab"


# ------------------------------------------------------------------------ no dynamic batching
def test_without_dynamic_batching_one_request_per_batch_in_order():
    b = Batcher(BatcherConfig(max_batch_size=8))
    fill(b, "abc", step=1)
    assert [b.next_batch(10).batch for _ in range(3)] == [["a"], ["b"], ["c"]]
    assert b.next_batch(10).batch == []


def test_without_dynamic_batching_from_model_config():
    cfg = BatcherConfig.from_model_config(_model(FIXED, batching=""))
    assert not cfg.dynamic and cfg.max_batch_size == 8
    b = Batcher(cfg)
    b.enqueue("a", 0, batch_size=2)
    b.enqueue("b", 0, batch_size=2)
    d = b.next_batch(0)
    assert (d.batch, d.wait_ns) == (["a"], None)
    assert b.next_batch(0).batch == ["b"]


def test_max_batch_size_zero_never_batches():
    cfg = BatcherConfig.from_model_config(_model(FIXED, max_batch_size=0))
    assert not cfg.dynamic and cfg.max_batch_size == 0


# ------------------------------------------------------------------------ from_model_config
def test_from_model_config_reads_every_field():
    cfg = BatcherConfig.from_model_config(_model(VAR, batching="""
        dynamic_batching {
          preferred_batch_size: [ 6, 2, 6 ]
          max_queue_delay_microseconds: 250
          preserve_ordering: true
          priority_levels: 3
          default_priority_level: 2
          default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 70
                                 allow_timeout_override: true max_queue_size: 4 }
          priority_queue_policy { key: 1 value { max_queue_size: 9 } }
        }"""))
    assert cfg.dynamic and cfg.max_batch_size == 8
    assert cfg.preferred == (2, 6)
    assert cfg.max_queue_delay_ns == 250 * US
    assert cfg.preserve_ordering
    assert (cfg.priority_levels, cfg.default_priority) == (3, 2)
    default = QueuePolicy(delay_on_timeout=True, default_timeout_us=70,
                          allow_timeout_override=True, max_queue_size=4)
    assert cfg.policies == {1: QueuePolicy(max_queue_size=9), 2: default, 3: default}
    assert cfg.equal_shape_inputs == {"x"} and not cfg.has_optional_input
    assert cfg.delay_count == 0


def test_from_model_config_batches_like_a_direct_config():
    cfg = BatcherConfig.from_model_config(_model(FIXED, batching="""
        dynamic_batching { preferred_batch_size: [ 2, 6 ] max_queue_delay_microseconds: 500 }"""))
    b = Batcher(cfg)
    b.enqueue("a", 0)
    assert b.next_batch(100 * US).wait_ns == 400 * US
    fill(b, "bcdefg")
    assert batch(b, 100 * US) == "abcdef"
    assert batch(b, 600 * US) == "g"


def test_drain_empties_every_level():
    b = Batcher(dyn(max_queue_delay_ns=LONG, priority_levels=2, default_priority=1))
    b.enqueue("a", 0, priority=2)
    b.enqueue("b", 0, priority=1)
    assert sorted(b.drain()) == ["a", "b"]
    assert len(b) == 0 and b.next_batch(LONG).batch == []
