"""services.scheduler.rate_limiter: resource specs, per-device and global counts, priority
weighting, and waking the VersionQueues it held back. Instances carry a real
inference.ModelInstanceGroup as their config; VersionQueues run on a fake clock and timers."""

from __future__ import annotations

import asyncio

import pytest
from google.protobuf import text_format

from protos import model_config_pb2 as mc
from services.common import messages as m
from services.common.errors import Code, TriremeError
from services.scheduler.batcher import BatcherConfig
from services.scheduler.dispatch import Instance, Pending, VersionQueue
from services.scheduler.lifecycle import ModelManager
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
    assert parse_resource("R1:2") == ("R1", 2, -1)
    assert parse_resource("R1:2:0") == ("R1", 2, 0)
    assert parse_resource("gpu_mem:10:3") == ("gpu_mem", 10, 3)


def test_device_minus_one_is_every_device_like_no_device():
    # Triton's parser gives a flag without device the device -1 (PER_DEVICE_RESOURCE_KEY).
    assert parse_resource("R:2:-1") == parse_resource("R:2")
    for flags in (["R:2:-1"], ["R:2"]):
        rl = RateLimiter(flags)
        gs = [inst(needs(("R", 1), kind="KIND_GPU"), kind="KIND_GPU", device=d)
              for d in (0, 0, 1, 1)]
        for i in gs:
            rl.register(i)
        assert rl.available(("R", 0)) == rl.available(("R", 1)) == 2
        assert [run_one(rl, [i]) for i in gs] == gs


FORMAT = ("--rate-limit-resource option format is '<resource_name>:<count>:<device>' or "
          "'<resource_name>:<count>'. Got ")


@pytest.mark.parametrize("spec, why", [
    ("R1", FORMAT + "R1"),
    ("R1:2:0:1", FORMAT + "R1:2:0:1"),
    (":2", FORMAT + ":2"),
    ("", FORMAT),
    ("R1:two", "Invalid option value. Got two"),
    ("R1:2:gpu0", "Invalid option value. Got gpu0"),
    ("R1::0", "Invalid option value. Got "),
    ("R1:-1", "--rate-limit-resource count must not be negative. Got R1:-1"),
])
def test_parse_resource_rejects_bad_specs(spec, why):
    with pytest.raises(ValueError) as ei:
        parse_resource(spec)
    assert str(ei.value) == why


def test_bad_flag_fails_the_limiter():
    with pytest.raises(ValueError, match="option format is .* Got R$"):
        RateLimiter(["R"])


def test_the_same_flag_twice_keeps_the_smaller_count():
    # Triton's TritonServerOptions::AddRateLimiterResource: "store the minimum of the two".
    rl = RateLimiter(["R:3", "R:1", "R:2", "S:2:0", "S:5:0"])
    assert rl.limits == {("R", -1): 1, ("S", 0): 2}


# ------------------------------------------------------------------------ resources
def test_default_availability_is_the_largest_single_requirement():
    rl = RateLimiter()
    a, b = inst(needs(("R", 1))), inst(needs(("R", 1)))
    rl.register(a)
    rl.register(b)
    assert rl.available(("R", 0)) == 1
    assert run_one(rl, [a, b]) is a
    assert run_one(rl, [b]) is None               # R is taken: only one runs at a time
    rl.release(a)
    assert run_one(rl, [b]) is b


def test_largest_requirement_lets_every_instance_run_alone():
    rl = RateLimiter()
    small, big = inst(needs(("R", 1))), inst(needs(("R", 3)))
    rl.register(small)
    rl.register(big)
    assert rl.available(("R", 0)) == 3
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


def test_cpu_instances_count_on_device_zero_as_in_triton():
    # Triton creates KIND_CPU and KIND_MODEL instances with device_id 0: they share device
    # 0's resources with the GPU 0 instances, and a device-0 flag counts for them.
    rl = RateLimiter(["R:2:0"])
    cpu, gpu0 = inst(needs(("R", 1))), inst(needs(("R", 1), kind="KIND_GPU"), kind="KIND_GPU")
    model = inst(needs(("R", 1)), kind="KIND_MODEL", device=3)
    for i in (cpu, gpu0, model):
        rl.register(i)
    assert rl.needs[id(cpu)] == rl.needs[id(model)] == [(("R", 0), 1)]
    assert run_one(rl, [cpu]) is cpu and run_one(rl, [gpu0]) is gpu0
    assert run_one(rl, [model]) is None           # device 0 has two R, both taken


def test_device_specific_flag():
    rl = RateLimiter(["R:2:0", "R:1:1"])
    g0a, g0b, g1a, g1b = (inst(needs(("R", 1), kind="KIND_GPU"), kind="KIND_GPU", device=d)
                          for d in (0, 0, 1, 1))
    for i in (g0a, g0b, g1a, g1b):
        rl.register(i)
    assert rl.available(("R", 0)) == 2 and rl.available(("R", 1)) == 1
    assert run_one(rl, [g0a]) is g0a and run_one(rl, [g0b]) is g0b
    assert run_one(rl, [g1a]) is g1a and run_one(rl, [g1b]) is None


def test_once_a_flag_is_given_an_unnamed_resource_or_device_has_none():
    # Triton (ParseAndValidateExplicitResources): "If not specified explicitly, consider
    # the resource to be unavailable."
    rl = RateLimiter(["R:2:0"])
    assert rl.available(("R", 0)) == 2
    assert rl.available(("R", 1)) == 0 and rl.available(("S", 0)) == 0
    assert RateLimiter().available(("S", 0)) == 0    # no flags: the largest requirement


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
    assert rl.used == {("A", 0): 1, ("B", 0): 1}
    rl.release(both)
    assert rl.used == {("A", 0): 0, ("B", 0): 0}


def test_unregistered_requirement_no_longer_sets_the_default():
    # Triton recomputes the default counts (UpdateResourceLimits) when an instance goes.
    rl = RateLimiter()
    big, a, b = inst(needs(("R", 2))), inst(needs(("R", 1))), inst(needs(("R", 1)))
    for i in (big, a, b):
        rl.register(i)
    assert rl.available(("R", 0)) == 2
    rl.unregister(big)
    assert rl.available(("R", 0)) == 1
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


# ------------------------------------------------------------------------ load-time check
LIMITED = ('Resource count for "{}" is limited to {} which will prevent scheduling of one or '
           'more model instances, the minimum required count is {}')
BOTH = 'Resource "{}" is present as both global and device-specific resource in the model configuration.'


def check_error(rl: RateLimiter, *instances, model: str = "m") -> str:
    """check()'s failure text ("" when the instances would load)."""
    try:
        rl.check(model, instances)
    except TriremeError as e:
        assert e.code == Code.INVALID_ARG
        return e.message
    return ""


def cpu(*resources, version: int = 1):
    return (version, needs(*resources), "KIND_CPU", 0)


def gpu(device: int, *resources, version: int = 1):
    return (version, needs(*resources, kind="KIND_GPU"), "KIND_GPU", device)


def test_check_refuses_an_instance_needing_more_than_the_flag_gives():
    rl = RateLimiter(["R:1"])
    assert check_error(rl, cpu(("R", 1))) == ""
    assert check_error(rl, cpu(("R", 1)), cpu(("R", 2), version=3)) == \
        "failed to load 'm' version 3: " + LIMITED.format("R", 1, 2)
    assert rl.needs == {} and rl.largest == {}    # it registers nothing


def test_check_without_flags_lets_any_count_load():
    assert check_error(RateLimiter(), cpu(("R", 100)), gpu(1, ("S", 7, True))) == ""


def test_check_resource_no_flag_names_is_limited_to_zero():
    assert check_error(RateLimiter(["R:4"]), cpu(("S", 1))) == \
        "failed to load 'm' version 1: " + LIMITED.format("S", 0, 1)


def test_check_per_device_and_device_flags():
    rl = RateLimiter(["R:4:0"])                   # device 1 has no R
    assert check_error(rl, gpu(0, ("R", 4))) == ""
    assert check_error(rl, gpu(1, ("R", 1))) == "failed to load 'm' version 1: " + LIMITED.format("R", 0, 1)
    for flag in ("R:2:-1", "R:2"):              # every device
        rl = RateLimiter(["R:4:0", flag])
        assert check_error(rl, gpu(1, ("R", 2)), gpu(0, ("R", 4))) == ""
        assert check_error(rl, gpu(1, ("R", 3))) == \
            "failed to load 'm' version 1: " + LIMITED.format("R", 2, 3)


def test_check_global_resource_counts_the_largest_flag_of_any_device():
    rl = RateLimiter(["R:1:0", "R:3:1"])
    assert check_error(rl, gpu(0, ("R", 3, True))) == ""
    assert check_error(rl, gpu(0, ("R", 4, True))) == \
        "failed to load 'm' version 1: " + LIMITED.format("R", 3, 4)


def test_check_reports_the_first_resource_in_triton_map_order():
    # max_resources_ is a std::map by device (global -2 first), then by name.
    rl = RateLimiter(["A:1", "B:1", "C:1"])
    assert check_error(rl, gpu(1, ("B", 5), ("A", 5), ("C", 5, True))) == \
        "failed to load 'm' version 1: " + LIMITED.format("C", 1, 5)
    assert check_error(rl, gpu(1, ("B", 5), ("A", 5))) == \
        "failed to load 'm' version 1: " + LIMITED.format("A", 1, 5)
    # ... and fails at the first instance that cannot register, in load order.
    assert check_error(rl, gpu(1, ("B", 5), version=2), gpu(0, ("A", 5))) == \
        "failed to load 'm' version 2: " + LIMITED.format("B", 1, 5)


def test_check_counts_instances_already_registered():
    rl = RateLimiter(["R:1"])
    rl.register(inst(needs(("R", 1))))
    assert check_error(rl, cpu(("R", 1))) == ""


def test_check_refuses_a_resource_both_global_and_per_device():
    rl = RateLimiter()
    assert check_error(rl, cpu(("R", 1, True)), cpu(("R", 1))) == \
        "failed to load 'm' version 1: " + BOTH.format("R")
    rl.register(inst(needs(("R", 1), kind="KIND_GPU"), kind="KIND_GPU", device=2, model="a"))
    assert check_error(rl, cpu(("R", 1, True)), model="b") == \
        "failed to load 'b' version 1: " + BOTH.format("R")
    # The explicit counts are checked first.
    assert check_error(RateLimiter(["R:1"]), cpu(("R", 1, True)), cpu(("R", 2))) == \
        "failed to load 'm' version 1: " + LIMITED.format("R", 1, 2)


# ------------------------------------------------------------------------ ...as a load failure
CONFIG = '''backend: "python"
max_batch_size: 4
input [{{ name: "IN", data_type: TYPE_FP32, dims: [2] }}]
output [{{ name: "OUT", data_type: TYPE_FP32, dims: [2] }}]
instance_group [{{ kind: KIND_CPU, count: 2, rate_limiter {{ resources [{} ] }} }}]
'''


class Loader:
    """A ModelManager over a real repository with fake workers: spawn_instance returns the
    config at once, or waits for `gate` when one is set."""

    def __init__(self, root, limiter: RateLimiter | None) -> None:
        self.spawned: list[Instance] = []
        self.gate = None
        self.limiter = limiter
        self.mm = ModelManager([root], spawn_instance=self._spawn, stop_instance=self._stop,
                               make_queue=self._queue, changed=lambda names: None,
                               limiter=limiter)

    async def _spawn(self, inst, blob, model_dir, autocomplete):
        self.spawned.append(inst)
        if self.gate is not None:
            await self.gate.wait()
        return mc.ModelConfig.FromString(blob)

    async def _stop(self, inst) -> None:
        if self.limiter is not None:
            self.limiter.unregister(inst)

    def _queue(self, model, version, cfg):
        return VersionQueue(model, version, BatcherConfig.from_model_config(cfg), lambda *a: None,
                            lambda *a: None, lambda *a: None, limiter=self.limiter)

    def state(self, name: str) -> tuple[str, str]:
        e, = [e for e in self.mm.index(False) if e.name == name]
        return e.state, e.reason


def write_model(root, name: str, resource: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text("")
    (root / name / "config.pbtxt").write_text(CONFIG.format(resource))


def test_load_fails_with_triton_text_before_any_worker_starts(tmp_path):
    write_model(tmp_path, "big", '{ name: "R", count: 2 }')
    write_model(tmp_path, "small", '{ name: "R", count: 1 }')
    ld = Loader(tmp_path, RateLimiter(["R:1"]))

    async def run():
        ld.mm.scan()
        with pytest.raises(TriremeError) as e:
            await ld.mm.load("big")
        await ld.mm.load("small")
        return e.value

    err = asyncio.run(run())
    text = "failed to load 'big' version 1: " + LIMITED.format("R", 1, 2)
    assert (err.code, err.message) == (Code.INVALID_ARG, text)
    assert ld.state("big") == ("UNAVAILABLE", text)
    assert ld.state("small") == ("READY", "")
    assert [i.model for i in ld.spawned] == ["small", "small"]


def test_without_the_limiter_resources_do_not_stop_a_load(tmp_path):
    write_model(tmp_path, "big", '{ name: "R", count: 2 }')
    ld = Loader(tmp_path, None)

    async def run():
        ld.mm.scan()
        await ld.mm.load("big")

    asyncio.run(run())
    assert ld.state("big") == ("READY", "")


def test_a_conflict_registered_while_workers_started_fails_the_load(tmp_path):
    """Both loads pass the check before their workers start; the one registering second
    fails (Triton checks as it registers each instance)."""
    write_model(tmp_path, "g", '{ name: "R", count: 1, global: true }')
    write_model(tmp_path, "d", '{ name: "R", count: 1 }')
    ld = Loader(tmp_path, RateLimiter())

    async def run():
        ld.gate = asyncio.Event()
        ld.mm.scan()
        loads = [asyncio.ensure_future(ld.mm.load(n)) for n in ("g", "d")]
        while len(ld.spawned) < 2:                # both first instances are starting
            await asyncio.sleep(0)
        ld.gate.set()
        return await asyncio.gather(*loads, return_exceptions=True)

    ok, err = asyncio.run(run())
    assert ok is None
    assert err.message == "failed to load 'd' version 1: " + BOTH.format("R")
    assert ld.state("g")[0] == "READY" and ld.state("d")[0] == "UNAVAILABLE"
    assert {k for k in ld.limiter.largest} == {("R", -2)}
