"""Load-time checks of ensemble configs, in Triton 2.51's words and order. Pure: no I/O.

Triton checks an ensemble in four stages; a load runs them in this order and stops at the
first error:
  1. `validate_ensemble`: the ensemble's own config (model_config_utils.cc:
     ValidateEnsembleSchedulingConfig, BuildEnsembleGraph), part of ValidateModelConfig;
  2. `missing_models_text`, then `circular_dependency_text`: the repository's dependency
     graph (model_repository_manager.cc: ConnectDependencyGraph, CircularDependencyCheck);
  3. the composing models' load results (CheckNode): `dependency_failed_text`,
     `no_loaded_version_text`, `version_not_loaded_text`;
  4. `validate_steps`: the steps against the composing models' completed configs
     (ensemble_scheduler/ensemble_utils.cc: ValidateEnsembleConfig, ValidateTensorMapping).

Triton keeps input_map / output_map in hash maps and iterates them in an unspecified order;
we iterate them sorted by key, so when a config has several faults the one reported is
always the same (Triton's qa accepts either of two texts where that order shows).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from protos import model_config_pb2 as mc
from services.common.errors import invalid_arg

ENSEMBLE = "ensemble"


def _items(m) -> list[tuple[str, str]]:
    return sorted(m.items())


# --------------------------------------------------------------- the ensemble's own config
class _Tensor:
    """A tensor of BuildEnsembleGraph: `prev` are the inputs of the step writing it."""
    __slots__ = ("name", "is_output", "ready", "prev", "next")

    def __init__(self, name: str, is_output: bool) -> None:
        self.name, self.is_output, self.ready = name, is_output, False
        self.prev: list[_Tensor] = []
        self.next: list[_Tensor] = []


def _build_graph(cfg: mc.ModelConfig) -> dict[str, _Tensor]:
    n = cfg.name
    tensors: dict[str, _Tensor] = {}  # insertion order stands in for Triton's hash order
    for i, step in enumerate(cfg.ensemble_scheduling.step):
        for field, present in (("model_name", step.model_name), ("input_map", step.input_map),
                               ("output_map", step.output_map)):
            if not present:
                raise invalid_arg(f"must specify '{field}' in step {i} of ensemble '{n}'")
        written = []
        for _, name in _items(step.output_map):
            node = tensors.get(name)
            if node is None:
                node = tensors[name] = _Tensor(name, True)
            elif node.is_output:
                raise invalid_arg(f"ensemble tensor '{name}' can appear in an output map only once "
                                  f"for ensemble '{n}' step {i}")
            node.is_output = True
            written.append(node)
        # Triton's "input '...' is mapped to multiple ensemble tensors" cannot happen here:
        # input_map is a map, so a key appears once (text_format keeps the last duplicate).
        for _, name in _items(step.input_map):
            node = tensors.setdefault(name, _Tensor(name, False))
            for out in written:
                out.prev.append(node)
                node.next.append(out)
    return tensors


def _not_written(node: _Tensor, ensemble: str) -> str:
    """Name the first unconnected tensor upstream of an unwritten output, as Triton does:
    follow the first not-ready input at each step back, never the same name twice."""
    text = f"output '{node.name}' for ensemble '{ensemble}' is not written"
    last, prev, seen = node, node.prev, set()
    while prev:
        cand = next((p for p in prev if not p.ready and p.name not in seen), None)
        if cand is None:
            break
        seen.add(cand.name)
        last, prev = cand, cand.prev
    if last.name != node.name:
        text += f": at least one of its depending tensors, '{last.name}', is not connected"
    return text


def validate_ensemble(cfg: mc.ModelConfig) -> None:
    """ValidateEnsembleSchedulingConfig (with the platform checks around its call in
    ValidateModelConfig): raises INVALID_ARG with Triton's text on the first problem."""
    n = cfg.name
    if not cfg.HasField("ensemble_scheduling"):
        if cfg.platform == ENSEMBLE:
            raise invalid_arg(f"ensemble scheduling must be set for ensemble {n} whose platform "
                              f"is {ENSEMBLE}")
        return
    if cfg.platform != ENSEMBLE:
        raise invalid_arg(f"ensemble scheduling cannot be set for model '{n}' whose platform is "
                          f"not {ENSEMBLE}")
    if cfg.instance_group:
        raise invalid_arg(f"instance group should not be specified for ensemble '{n}'")
    if cfg.HasField("optimization"):
        raise invalid_arg(f"optimization should not be specified for ensemble '{n}'")
    if cfg.model_warmup:
        raise invalid_arg(f"model_warmup can not be specified for ensemble '{n}'")
    if not cfg.ensemble_scheduling.step:
        raise invalid_arg(f"must specify 'step' for ensemble '{n}'")
    tensors = _build_graph(cfg)

    # Data flow from the ensemble inputs: a tensor is ready once all inputs of the step
    # writing it are. A cycle never becomes ready, so it fails one of the checks below.
    queue: deque[_Tensor] = deque()
    for io in cfg.input:
        node = tensors.get(io.name)
        if node is None:  # the stray quote is Triton's
            raise invalid_arg(f"ensemble input '{io.name}' for ensemble {n}' is not used")
        node.ready = True
        queue.append(node)
    while queue:
        for nxt in queue.popleft().next:
            if not nxt.ready and all(p.ready for p in nxt.prev):
                nxt.ready = True
                queue.append(nxt)
    outputs = set()
    for io in cfg.output:
        node = tensors.get(io.name)
        if node is None:
            raise invalid_arg(f"ensemble output '{io.name}' for ensemble {n}' is not used")
        if not node.ready:
            raise invalid_arg(_not_written(node, n))
        outputs.add(io.name)
    for name, node in tensors.items():
        if name not in outputs and (not node.ready or not node.next):
            raise invalid_arg(f"ensemble tensor '{name}' is unused in ensemble '{n}'")


def step_order(cfg: mc.ModelConfig) -> list[int]:
    """Step indexes, each after the steps writing its inputs; among the steps ready at once,
    the lowest index first (so a config listed in order keeps its order). Expects a config
    `validate_ensemble` accepted; raises ValueError if some step can never run."""
    steps = cfg.ensemble_scheduling.step
    writer = {t: i for i, s in enumerate(steps) for t in s.output_map.values()}
    available = {io.name for io in cfg.input}
    waiting = []  # per step, the step indexes it still waits for
    for s in steps:
        waiting.append({writer[t] for t in s.input_map.values()
                        if t not in available and t in writer})
    readers: dict[int, list[int]] = {}
    for i, deps in enumerate(waiting):
        for d in deps:
            readers.setdefault(d, []).append(i)
    heap = [i for i, deps in enumerate(waiting) if not deps]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        i = heapq.heappop(heap)
        order.append(i)
        for r in readers.get(i, ()):
            waiting[r].discard(i)
            if not waiting[r]:
                heapq.heappush(heap, r)
    if len(order) != len(steps):
        raise ValueError(f"steps of ensemble '{cfg.name}' depend on each other in a cycle")
    return order


# ------------------------------------------------------------------ the dependency graph
def missing_models_text(ensemble: str, missing: Sequence[str]) -> str:
    """Triton's text for an ensemble whose step models are not in the repository; `missing`
    in step order. Triton builds the list from its sorted set of missing names, but at the
    first missing step, when the set holds that one name, and never rewrites it."""
    return ("ensemble " + ensemble + " contains models that are not available or ambiguous: "
            + ", ".join(missing[:1]))


def circular_dependency_text(ensemble: str, configs: Mapping[str, Any]) -> str | None:
    """CircularDependencyCheck: `configs` maps model names to configs (the ensembles reachable
    from `ensemble` at least). The text when a chain of steps leads back to `ensemble`,
    naming the ensemble whose step closes the loop; None otherwise."""
    stack, seen = [ensemble], {ensemble}
    while stack:
        current = stack.pop()
        cfg = configs.get(current)
        if cfg is None or not cfg.HasField("ensemble_scheduling"):
            continue
        upstream = [s.model_name for s in cfg.ensemble_scheduling.step]
        if ensemble in upstream:
            return (f"circular dependency between ensembles: {ensemble} -> ... -> {current} "
                    f"-> {ensemble}")
        for name in reversed(upstream):
            if name not in seen:
                seen.add(name)
                stack.append(name)
    return None


def dependency_failed_text(ensemble: str, model: str, why: str) -> str:
    return (f"ensemble '{ensemble}' depends on '{model}' which is not valid. Model '{model}' "
            f"failed with error: {why}")


def no_loaded_version_text(ensemble: str, model: str, why: str | None = None) -> str:
    """`why`: the composing model's load error, None when its load succeeded."""
    text = f"ensemble '{ensemble}' depends on '{model}' which has no loaded version."
    return text if why is None else f"{text} Model '{model}' loading failed with error: {why}"


def version_not_loaded_text(ensemble: str, model: str, version: int) -> str:
    return f"ensemble '{ensemble}' depends on '{model}' whose required version {version} is not loaded."


# ------------------------------------------------------------- against the composing models
class _Node:
    """ensemble_utils.cc's TensorNode: the model that first gave the tensor a type and shape;
    `label` tells which decoupled step (0: none) its responses come from. A step's outputs
    share one symbolic `sibling`, so they carry one label."""
    __slots__ = ("model", "dtype", "dims", "full", "decoupled", "label", "visited", "prev", "next",
                 "sibling")

    def __init__(self, model: str, batching: bool = False, dtype: int = 0,
                 dims: Sequence[int] = ()) -> None:
        self.model, self.dtype, self.dims = model, dtype, list(dims)
        self.full = [-1, *self.dims] if batching else self.dims
        self.decoupled, self.label, self.visited = False, 0, False
        self.prev: list[_Node] = []
        self.next: list[_Node] = []
        self.sibling: _Node | None = None


def _dtype_name(dtype: int) -> str:
    return mc.DataType.Name(dtype) if dtype in mc.DataType.values() else ""


def _dims_text(dims: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def _same_dims(a: Sequence[int], b: Sequence[int]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b))


def _check_consistent(lhs: _Node, rhs: _Node, pre: str) -> None:
    if lhs.dtype != rhs.dtype:
        raise invalid_arg(f"{pre}inconsistent data type: {_dtype_name(lhs.dtype)} is inferred from "
                          f"model {lhs.model} while {_dtype_name(rhs.dtype)} is inferred from model "
                          f"{rhs.model}")
    # A tensor may pass between a batching model ([d...] plus the batch) and a non-batching
    # one ([-1, d...]): equal full shapes are enough. Wildcards are checked at run time.
    if not _same_dims(lhs.dims, rhs.dims) and not _same_dims(lhs.full, rhs.full):
        raise invalid_arg(f"{pre}inconsistent shape: {_dims_text(lhs.full)} is inferred from model "
                          f"{lhs.model} while {_dims_text(rhs.full)} is inferred from model {rhs.model}")


def _map_step(ensemble: str, step, model: mc.ModelConfig, tensors: dict[str, _Node]) -> None:
    """ValidateTensorMapping. Its 'mapped to multiple ensemble tensors' and 'multiple outputs
    ... are mapped to the same ensemble tensor' cannot happen: map keys are unique, and so are
    a validated model's input and output names."""
    name, batching = step.model_name, model.max_batch_size > 0
    pre = f"in ensemble {ensemble}, "
    in_map, out_map = _items(step.input_map), _items(step.output_map)
    inputs = {io.name for io in model.input}
    for key, tensor in in_map:
        if key not in inputs:
            raise invalid_arg(f"{pre}ensemble tensor {tensor} is mapping to non-existing input {key} "
                              f"in model {name}")
    for io in model.input:
        tensor = step.input_map.get(io.name)
        if tensor is None:
            if io.optional:
                continue
            raise invalid_arg(f"{pre}input {io.name} in model {name} is not mapped to any ensemble "
                              "tensors")
        node = _Node(name, batching, io.data_type, io.dims)
        if tensor in tensors:
            _check_consistent(tensors[tensor], node, f"{pre}ensemble tensor {tensor}: ")
        else:
            tensors[tensor] = node
    outputs = {io.name: io for io in model.output}
    for key, tensor in out_map:
        if key not in outputs:
            raise invalid_arg(f"{pre}ensemble tensor {tensor} is mapped from non-existing output "
                              f"{key} in model {step.model_name}")
    sibling = _Node(name)
    for key, tensor in out_map:
        io = outputs[key]
        node = _Node(name, batching, io.data_type, io.dims)
        if tensor in tensors:
            _check_consistent(tensors[tensor], node, f"{pre}ensemble tensor {tensor}: ")
        else:
            tensors[tensor] = node
        tensors[tensor].sibling = sibling
    for _, tensor in out_map:
        node = tensors[tensor]
        node.decoupled = model.model_transaction_policy.decoupled
        for _, source in in_map:
            node.prev.append(tensors[source])
            tensors[source].next.append(node)


def _check_steps(cfg: mc.ModelConfig, composing: Mapping[str, Any]) -> bool:
    """ValidateEnsembleConfig; returns whether responses can come from a decoupled step."""
    ens, batching = cfg.name, cfg.max_batch_size > 0
    steps = cfg.ensemble_scheduling.step
    missing = [s.model_name for s in steps if s.model_name not in composing]
    if missing:  # Triton fails these before it gets here
        raise invalid_arg(missing_models_text(ens, missing))
    tensors: dict[str, _Node] = {}
    for io in cfg.input:
        dims = io.reshape.shape if io.HasField("reshape") else io.dims
        tensors.setdefault(io.name, _Node(ens, batching, io.data_type, dims))
    sink = _Node(ens)  # the response: all ensemble outputs must come from one decoupled step
    for io in cfg.output:
        dims = io.reshape.shape if io.HasField("reshape") else io.dims
        node = tensors.setdefault(io.name, _Node(ens, batching, io.data_type, dims))
        sink.prev.append(node)
        node.next.append(sink)
    for step in steps:
        model: mc.ModelConfig = composing[step.model_name]
        # A batching ensemble may hold non-batching models (max_batch_size 0).
        if model.max_batch_size != 0 and model.max_batch_size < cfg.max_batch_size:
            raise invalid_arg(f"ensemble {ens} allows maximum batch size {cfg.max_batch_size}, but it "
                              f"contains model {step.model_name} which only allows maximum batch size "
                              f"to be {model.max_batch_size}")
        _map_step(ens, step, model, tensors)

    # Walk the data flow, labelling each tensor with the decoupled step its responses come
    # from: a step (or the response) fed from two decoupled steps could not pair them up.
    label = 0
    queue = deque(tensors[io.name] for io in cfg.input)
    for node in queue:
        node.visited = True
    while queue:
        for nxt in queue.popleft().next:
            if nxt.visited or not all(p.visited for p in nxt.prev):
                continue
            first = nxt.prev[0].label
            if any(p.label != first for p in nxt.prev):
                raise invalid_arg(f"in ensemble {ens}, step of model '{nxt.model}' receives inputs "
                                  "originated from different decoupled models")
            sib = nxt.sibling
            if sib is not None and sib.visited:
                nxt.label = sib.label
            else:
                if nxt.decoupled:
                    label += 1
                nxt.label = label if nxt.decoupled else first
                if sib is not None:
                    sib.label, sib.visited = nxt.label, True
            nxt.visited = True
            queue.append(nxt)
    return label != 0


def validate_steps(cfg: mc.ModelConfig, composing: Mapping[str, Any]) -> None:
    """The ensemble's steps against `composing` (step model name -> that model's completed
    config): raises INVALID_ARG with Triton's text on the first problem."""
    _check_steps(cfg, composing)


def ensemble_labels(cfg: mc.ModelConfig, own: Mapping[str, list[str]],
                    composing: Mapping[str, Mapping[str, list[str]]]) -> dict[str, list[str]]:
    """The label lines of each ensemble output (classification), as Triton completes an
    ensemble's LabelProvider at load (model_lifecycle.cc): the ensemble's own label_filename
    lines (``own``), else those of the composing model output its step maps to that ensemble
    output. ``composing``: step model name -> its labels, themselves completed when it is an
    ensemble (so labels travel through ensembles of ensembles)."""
    labels = dict(own)
    outputs = {io.name for io in cfg.output}
    for step in cfg.ensemble_scheduling.step:
        for key, tensor in _items(step.output_map):
            if tensor in outputs and tensor not in labels:
                found = composing.get(step.model_name, {}).get(key)
                if found:
                    labels[tensor] = found
    return labels


def is_decoupled(cfg: mc.ModelConfig, composing: Mapping[str, Any]) -> bool:
    """What Triton writes into the ensemble's model_transaction_policy.decoupled once
    `validate_steps` passes: whether a decoupled step's responses reach the ensemble."""
    return _check_steps(cfg, composing)
