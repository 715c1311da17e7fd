"""The configurations a sweep tries: each a copy of the model's own configuration (as the
server answers /v2/models/m/config) with the swept fields set."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Variant:
    instances: int
    max_batch_size: int
    dynamic: bool
    delay_us: int

    @property
    def key(self) -> str:
        """Its name in results.json and the report."""
        batching = f"dyn{self.delay_us}us" if self.dynamic else "nodyn"
        return f"i{self.instances}_mbs{self.max_batch_size}_{batching}"

    def config(self, base: dict[str, Any]) -> dict[str, Any]:
        """The model's configuration with this variant's fields (JSON, as the repository
        API's load takes it)."""
        cfg = copy.deepcopy(base)
        cfg.pop("dynamic_batching", None)
        cfg["max_batch_size"] = self.max_batch_size
        groups = cfg.get("instance_group") or [{"kind": "KIND_CPU"}]
        first = dict(groups[0])
        first["count"] = self.instances
        first.pop("name", None)
        cfg["instance_group"] = [first]
        if self.dynamic:
            cfg["dynamic_batching"] = {"max_queue_delay_microseconds": str(self.delay_us)}
        return cfg


def sweep(base: dict[str, Any], instance_counts: list[int], max_batch_sizes: list[int] | None,
          dynamic: list[bool], delays_us: list[int]) -> list[Variant]:
    """Every combination that means something: dynamic batching only where a batch can hold
    more than one request, a queue delay only with dynamic batching."""
    batches = int(base.get("max_batch_size", 0) or 0)
    if max_batch_sizes is None:
        max_batch_sizes = [1, 4, 16] if batches > 0 else [0]
    out: list[Variant] = []
    for n in instance_counts:
        for mbs in max_batch_sizes:
            for dyn in dynamic:
                if dyn and mbs <= 1:
                    continue
                for delay in delays_us if dyn else [0]:
                    out.append(Variant(max(1, n), mbs, dyn, delay))
    return list(dict.fromkeys(out))


def refusal(base: dict[str, Any], max_batch_sizes: list[int] | None) -> str | None:
    """Why this model cannot be swept as asked, or None."""
    if base.get("platform") == "ensemble" or base.get("ensemble_scheduling"):
        return "an ensemble has no instances or batching of its own: analyze its steps' models"
    if base.get("sequence_batching"):
        return "a sequence model's batching is its sequence batcher's: not swept"
    batches = int(base.get("max_batch_size", 0) or 0)
    if batches == 0 and max_batch_sizes and any(b > 0 for b in max_batch_sizes):
        return ("the model does not batch (max_batch_size 0): its inputs have no batch "
                "dimension, so --max-batch-sizes must be 0")
    return None
