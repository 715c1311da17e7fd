"""What the tool learns about the model from the server (perf_analyzer's ModelParser): its
inputs and outputs, batching, scheduler kind, decoupled policy, response cache, and the
composing models of an ensemble (whose statistics are reported under it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.perf.clients import Control


class ModelError(Exception):
    """The model cannot be measured as asked; the message says why."""


@dataclass
class Tensor:
    name: str
    datatype: str              # KServe names: FP32, BYTES, ...
    dims: list[int]            # without the batch dimension; -1 where variable
    optional: bool = False


@dataclass
class ModelInfo:
    name: str
    version: str               # the version measured (the latest ready one when -x is absent)
    max_batch_size: int
    inputs: list[Tensor]
    outputs: list[Tensor]
    scheduler: str             # none, dynamic, sequence, ensemble, ensemble_sequence
    decoupled: bool = False
    response_cache: bool = False
    composing: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    """ensemble name -> its steps' (model, version or "") in step order, for every ensemble
    under this model (nested ensembles included)."""

    @property
    def is_sequence(self) -> bool:
        return self.scheduler in ("sequence", "ensemble_sequence")

    @property
    def is_ensemble(self) -> bool:
        return self.scheduler.startswith("ensemble")


def _ints(values) -> list[int]:
    return [int(v) for v in values or []]


def _scheduler(cfg: dict) -> str:
    if cfg.get("ensemble_scheduling"):
        return "ensemble"
    if cfg.get("sequence_batching") is not None:
        return "sequence"
    if cfg.get("dynamic_batching") is not None:
        return "dynamic"
    return "none"


def _steps(cfg: dict) -> list[tuple[str, str]]:
    out = []
    for step in (cfg.get("ensemble_scheduling") or {}).get("step", []):
        v = int(step.get("model_version", -1))
        out.append((step["model_name"], "" if v < 0 else str(v)))
    return out


def _latest(meta: dict) -> str:
    versions = meta.get("versions") or []
    try:
        return str(max(int(v) for v in versions)) if versions else "1"
    except ValueError:
        return str(versions[-1])


def load(control: Control, model: str, version: str, batch_size: int) -> ModelInfo:
    """Read the model's metadata and config; ModelError names what does not fit (perf_analyzer's
    text where it has one)."""
    try:
        meta = control.model_metadata(model, version)
    except Exception as e:   # noqa: BLE001  (tritonclient raises its own and transport errors)
        raise ModelError(f"failed to get model metadata: {e}") from None
    try:
        cfg = control.model_config(model, version)
    except Exception as e:   # noqa: BLE001
        raise ModelError(f"failed to get model config: {e}") from None
    mbs = int(cfg.get("max_batch_size", 0))
    optional = {i["name"] for i in cfg.get("input", []) if i.get("optional")}

    def tensors(entries) -> list[Tensor]:
        out = []
        for t in entries or []:
            dims = _ints(t.get("shape"))
            if mbs > 0 and dims:
                dims = dims[1:]   # (the metadata's shape starts with the batch dimension, -1)
            out.append(Tensor(t["name"], t["datatype"], dims, t["name"] in optional))
        return out

    info = ModelInfo(name=model, version=version or _latest(meta), max_batch_size=mbs,
                     inputs=tensors(meta.get("inputs")), outputs=tensors(meta.get("outputs")),
                     scheduler=_scheduler(cfg),
                     decoupled=bool((cfg.get("model_transaction_policy") or {}).get("decoupled")),
                     response_cache=bool((cfg.get("response_cache") or {}).get("enable")))
    if info.is_ensemble:
        _composing(control, model, cfg, info)
    if mbs == 0 and batch_size > 1:
        raise ModelError("can not specify batch size > 1 as the model does not support batching")
    if info.is_sequence and batch_size > 1:
        raise ModelError("can not specify batch size > 1 when using a sequence model")
    if mbs > 0 and batch_size > mbs:
        raise ModelError(f"the batch size {batch_size} is larger than the model's "
                         f"max_batch_size {mbs}")
    return info


def _composing(control: Control, name: str, cfg: dict, info: ModelInfo, depth: int = 0) -> None:
    """Every ensemble's steps, recursively; a step that is itself a sequence model makes
    the whole an ensemble_sequence (perf_analyzer: sequence ids are then sent)."""
    if depth > 16:
        raise ModelError(f"ensemble '{info.name}' nests more than 16 levels deep")
    steps = _steps(cfg)
    info.composing[name] = steps
    for model, version in steps:
        try:
            sub = control.model_config(model, version)
        except Exception as e:   # noqa: BLE001
            raise ModelError(f"failed to get the config of composing model '{model}': {e}") \
                from None
        kind = _scheduler(sub)
        if kind == "sequence":
            info.scheduler = "ensemble_sequence"
        elif kind == "ensemble" and model not in info.composing:
            _composing(control, model, sub, info, depth + 1)
