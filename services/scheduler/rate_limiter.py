"""The rate limiter (--rate-limit execution_count): an instance executes only while the
resources its instance group names are free, across every model of the server.

Triton's rules (core src/rate_limiter.cc), kept here:
- a resource is counted per device unless the instance group marks it `global`; CPU (and
  MODEL) instances are on device 0, as Triton creates them (backend_model_instance.cc);
- `--rate-limit-resource name:count[:device]` sets how many exist; no device, or device -1,
  means on every device; the same name and device given twice keeps the smaller count
  (TritonServerOptions::AddRateLimiterResource). A device's count is the larger of its own
  flag and the every-device one; a global resource's is the largest flag of that name;
- with no flag at all, a resource has as many as the largest single requirement, so every
  instance can run alone. Once any flag is given, a resource no flag names has none;
- loading an instance fails when a resource has fewer than some instance needs, or is
  global for one instance and per-device for another (UpdateResourceLimits): check();
- among instances that could run, `priority` weights the choice: an instance with
  priority 2 gets half the executions of one with priority 1 (0 counts as 1).
With the limiter off (the default) resources are ignored and any idle instance runs.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from services.common.errors import invalid_arg, load_failed_text

GLOBAL = -2        # Triton's GLOBAL_RESOURCE_KEY
PER_DEVICE = -1    # Triton's PER_DEVICE_RESOURCE_KEY: a flag without device, or device -1
Key = tuple[str, int]   # (resource name, device or GLOBAL)


class RateLimiter:
    def __init__(self, flags: list[str] | None = None) -> None:
        self.limits: dict[Key, int] = {}   # from the flags, keyed by (name, device or PER_DEVICE)
        for spec in flags or []:
            name, count, device = parse_resource(spec)
            key = (name, device)
            self.limits[key] = min(count, self.limits.get(key, count))
        self.needs: dict[int, list[tuple[Key, int]]] = {}   # id(inst) -> [(key, count)]
        self.weights: dict[int, int] = {}
        self.served: dict[int, int] = {}      # executions granted, for priority weighting
        self.used: dict[Key, int] = {}
        self.largest: dict[Key, int] = {}     # largest requirement of the registered instances
        self.waiting: dict[int, Any] = {}     # id(queue) -> VersionQueue held back by resources
        self._available: dict[Key, int] = {}  # available() memo; cleared when `largest` changes

    # ------------------------------------------------------------------ instances
    def register(self, inst: Any) -> None:
        needs, weight = requirements(inst.config, inst.kind, inst.device_id)
        for key, n in needs:
            self.largest[key] = max(self.largest.get(key, 0), n)
        self.needs[id(inst)] = needs
        self.weights[id(inst)] = weight
        self.served.setdefault(id(inst), 0)
        self._available.clear()

    def unregister(self, inst: Any) -> None:
        for d in (self.needs, self.weights, self.served):
            d.pop(id(inst), None)
        # Triton recomputes the defaults from the instances left (UpdateResourceLimits).
        self.largest = {}
        for needs in self.needs.values():
            for key, n in needs:
                self.largest[key] = max(self.largest.get(key, 0), n)
        self._available.clear()

    def check(self, model: str, instances: Iterable[tuple[int, Any, str, int]]) -> None:
        """Raise the load failure Triton's RegisterModelInstance gives, if registering these
        instances ((version, instance group, kind, device) each, in load order) would fail.
        Registers nothing."""
        largest = dict(self.largest)
        for version, group, kind, device in instances:
            for key, n in requirements(group, kind, device)[0]:
                largest[key] = max(largest.get(key, 0), n)
            why = self._invalid(largest)
            if why:
                raise invalid_arg(load_failed_text(model, version, why))

    def _invalid(self, largest: dict[Key, int]) -> str:
        """Triton's ParseAndValidateExplicitResources then ValidateMaxResources, over the
        largest requirements, in its map order (device, then name)."""
        order = sorted(largest, key=lambda k: (k[1], k[0]))
        if self.limits:
            for key in order:
                have = self._count(key)
                if have < largest[key]:
                    return (f'Resource count for "{key[0]}" is limited to {have} which will '
                            f'prevent scheduling of one or more model instances, the minimum '
                            f'required count is {largest[key]}')
        for gname, gdev in order:
            if gdev == GLOBAL and any(n == gname and d != GLOBAL for n, d in order):
                return (f'Resource "{gname}" is present as both global and device-specific '
                        f'resource in the model configuration.')
        return ""

    def _count(self, key: Key) -> int:
        """How many the flags give: a global resource, the largest flag of its name on any
        device; a device's, the larger of its own flag and the every-device one; 0 unnamed."""
        name, device = key
        return max((c for (n, d), c in self.limits.items()
                    if n == name and (device == GLOBAL or d == PER_DEVICE or d == device)),
                   default=0)

    def available(self, key: Key) -> int:
        have = self._available.get(key)
        if have is None:
            have = self._available[key] = (self._count(key) if self.limits
                                           else self.largest.get(key, 0))
        return have

    def _fits(self, inst: Any) -> bool:
        return all(self.used.get(k, 0) + n <= self.available(k) for k, n in self.needs.get(id(inst), ()))

    # ------------------------------------------------------------------ execution
    def choose(self, idle: list[Any], queue: Any = None) -> Any:
        """The idle instance to run next, or None; a queue left waiting is pumped again when
        resources come back."""
        best = None
        best_score = 0        # read only once best is set
        for inst in idle:
            if not self._fits(inst):
                continue
            score = (self.served.get(id(inst), 0) + 1) * self.weights.get(id(inst), 1)
            if best is None or score < best_score:
                best, best_score = inst, score
        if best is None and queue is not None:
            self.waiting[id(queue)] = queue
        return best

    def acquire(self, inst: Any) -> None:
        for k, n in self.needs.get(id(inst), ()):
            self.used[k] = self.used.get(k, 0) + n
        self.served[id(inst)] = self.served.get(id(inst), 0) + 1

    def release(self, inst: Any) -> None:
        for k, n in self.needs.get(id(inst), ()):
            self.used[k] = self.used.get(k, 0) - n
        self.wake()

    def wake(self) -> None:
        """Let held-back queues try again, the best-weighted first."""
        if not self.waiting:
            return
        queues = list(self.waiting.values())
        self.waiting.clear()
        queues.sort(key=lambda q: min(((self.served.get(id(i), 0) + 1) * self.weights.get(id(i), 1)
                                       for i in q.idle), default=0))
        for q in queues:
            q.pump()


def requirements(group: Any, kind: str, device: int) -> tuple[list[tuple[Key, int]], int]:
    """An instance's resource needs [(key, count)] and its priority weight, from its
    inference.ModelInstanceGroup. A name given twice keeps the last count, as Triton's map."""
    rl = group.rate_limiter if group is not None and group.HasField("rate_limiter") else None
    if rl is None:
        return [], 1
    dev = device if kind == "KIND_GPU" else 0
    needs: dict[Key, int] = {}
    for r in rl.resources:
        needs[(r.name, GLOBAL if getattr(r, "global") else dev)] = r.count
    return list(needs.items()), max(rl.priority, 1)


def parse_resource(spec: str) -> tuple[str, int, int]:
    """`name:count[:device]` from --rate-limit-resource, as (name, count, device); no device
    is PER_DEVICE (-1), the value Triton's parser gives it, so `R:2` and `R:2:-1` agree."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise ValueError("--rate-limit-resource option format is '<resource_name>:<count>:"
                         f"<device>' or '<resource_name>:<count>'. Got {spec}")
    numbers = []
    for part in parts[1:]:
        try:
            numbers.append(int(part))
        except ValueError:
            raise ValueError(f"Invalid option value. Got {part}") from None
    count, device = numbers if len(numbers) == 2 else (numbers[0], PER_DEVICE)
    if count < 0:
        # Triton's size_t would wrap it to a huge count; a negative count is a typo.
        raise ValueError(f"--rate-limit-resource count must not be negative. Got {spec}")
    return parts[0], count, device
