"""The opt-in latency histograms and summaries of one model version, cheap on the hot path.

A request of a successful batch costs one 48-byte struct.pack appended to a bytearray when
its batch ends (the batch's end, the request's arrival and dispatch, the batch's compute
times), whatever families are on: measured, half the cost of keeping a tuple per batch and
converting it later (docs/benchmarks.md, "Metrics cost"). The records are folded with numpy
(np.frombuffer: no Python work per value) into the histogram's buckets and the summaries'
windows when /metrics is read, or every FOLD_REQUESTS requests so memory stays bounded.
Triton's users measured its summaries costing throughput: there each observation takes a
lock and a CKMS insert on the request path.

Summaries follow prometheus-cpp's Summary, which Triton uses with its defaults: the
quantiles cover a sliding window of 60 s kept as 5 age buckets of 12 s (so the window is
48 to 60 s long), while _count and _sum cover all time. The window here is a log-scale
sketch (bins 2 % wide, as DDSketch) rather than CKMS: a quantile is read within 1 % of the
value at that rank, a bound on the value where CKMS bounds the rank; the error half of each
summary_quantiles pair is accepted and not used.
"""
from __future__ import annotations

import math
import struct

import numpy as np

FOLD_REQUESTS = 4096            # fold at least this often, whatever the scrape interval
FOLD_ANSWERS = 2048
# one request of a successful batch: now_ns, arrival_ns, dispatch_ns, in_ns, infer_ns, out_ns
RECORD = struct.Struct("6q")
FOLD_BYTES = FOLD_REQUESTS * RECORD.size
MAX_AGE_NS = 60_000_000_000     # prometheus-cpp Summary: max_age 60 s ...
AGE_BUCKETS = 5                 # ... in 5 age buckets
SLOT_NS = MAX_AGE_NS // AGE_BUCKETS
_GAMMA = 1.02                   # bin width: values within 1 % ((g-1)/(g+1)) of the bin's centre
_LOG_GAMMA = math.log(_GAMMA)
_NBINS = int(math.ceil(math.log(2.0 ** 42) / _LOG_GAMMA)) + 2   # 0 µs .. 51 days
# Summaries: family suffix -> what each request is charged, in Triton's order.
SUMMARIES = ("request", "queue", "compute_input", "compute_infer", "compute_output")
# and, for the versions whose requests are looked up in the response cache, Triton's two more
CACHE_SUMMARIES = ("cache_hit", "cache_miss")


def _bins(values: np.ndarray) -> np.ndarray:
    """Bin of each value (>= 0): 0 holds 0, bin i >= 1 holds (g^(i-2), g^(i-1)]."""
    v = np.maximum(values, 1).astype(np.float64)
    idx = np.ceil(np.log(v) / _LOG_GAMMA).astype(np.int64) + 1
    idx[values <= 0] = 0
    return np.minimum(idx, _NBINS - 1)


def _bin_value(i: int) -> float:
    return 0.0 if i == 0 else 2.0 * _GAMMA ** (i - 1) / (_GAMMA + 1.0)


class Histogram:
    """A Prometheus histogram with fixed bounds (Triton: bucket `le` counts values <= it)."""
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)   # the last one: +Inf only
        self.count = 0
        self.sum = 0.0

    def observe(self, values: np.ndarray) -> None:
        if len(values):
            self.counts += np.bincount(np.searchsorted(self.bounds, values, side="left"),
                                       minlength=len(self.bounds) + 1)
            self.count += len(values)
            self.sum += float(values.sum())

    def cumulative(self) -> list[int]:
        """Counts of each bound, then +Inf."""
        return np.cumsum(self.counts).tolist()


class Summary:
    """A Prometheus summary: all-time count and sum, quantiles over the last 48-60 s."""
    __slots__ = ("count", "slots", "sum")

    def __init__(self) -> None:
        self.count = 0
        self.sum = 0
        self.slots: dict[int, np.ndarray] = {}   # age bucket (time // SLOT_NS) -> bin counts

    def observe(self, values: np.ndarray, slots: np.ndarray) -> None:
        if not len(values):
            return
        self.count += len(values)
        self.sum += int(values.sum())
        idx = _bins(values)
        first, last = int(slots[0]), int(slots[-1])
        for s in (first,) if first == last else np.unique(slots).tolist():
            sel = idx if first == last else idx[slots == s]
            cur = self.slots.get(s)
            add = np.bincount(sel, minlength=_NBINS)
            self.slots[s] = add if cur is None else cur + add
        for s in [s for s in self.slots if s <= last - AGE_BUCKETS]:
            del self.slots[s]

    def quantiles(self, qs: list[float], now_ns: int) -> list[float]:
        """The value at each quantile among the observations of the window ending now; NaN
        for each when the window is empty (as prometheus-cpp)."""
        now = now_ns // SLOT_NS
        for s in [s for s in self.slots if s <= now - AGE_BUCKETS]:
            del self.slots[s]
        live = [a for s, a in self.slots.items() if s <= now]
        if not live:
            return [math.nan] * len(qs)
        cum = np.cumsum(np.sum(live, axis=0) if len(live) > 1 else live[0])
        n = int(cum[-1])
        out = []
        for q in qs:
            i = int(np.searchsorted(cum, max(1, math.ceil(q * n)), side="left"))
            out.append(float(round(_bin_value(i))))   # observations are whole microseconds
        return out


class LatencyRecorder:
    """One version's raw observations (``records``, ``streamed``, ``answers``, ``firsts``)
    and what they fold into: the first-response histogram (``first``) and the five summaries
    (``summaries``)."""
    __slots__ = ("answers", "cache", "first", "firsts", "records", "streamed", "summaries")

    def __init__(self, first_bounds: tuple[float, ...] | None, summaries: bool) -> None:
        self.records = bytearray()   # RECORD per request of a successful batch
        # RECORD per request answered through its response sender: its first response is
        # not the batch's end but one of ``firsts`` (ns from arrival), told by the worker
        self.streamed = bytearray()
        self.firsts: list[int] = []
        # (now_ns, duration_ns, success) of requests answered outside a successful batch
        self.answers: list[tuple[int, int, bool]] = []
        # (now_ns, queue_ns, lookup_ns) of a hit, (now_ns, -1, lookup + insert ns) of a miss
        self.cache: list[tuple[int, int, int]] = []
        self.first = Histogram(first_bounds) if first_bounds is not None else None
        self.summaries = {k: Summary() for k in SUMMARIES + CACHE_SUMMARIES} if summaries else None

    def batch(self, now_ns: int, requests: list[tuple[int, int]],
              compute: tuple[int, int, int]) -> None:
        """A successful batch ended at ``now_ns`` (VersionStats.executed inlines this)."""
        cin, cinf, cout = compute
        buf = self.records
        for arrival, dispatched in requests:
            buf += RECORD.pack(now_ns, arrival, dispatched, cin, cinf, cout)
        if len(buf) >= FOLD_BYTES:
            self.fold()

    def sent(self, now_ns: int, requests: list[tuple[int, int]], first: list[int]) -> None:
        """The first responses of a batch whose requests were answered by their response
        senders: BatchDone.first, ns before ``now_ns`` (-2: at ``now_ns``; -1: not yet)."""
        if self.first is None:
            return
        for (arrival, _), age in zip(requests, first):
            if age != -1:
                self.firsts.append(now_ns - max(age, 0) - arrival)
        if len(self.firsts) >= FOLD_ANSWERS:
            self.fold()

    def first_response(self, duration_ns: int) -> None:
        """A first response that left after its batch was done."""
        if self.first is not None:
            self.firsts.append(duration_ns)
            if len(self.firsts) >= FOLD_ANSWERS:
                self.fold()

    def answered(self, now_ns: int, duration_ns: int, success: bool) -> None:
        """A request answered by the scheduler (an error, or an ensemble's answer)."""
        self.answers.append((now_ns, duration_ns, success))
        if len(self.answers) >= FOLD_ANSWERS:
            self.fold()

    def cached(self, now_ns: int, queue_ns: int, ns: int) -> None:
        """A response cache hit (``queue_ns`` >= 0: its queue time, ``ns`` its lookup) or a
        miss's lookup and insertion (``queue_ns`` -1), for the summaries (Triton observes a
        hit's queue time, not its request duration: with a cache that summary is off)."""
        if self.summaries is not None:
            self.cache.append((now_ns, queue_ns, ns))
            if len(self.cache) >= FOLD_ANSWERS:
                self.fold()

    def fold(self) -> None:
        cache, self.cache = self.cache, []
        if cache and self.summaries is not None:
            c = np.array(cache, dtype=np.int64).reshape(-1, 3)
            hit = c[:, 1] >= 0
            slots = c[:, 0] // SLOT_NS
            self.summaries["cache_hit"].observe(c[hit, 2] // 1000, slots[hit])
            self.summaries["queue"].observe(c[hit, 1] // 1000, slots[hit])
            self.summaries["cache_miss"].observe(c[~hit, 2] // 1000, slots[~hit])
        records, self.records = self.records, bytearray()
        streamed, self.streamed = self.streamed, bytearray()
        answers, self.answers = self.answers, []
        firsts, self.firsts = self.firsts, []
        if records:
            self._fold_records(np.frombuffer(records, np.int64).reshape(-1, 6))
        if streamed:
            self._fold_records(np.frombuffer(streamed, np.int64).reshape(-1, 6), False)
        if firsts and self.first is not None:
            self.first.observe(np.array(firsts, dtype=np.int64) // 1_000_000)
        if answers:
            arr = np.array(answers, dtype=np.int64).reshape(-1, 3)
            if self.first is not None:
                self.first.observe(arr[:, 1] // 1_000_000)
            if self.summaries is not None:
                ok = arr[:, 2] != 0
                self.summaries["request"].observe(arr[ok, 1] // 1000, arr[ok, 0] // SLOT_NS)

    def _fold_records(self, r: np.ndarray, first: bool = True) -> None:
        now, arrival = r[:, 0], r[:, 1]
        request_ns = now - arrival
        if first and self.first is not None:   # the batch's end: its responses left just before
            self.first.observe(request_ns // 1_000_000)
        s = self.summaries
        if s is not None:
            slots = now // SLOT_NS
            s["request"].observe(request_ns // 1000, slots)
            s["queue"].observe((r[:, 2] - arrival) // 1000, slots)
            s["compute_input"].observe(r[:, 3] // 1000, slots)
            s["compute_infer"].observe(r[:, 4] // 1000, slots)
            s["compute_output"].observe(r[:, 5] // 1000, slots)
