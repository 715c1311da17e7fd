"""What the ModelManager (lifecycle.py) keeps per model: its entry, the state of each
version, and the ModelInfo frontends are answered with, rendered from an entry."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protos import model_config_pb2 as mc
from services.common import config as cfgmod
from services.common import messages as m
from services.common.canary import version_split
from services.common.datatypes import config_to_api
from services.common.repository import model_key
from services.common.states import ModelState
from services.scheduler.dispatch import Instance
from services.scheduler.queues import SchedulingQueue
from services.scheduler.routes import chain

READY, LOADING, UNAVAILABLE, UNLOADING = (ModelState.READY, ModelState.LOADING,
                                          ModelState.UNAVAILABLE, ModelState.UNLOADING)


def is_unloaded(reason: str) -> bool:
    """A version's reason says it was unloaded (by a request, or evicted: memory.py)."""
    return reason.startswith("unloaded")


@dataclass
class VersionState:
    version: int
    state: ModelState = LOADING
    reason: str = ""
    queue: SchedulingQueue | None = None


@dataclass
class ModelEntry:
    name: str
    path: Path | None = None
    config: Any = None                        # completed mc.ModelConfig once loaded
    versions: dict[int, VersionState] = field(default_factory=dict)
    state: ModelState | None = None           # model-level state when no version exists
    reason: str = ""
    info: m.ModelInfo | None = None           # cached answer for frontends
    instances: list[Instance] = field(default_factory=list)
    fingerprint: str = ""                     # repository.fingerprint() when last (re)loaded
    override_dir: Path | None = None          # temp model dir of a load's "file:" parameters
    composing: list[str] = field(default_factory=list)   # an ensemble's step models' keys
    namespace: str = ""                       # its repository, with --model-namespacing
    # output -> its label_filename lines (classification), read at load: a file that cannot
    # be read fails the load, as in Triton; an ensemble's come from its steps' models too
    labels: dict[str, list[str]] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Its identity in the ModelManager (repository.model_key): the name, or with
        --model-namespacing "<repository>::<name>"."""
        return model_key(self.namespace, self.name)

    def ready_version(self, version: int) -> VersionState | None:
        if version == 0:
            ready = [v for v in self.versions.values() if v.state == READY]
            return max(ready, key=lambda v: v.version) if ready else None
        vs = self.versions.get(version)
        return vs if vs is not None and vs.state == READY else None


def _io_specs(ios, max_batch_size: int) -> list[m.IOSpec]:
    return [m.IOSpec(io.name, config_to_api(mc.DataType.Name(io.data_type)),
                     cfgmod.input_shape(io, max_batch_size),
                     bool(getattr(io, "optional", False))) for io in ios]


def model_info(entry: ModelEntry) -> m.ModelInfo:
    versions = {v: s.state for v, s in entry.versions.items()}
    cfg = entry.config
    if cfg is None:
        return m.ModelInfo(0, entry.name, versions=versions)
    split, sticky = version_split(cfg)   # (checked at load: config.validate)
    return m.ModelInfo(
        0, entry.name, platform=cfg.platform or cfg.backend, backend=cfg.backend,
        versions=versions, max_batch_size=cfg.max_batch_size,
        inputs=_io_specs(cfg.input, cfg.max_batch_size),
        outputs=_io_specs(cfg.output, cfg.max_batch_size),
        config_json=json.dumps(cfgmod.config_to_json(cfg), separators=(",", ":")),
        decoupled=cfg.model_transaction_policy.decoupled,
        probe_ready=any(i.probe for i in entry.instances),
        labels=entry.labels,
        # (step names resolve in the frontend's one namespace: none with namespacing)
        chain=[] if entry.namespace else chain(cfg),
        split=split, sticky=sticky)
