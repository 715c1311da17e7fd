"""services.scheduler.rate_limiter: resource specs, per-device and global counts, priority
weighting, and waking the VersionQueues it held back. Instances carry a real
inference.ModelInstanceGroup as their config; VersionQueues run on a fake clock and timers."""

from __future__ import annotations

import pytest
from google.protobuf import text_format

from protos import model_config_pb2 as mc
from services.common import messages as m
from services.scheduler.batcher import BatcherConfig
from services.scheduler.dispatch import Instance, Pending, VersionQueue
from services.scheduler.rate_limiter import RateLimiter, parse_resource


def group(text: str = "") -> mc.ModelInstanceGroup:
    return text_format.Parse(text, mc.ModelInstanceGroup())


def needs(*resources: tuple[str, int] | tuple[str, int, bool], priority: int = 0,
          kind: str = "KIND_CPU") -> mc.ModelInstanceGroup:
    g = mc.ModelInstanceGroup(kind=getattr(mc.ModelInstanceGroup, kind))
    g.rate_limiter.priority = priority
    for name, count, *glob in resources:
        r = g.rate_limiter.resources.add(name=name, count=count)
        setattr(r, "global", bool(glob and glob[0]))
    return g


_n = 0


def inst(config=None, kind: str = "KIND_CPU", device: int = 0, model: str = "m") -> Instance:
    global _n
    _n += 1
    return Instance(f"w{_n}", f"{model}_0_{_n}", model, 1, kind, device_id=device, config=config)


def run_one(rl: RateLimiter, idle: list[Instance]) -> Instance | None:
    """Choose and acquire, as VersionQueue does."""
    i = rl.choose(idle)
    if i is not None:
        rl.acquire(i)
    return i


# ------------------------------------------------------------------------ parse_resource
def test_parse_resource():
    assert parse_resource("R1:2") == ("R1", 2, None)
    assert parse_resource("R1:2:0") == ("R1", 2, 0)
    assert parse_resource("gpu_mem:10:3") == ("gpu_mem", 10, 3)


@pytest.mark.parametrize("spec, why", [
    ("R1", "expected name:count[:device]"),
    ("R1:2:0:1", "expected name:count[:device]"),
    (":2", "expected name:count[:device]"),
    ("", "expected name:count[:device]"),
    ("R1:two", "count and device must be integers"),
    ("R1:2:gpu0", "count and device must be integers"),
    ("R1::0", "count and device must be integers"),
])
def test_parse_resource_rejects_bad_specs(spec, why):
    with pytest.raises(ValueError) as ei:
        parse_resource(spec)
    assert str(ei.value) == f"invalid --rate-limit-resource '{spec}': {why}"


def test_bad_flag_fails_the_limiter():
    with pytest.raises(ValueError, match="invalid --rate-limit-resource 'R'"):
        RateLimiter(["R"])


# ------------------------------------------------------------------------ resources
def test_default_availability_is_the_largest_single_requirement():
    rl = RateLimiter()
    a, b = inst(needs(("R", 1))), inst(needs(("R", 1)))
    rl.register(a)
    rl.register(b)
    assert rl.available(("R", -1)) == 1
    assert run_one(rl, [a, b]) is a
    assert run_one(rl, [b]) is None               # R is taken: only one runs at a time
    rl.release(a)
    assert run_one(rl, [b]) is b


def test_largest_requirement_lets_every_instance_run_alone():
    rl = RateLimiter()
    small, big = inst(needs(("R", 1))), inst(needs(("R", 3)))
    rl.register(small)
    rl.register(big)
    assert rl.available(("R", -1)) == 3
    assert run_one(rl, [small]) is small
    assert run_one(rl, [big]) is None             # 1 + 3 > 3
    rl.release(small)
    assert run_one(rl, [big]) is big


def test_flag_count_lets_both_run():
    rl = RateLimiter(["R:2"])
    a, b, c = (inst(needs(("R", 1))) for _ in range(3))
    for i in (a, b, c):
        rl.register(i)
    assert run_one(rl, [a, b, c]) is not None
    assert run_one(rl, [b, c]) is not None
    assert run_one(rl, [c]) is None               # the third has to wait


def test_instance_without_resources_always_runs():
    rl = RateLimiter(["R:1"])
    plain, grouped = inst(None), inst(group("kind: KIND_CPU count: 2"))
    needy = inst(needs(("R", 1)))
    for i in (plain, grouped, needy):
        rl.register(i)
    order = [needy, plain, grouped, plain]       # R is taken; the others need nothing
    assert [run_one(rl, [i]) for i in order] == order


def test_resources_are_per_device_unless_global():
    rl = RateLimiter()
    g0 = inst(needs(("R", 1), kind="KIND_GPU"), kind="KIND_GPU", device=0)
    g1 = inst(needs(("R", 1), kind="KIND_GPU"), kind="KIND_GPU", device=1)
    g0b = inst(needs(("R", 1), kind="KIND_GPU"), kind="KIND_GPU", device=0)
    for i in (g0, g1, g0b):
        rl.register(i)
    assert run_one(rl, [g0]) is g0
    assert run_one(rl, [g1]) is g1                # device 1 has its own R
    assert run_one(rl, [g0b]) is None             # device 0's R is taken


def test_global_resource_is_shared_across_devices():
    rl = RateLimiter()
    g0 = inst(needs(("R", 1, True), kind="KIND_GPU"), kind="KIND_GPU", device=0)
    g1 = inst(needs(("R", 1, True), kind="KIND_GPU"), kind="KIND_GPU", device=1)
    rl.register(g0)
    rl.register(g1)
    assert run_one(rl, [g0]) is g0
    assert run_one(rl, [g1]) is None
    rl.release(g0)
    assert run_one(rl, [g1]) is g1


def test_cpu_instances_share_one_device_whatever_their_device_id():
    rl = RateLimiter()
    c0, c1 = inst(needs(("R", 1)), device=0), inst(needs(("R", 1)), device=1)
    rl.register(c0)
    rl.register(c1)
    assert run_one(rl, [c0]) is c0
    assert run_one(rl, [c1]) is None


def test_device_specific_flag():
    rl = RateLimiter(["R:2:0"])
    g0a, g0b, g1a, g1b = (inst(needs(("R", 1), kind="KIND_GPU"), kind="KIND_GPU", device=d)
                          for d in (0, 0, 1, 1))
    for i in (g0a, g0b, g1a, g1b):
        rl.register(i)
    assert rl.available(("R", 0)) == 2 and rl.available(("R", 1)) == 1
    assert run_one(rl, [g0a]) is g0a and run_one(rl, [g0b]) is g0b
    assert run_one(rl, [g1a]) is g1a and run_one(rl, [g1b]) is None


def test_per_device_flag_applies_to_every_device():
    rl = RateLimiter(["R:2"])
    gs = [inst(needs(("R", 1), kind="KIND_GPU"), kind="KIND_GPU", device=d) for d in (0, 0, 1, 1)]
    for i in gs:
        rl.register(i)
    assert [run_one(rl, [i]) for i in gs] == gs


def test_device_and_per_device_flags_take_the_larger():
    # Triton (ParseAndValidateExplicitResources): a device's count is the largest of its own
    # flag and the per-device one, whichever order they come in.
    rl = RateLimiter(["R:1:0", "R:3", "S:4:0", "S:2"])
    assert rl.available(("R", 0)) == 3 and rl.available(("R", 1)) == 3
    assert rl.available(("S", 0)) == 4 and rl.available(("S", 1)) == 2


def test_global_resource_takes_the_largest_flag_of_any_device():
    rl = RateLimiter(["R:2:1", "R:1:0"])
    g0, g1 = (inst(needs(("R", 1, True), kind="KIND_GPU"), kind="KIND_GPU", device=d)
              for d in (0, 1))
    rl.register(g0)
    rl.register(g1)
    assert rl.available(("R", -2)) == 2
    assert run_one(rl, [g0]) is g0 and run_one(rl, [g1]) is g1


def test_instance_needing_several_resources_needs_all_of_them():
    rl = RateLimiter()
    both = inst(needs(("A", 1), ("B", 1)))
    only_b = inst(needs(("B", 1)))
    rl.register(both)
    rl.register(only_b)
    assert run_one(rl, [only_b]) is only_b
    assert run_one(rl, [both]) is None            # A is free but B is not
    rl.release(only_b)
    assert run_one(rl, [both]) is both
    assert rl.used == {("A", -1): 1, ("B", -1): 1}
    rl.release(both)
    assert rl.used == {("A", -1): 0, ("B", -1): 0}


def test_unregistered_requirement_no_longer_sets_the_default():
    # Triton recomputes the default counts (UpdateResourceLimits) when an instance goes.
    rl = RateLimiter()
    big, a, b = inst(needs(("R", 2))), inst(needs(("R", 1))), inst(needs(("R", 1)))
    for i in (big, a, b):
        rl.register(i)
    assert rl.available(("R", -1)) == 2
    rl.unregister(big)
    assert rl.available(("R", -1)) == 1
    assert run_one(rl, [a]) is a
    assert run_one(rl, [b]) is None


# ------------------------------------------------------------------------ priority
def test_priority_weighting_two_to_one():
    rl = RateLimiter()
    fast = inst(needs(("R", 1), priority=1))
    slow = inst(needs(("R", 1), priority=2))
    rl.register(fast)
    rl.register(slow)
    order = []
    for _ in range(30):
        i = run_one(rl, [fast, slow])
        assert run_one(rl, [fast, slow]) is None  # one R: one at a time
        order.append("F" if i is fast else "S")
        rl.release(i)
    # score = (executions + 1) * priority, lowest first, ties to the first idle instance.
    assert "".join(order) == "FFS" * 10
    assert (order.count("F"), order.count("S")) == (20, 10)


def test_priority_zero_counts_as_one():
    rl = RateLimiter()
    a, b = inst(needs(("R", 1), priority=0)), inst(needs(("R", 1), priority=1))
    rl.register(a)
    rl.register(b)
    got = []
    for _ in range(10):
        i = run_one(rl, [a, b])
        got.append(i)
        rl.release(i)
    assert got.count(a) == got.count(b) == 5


def test_priority_orders_instances_without_resources_too():
    rl = RateLimiter()
    a, b = inst(group("rate_limiter { priority: 3 }")), inst(group("rate_limiter { priority: 1 }"))
    rl.register(a)
    rl.register(b)
    assert rl.choose([a, b]) is b


# ------------------------------------------------------------------------ with VersionQueue
class Harness:
    def __init__(self, limiter: RateLimiter, model: str) -> None:
        self.now = 0
        self.sent: list[tuple[Instance, m.ExecuteBatch]] = []
        self.failed: list = []
        self.model = model
        self.q = VersionQueue(model, 1, BatcherConfig(dynamic=True, max_batch_size=1),
                              lambda i, msg, fr: self.sent.append((i, msg)),
                              lambda *a: self.failed.append(a), self._later, limiter=limiter,
                              clock=lambda: self.now)
        self._req = 0

    def _later(self, delay, cb):
        raise AssertionError("no timer expected")

    def enqueue(self) -> None:
        self._req += 1
        req = m.InferRequest(self._req, "tcp://r", self.model, 1, [])
        self.q.enqueue(Pending(b"f", req, [], arrival_ns=self.now))

    def done(self, i: Instance) -> None:
        batch_id, = [msg.batch_id for j, msg in self.sent if j is i and msg.batch_id in i.inflight]
        self.q.batch_done(i, batch_id)


def test_version_queue_runs_one_instance_at_a_time_on_one_resource():
    rl = RateLimiter()
    h = Harness(rl, "m")
    a, b = inst(needs(("R", 1))), inst(needs(("R", 1)))
    h.q.add_instance(a)
    h.q.add_instance(b)
    for _ in range(3):
        h.enqueue()
    assert [i for i, _ in h.sent] == [a]          # b is idle but R is taken
    h.done(a)
    assert len(h.sent) == 2
    h.done(h.sent[-1][0])
    assert len(h.sent) == 3
    assert rl.served[id(a)] + rl.served[id(b)] == 3


def test_version_queue_runs_both_with_the_flag():
    h = Harness(RateLimiter(["R:2"]), "m")
    a, b = inst(needs(("R", 1))), inst(needs(("R", 1)))
    h.q.add_instance(a)
    h.q.add_instance(b)
    for _ in range(3):
        h.enqueue()
    assert sorted(i.worker_id for i, _ in h.sent) == sorted([a.worker_id, b.worker_id])


def test_release_wakes_a_waiting_version_queue_of_another_model():
    rl = RateLimiter()
    h1, h2 = Harness(rl, "m1"), Harness(rl, "m2")
    a = inst(needs(("R", 1, True)), model="m1")
    b = inst(needs(("R", 1, True)), model="m2")
    h1.q.add_instance(a)
    h2.q.add_instance(b)
    h1.enqueue()
    h2.enqueue()
    assert len(h1.sent) == 1 and h2.sent == []    # m2 waits for R
    assert id(h2.q) in rl.waiting
    h1.done(a)                                    # release -> wake -> m2 pumps
    assert len(h2.sent) == 1 and rl.waiting == {}
    h1.enqueue()                                  # now m1 waits
    assert len(h1.sent) == 1
    h2.done(b)
    assert len(h1.sent) == 2


def test_worker_died_releases_its_resources():
    rl = RateLimiter()
    h = Harness(rl, "m")
    a, b = inst(needs(("R", 1))), inst(needs(("R", 1)))
    h.q.add_instance(a)
    h.q.add_instance(b)
    h.enqueue()
    h.enqueue()
    assert [i for i, _ in h.sent] == [a]
    h.q.worker_died(a, "gone")                    # frees R: b runs the queued request
    assert [i for i, _ in h.sent] == [a, b]
    assert id(a) not in rl.needs
    assert len(h.failed) == 1 and h.failed[0][2] == "gone"
