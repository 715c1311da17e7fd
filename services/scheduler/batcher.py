"""Batch formation with Triton's semantics, as pure logic over an injected clock.

One Batcher per loaded model version. It owns the queue (one policy queue per priority level)
and answers a single question whenever an instance is free: which requests run next, or how
long to wait before asking again. It never sleeps, sends or reads a clock itself: the caller
passes ``now`` (monotonic ns), so unit tests give exact arrival patterns.

Dynamic batching (../shared/reference/protocol.md §5, after Triton's DynamicBatchScheduler):
- walk the queue in order (priority level 1 first; within a level, on-time requests, then
  the ones a DELAY policy pushed back), growing a pending batch; stop before exceeding
  max_batch_size, or at a request whose shape differs where shapes must be equal, or whose
  shape tensors (TensorRT `is_shape_tensor` inputs) differ in shape or contents;
- remember the largest pending size equal to a preferred size; crossing the largest
  preferred size also marks the cursor;
- send when a preferred size was reached and the oldest pending request is within the
  queue delay; else when nothing can grow the batch (it hit max_batch_size, a shape break, or
  the largest preferred size), the delay expired, or there is no delay; else wait for the
  rest of the delay, bounded by the nearest request timeout.
- a timed-out request met by the walk is rejected ("Request timeout expired") or, with
  timeout_action DELAY, moved behind the on-time requests of its level;
- a cancelled request (cancel()) leaves the count at once and its entry when a walk or
  pop meets it, so cancelling costs O(1) whatever the queue's length.
Without dynamic_batching every request is its own execution, in arrival order.
"""
from __future__ import annotations

import collections
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import Code, TriremeError

TIMEOUT_EXPIRED = "Request timeout expired"
QUEUE_FULL = "Exceeds maximum queue size"


@dataclass(frozen=True)
class QueuePolicy:
    delay_on_timeout: bool = False      # timeout_action DELAY (default REJECT)
    default_timeout_us: int = 0
    allow_timeout_override: bool = False
    max_queue_size: int = 0             # 0: unlimited


@dataclass
class BatcherConfig:
    dynamic: bool = False               # dynamic_batching present in the config
    max_batch_size: int = 0
    preferred: tuple[int, ...] = ()
    max_queue_delay_ns: int = 0
    preserve_ordering: bool = False
    priority_levels: int = 0            # 0: one level, request priorities ignored
    default_priority: int = 0
    policies: dict[int, QueuePolicy] = field(default_factory=dict)   # level -> policy
    equal_shape_inputs: frozenset[str] = frozenset()
    shape_tensors: frozenset[str] = frozenset()   # also compared by contents (and full shape)
    has_optional_input: bool = False
    delay_count: int = 0                # TRITONSERVER_DELAY_SCHEDULER

    @classmethod
    def from_model_config(cls, cfg: Any, delay_count: int = 0) -> BatcherConfig:
        """From an inference.ModelConfig (already normalised and completed)."""
        if not cfg.HasField("dynamic_batching") or cfg.max_batch_size <= 0:
            return cls(max_batch_size=max(cfg.max_batch_size, 0))
        db = cfg.dynamic_batching
        # Triton: every shape tensor, and each variable-dim input not allow_ragged_batch.
        equal = frozenset(i.name for i in cfg.input
                          if i.is_shape_tensor or (not i.allow_ragged_batch
                                                   and any(d < 0 for d in i.dims)))
        levels = db.priority_levels
        policies = {lvl: _policy(db.priority_queue_policy.get(lvl, db.default_queue_policy))
                    for lvl in range(1, max(levels, 1) + 1)}
        return cls(
            dynamic=True, max_batch_size=cfg.max_batch_size,
            preferred=tuple(sorted(set(db.preferred_batch_size))),
            max_queue_delay_ns=db.max_queue_delay_microseconds * 1000,
            preserve_ordering=db.preserve_ordering, priority_levels=levels,
            default_priority=db.default_priority_level if levels else 0, policies=policies,
            equal_shape_inputs=equal, has_optional_input=any(i.optional for i in cfg.input),
            shape_tensors=frozenset(i.name for i in cfg.input if i.is_shape_tensor),
            delay_count=delay_count)


def _policy(p: Any) -> QueuePolicy:
    return QueuePolicy(p.timeout_action == 1, p.default_timeout_microseconds,
                       p.allow_timeout_override, p.max_queue_size)


class Entry:
    """A queued request as the batcher sees it; ``item`` is the caller's object, None once
    cancelled (the entry stays where it is until a walk or a pop meets it)."""
    __slots__ = ("batch_size", "deadline_ns", "enqueued_ns", "item", "level", "signature")

    def __init__(self, item: Any, batch_size: int, enqueued_ns: int, deadline_ns: int,
                 signature: Any, level: _Level) -> None:
        self.item = item
        self.batch_size = batch_size
        self.enqueued_ns = enqueued_ns
        self.deadline_ns = deadline_ns
        self.signature = signature
        self.level = level


class _Level:
    __slots__ = ("dead", "delayed", "main", "policy")

    def __init__(self, policy: QueuePolicy) -> None:
        self.policy = policy
        self.main: collections.deque[Entry] = collections.deque()
        self.delayed: collections.deque[Entry] = collections.deque()
        self.dead = 0           # cancelled entries still in the deques

    def __len__(self) -> int:
        return len(self.main) + len(self.delayed) - self.dead


class Decision:
    """What next_batch found: a batch to run now, and/or requests to reject, and/or when to
    look again (``wait_ns``; None: only when something arrives or an instance frees)."""
    __slots__ = ("batch", "rejected", "wait_ns")

    def __init__(self, batch: list[Any], rejected: list[Any], wait_ns: int | None) -> None:
        self.batch = batch
        self.rejected = rejected
        self.wait_ns = wait_ns


class Batcher:
    def __init__(self, config: BatcherConfig) -> None:
        self.config = config
        c = config
        self.levels = [_Level(c.policies.get(lvl, QueuePolicy()))
                       for lvl in range(1, max(c.priority_levels, 1) + 1)]
        self.max_preferred = max(c.preferred) if c.preferred else c.max_batch_size
        self.preferred = frozenset(c.preferred or (c.max_batch_size,))
        # Callers pass input shapes to enqueue() only when batch formation looks at them.
        self.needs_shapes = bool(c.equal_shape_inputs) or c.has_optional_input
        # ... and the contents of these inputs only when the model has shape tensors.
        self.shape_tensors = c.shape_tensors
        self._delay_count = c.delay_count
        self._size = 0

    def __len__(self) -> int:
        return self._size

    # ------------------------------------------------------------------ arrivals
    def level_of(self, priority: int) -> int:
        """Triton: 0, or above priority_levels, means the model's default level."""
        c = self.config
        if c.priority_levels == 0:
            return 1
        if priority <= 0 or priority > c.priority_levels:
            return c.default_priority or 1
        return priority

    def enqueue(self, item: Any, now_ns: int, *, batch_size: int = 1, priority: int = 0,
                timeout_us: int = 0, shapes: dict[str, list[int]] | None = None,
                contents: dict[str, bytes] | None = None) -> Entry:
        """Queue a request; raises UNAVAILABLE "Exceeds maximum queue size" when its level
        is full. ``shapes`` (input name -> full shape) is needed only for equal-shape rules,
        ``contents`` (input name -> bytes) only for shape tensors; a shape tensor without
        contents is batched with no other request. The returned entry is the handle
        cancel() takes."""
        level = self.levels[self.level_of(priority) - 1]
        p = level.policy
        if p.max_queue_size and len(level) >= p.max_queue_size:
            raise TriremeError(Code.UNAVAILABLE, QUEUE_FULL)
        timeout = p.default_timeout_us
        if p.allow_timeout_override and 0 < timeout_us < timeout:
            timeout = timeout_us
        deadline = now_ns + timeout * 1000 if timeout else 0
        entry = Entry(item, max(batch_size, 1), now_ns, deadline,
                      self._signature(shapes, contents) if self.needs_shapes else None, level)
        level.main.append(entry)
        self._size += 1
        return entry

    def cancel(self, entry: Entry) -> Any:
        """Take a queued entry out of the queue in O(1), returning its item: it is marked
        and skipped (and dropped) by the next walk or pop that meets it. Triton checks for
        cancelled requests at its batcher's cursor the same way."""
        item, entry.item = entry.item, None
        entry.level.dead += 1
        self._size -= 1
        return item

    def _signature(self, shapes: dict[str, list[int]] | None,
                   contents: dict[str, bytes] | None = None) -> Any:
        shapes = shapes or {}
        sig: tuple[object, ...]
        if not self.shape_tensors:
            sig = tuple((n, tuple(shapes[n][1:])) for n in sorted(self.config.equal_shape_inputs)
                        if n in shapes)
        else:
            # Triton (RequiredEqualInputs): a shape tensor keeps its whole shape (it has no
            # batch dimension) and must hold the same values. Its bytes are compared whole;
            # Triton's strncmp would stop at the first zero byte.
            contents = contents or {}
            parts: list[tuple[object, ...]] = []
            for n in sorted(self.config.equal_shape_inputs):
                if n not in shapes:
                    continue
                if n in self.shape_tensors:
                    data = contents.get(n)
                    parts.append((n, tuple(shapes[n]), object() if data is None else data))
                else:
                    parts.append((n, tuple(shapes[n][1:])))
            sig = tuple(parts)
        if self.config.has_optional_input:
            sig = (sig, frozenset(shapes))
        return sig

    # ------------------------------------------------------------------ batches
    def next_batch(self, now_ns: int) -> Decision:
        """Called when an instance is free. Removes and returns the batch to run, if any."""
        if not self._size:
            return Decision([], [], None)
        if self._delay_count:
            # Triton's test hook: hold everything until that many requests are queued, once.
            if self._size < self._delay_count:
                return Decision([], [], None)
            self._delay_count = 0
        if not self.config.dynamic:
            for level in self.levels:
                if level.dead:
                    self._pop_dead(level)
                q = level.main or level.delayed
                if q:
                    self._size -= 1
                    return Decision([q.popleft().item], [], None)
        return self._dynamic(now_ns)

    @staticmethod
    def _pop_dead(level: _Level) -> None:
        """Pop the cancelled entries at the front of a level's deques: the next live one
        is then at the front of the first non-empty deque (amortised O(1) a cancel)."""
        for q in (level.main, level.delayed):
            while q and q[0].item is None:
                q.popleft()
                level.dead -= 1
            if q:
                return

    def _walk(self, now_ns: int,
              rejected: list[Any]) -> Generator[tuple[collections.deque, Entry], None, None]:
        """Queued entries in batching order, applying each level's timeout policy on the way."""
        for level in self.levels:
            q = level.main
            i = 0
            while i < len(q):
                e = q[i]
                if e.item is None:          # cancelled
                    del q[i]
                    level.dead -= 1
                    continue
                if e.deadline_ns and now_ns >= e.deadline_ns:
                    del q[i]
                    if level.policy.delay_on_timeout:
                        e.deadline_ns = 0
                        level.delayed.append(e)
                    else:
                        rejected.append(e.item)
                        self._size -= 1
                    continue
                yield q, e
                i += 1
            q = level.delayed
            i = 0
            while i < len(q):
                e = q[i]
                if e.item is None:
                    del q[i]
                    level.dead -= 1
                    continue
                yield q, e
                i += 1

    def _dynamic(self, now_ns: int) -> Decision:
        c = self.config
        rejected: list[Any] = []
        pending: list[tuple[collections.deque, Entry]] = []
        size = 0
        best = 0              # number of pending entries at the best preferred size
        send_now = False
        signature = None
        oldest = None
        closest_deadline = 0
        walk = self._walk(now_ns, rejected)
        for q, e in walk:
            if pending:
                if size + e.batch_size > self.max_preferred and best == 0:
                    best = len(pending)
                if size + e.batch_size > c.max_batch_size:
                    send_now = True
                    break
                if self.needs_shapes and e.signature != signature:
                    send_now = True
                    break
            else:
                signature = e.signature
            pending.append((q, e))
            size += e.batch_size
            if oldest is None or e.enqueued_ns < oldest:
                oldest = e.enqueued_ns
            if e.deadline_ns and (not closest_deadline or e.deadline_ns < closest_deadline):
                closest_deadline = e.deadline_ns
            if size in self.preferred:
                best = len(pending)
        walk.close()
        if not pending:
            return Decision([], rejected, None)
        assert oldest is not None           # set with the first pending entry
        delay = c.max_queue_delay_ns
        age = now_ns - oldest
        exceeded = delay != 0 and age >= delay
        if best and not exceeded:
            return Decision(self._take(pending[:best]), rejected, None)
        if send_now or size >= self.max_preferred or exceeded or delay == 0:
            return Decision(self._take(pending), rejected, None)
        wait = delay - age
        if closest_deadline:
            wait = min(wait, closest_deadline - now_ns) if now_ns <= closest_deadline else 1000
        return Decision([], rejected, max(wait, 1))

    def _take(self, chosen: list[tuple[collections.deque, Entry]]) -> list[Any]:
        # The chosen entries are a prefix of the walk, so each is at the front of its deque.
        out = []
        for q, e in chosen:
            q.popleft()
            out.append(e.item)
        self._size -= len(out)
        return out

    def entries(self) -> Iterator[Entry]:
        """Every queued (not cancelled) entry, in no particular order."""
        for level in self.levels:
            for q in (level.main, level.delayed):
                for e in q:
                    if e.item is not None:
                        yield e

    def drain(self) -> list[Any]:
        """Remove and return everything queued (the version is going away)."""
        out = [e.item for level in self.levels for q in (level.main, level.delayed) for e in q
               if e.item is not None]
        for level in self.levels:
            level.main.clear()
            level.delayed.clear()
            level.dead = 0
        self._size = 0
        return out
