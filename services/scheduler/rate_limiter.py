"""The rate limiter (--rate-limit execution_count): an instance executes only while the
resources its instance group names are free, across every model of the server.

Triton's rules, kept here:
- a resource is counted per device unless the instance group marks it `global`;
  CPU instances count on device -1;
- `--rate-limit-resource name:count[:device]` sets how many exist (no device: on every
  device); an unset resource has as many as the largest single requirement, so every
  instance can run alone;
- among instances that could run, `priority` weights the choice: an instance with
  priority 2 gets half the executions of one with priority 1 (0 counts as 1).
With the limiter off (the default) resources are ignored and any idle instance runs.
"""
from __future__ import annotations

from typing import Any


class RateLimiter:
    def __init__(self, flags: list[str] | None = None) -> None:
        self.limits: dict[tuple[str, int | None], int] = {}   # from the flags
        for spec in flags or []:
            name, count, device = parse_resource(spec)
            self.limits[(name, device)] = count
        self.needs: dict[int, list[tuple[tuple[str, int], int]]] = {}   # id(inst) -> [(key, count)]
        self.weights: dict[int, int] = {}
        self.served: dict[int, int] = {}      # executions granted, for priority weighting
        self.used: dict[tuple[str, int], int] = {}
        self.largest: dict[tuple[str, int], int] = {}
        self.waiting: dict[int, Any] = {}     # id(queue) -> VersionQueue held back by resources

    # ------------------------------------------------------------------ instances
    def register(self, inst: Any) -> None:
        group = inst.config
        rl = group.rate_limiter if group is not None and group.HasField("rate_limiter") else None
        device = inst.device_id if inst.kind == "KIND_GPU" else -1
        needs = []
        for r in (rl.resources if rl is not None else ()):
            key = (r.name, -2 if getattr(r, "global") else device)
            needs.append((key, r.count))
            self.largest[key] = max(self.largest.get(key, 0), r.count)
        self.needs[id(inst)] = needs
        self.weights[id(inst)] = max(rl.priority, 1) if rl is not None else 1
        self.served.setdefault(id(inst), 0)

    def unregister(self, inst: Any) -> None:
        for d in (self.needs, self.weights, self.served):
            d.pop(id(inst), None)
        # Triton recomputes the defaults from the instances left (UpdateResourceLimits).
        self.largest = {}
        for needs in self.needs.values():
            for key, n in needs:
                self.largest[key] = max(self.largest.get(key, 0), n)

    def available(self, key: tuple[str, int]) -> int:
        name, device = key
        # Triton takes the largest count given: for a global resource, over every device's
        # flag; for a device's, over its own flag and the per-device one.
        counts = [c for (n, d), c in self.limits.items()
                  if n == name and (device == -2 or d is None or d == device)]
        return max(counts) if counts else self.largest.get(key, 0)

    def _fits(self, inst: Any) -> bool:
        return all(self.used.get(k, 0) + n <= self.available(k) for k, n in self.needs.get(id(inst), ()))

    # ------------------------------------------------------------------ execution
    def choose(self, idle: list[Any], queue: Any = None) -> Any:
        """The idle instance to run next, or None; a queue left waiting is pumped again when
        resources come back."""
        best = None
        best_score = None
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


def parse_resource(spec: str) -> tuple[str, int, int | None]:
    """`name:count[:device]` from --rate-limit-resource."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise ValueError(f"invalid --rate-limit-resource '{spec}': expected name:count[:device]")
    try:
        count = int(parts[1])
        device = int(parts[2]) if len(parts) == 3 else None
    except ValueError:
        raise ValueError(f"invalid --rate-limit-resource '{spec}': count and device must be "
                         f"integers") from None
    return parts[0], count, device
