"""An ensemble request's tensors, kept alike by both places that run ensembles: the
scheduler's ensemble queue (scheduler/ensemble.py) and a frontend's chains
(dataplane/chain.py). Tensors are never copied: a step's input or an answer's output is a
new TensorRef over the same bytes, an inline frame or the same shared-memory block.

As in Triton (core ensemble_scheduler.cc), a tensor can be there without data (ABSENT): an
optional ensemble input the request left out, or an output a step did not produce. It
counts as there for the steps that read it (a step runs once each of its inputs is there,
and is sent without the absent ones: its model says whether it may do without), and the
answer leaves it out.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from services.common import messages as m

Tensors = dict[str, tuple[m.TensorRef | None, Any]]   # ensemble tensor -> (ref, inline data)
ABSENT: tuple[None, None] = (None, None)   # a tensor there without data (see above)


def request_tensors(inputs: Iterable[m.TensorRef], frames: list[Any],
                    optional: Iterable[str]) -> Tensors:
    """An ensemble request's tensors: its inputs, and ``optional`` ensemble inputs it left
    out, ABSENT."""
    tensors: Tensors = {t.name: (t, frames[t.frame] if t.frame >= 0 else None) for t in inputs}
    for name in optional:
        tensors.setdefault(name, ABSENT)
    return tensors


def renamed(ref: m.TensorRef, name: str, data: Any, frames: list[Any]) -> m.TensorRef:
    """``ref`` under ``name``; inline data goes to the end of ``frames``."""
    new = m.TensorRef(name, ref.datatype, ref.shape, ref.nbytes,
                      segment=ref.segment, offset=ref.offset, key=ref.key)
    if not ref.segment and not ref.key:
        new.frame = len(frames)
        frames.append(data)
    return new


def step_inputs(input_map: Mapping[str, str], tensors: Tensors) -> tuple[list[m.TensorRef], list[Any]]:
    """A step's inputs (``input_map``: step input -> ensemble tensor) and their frames."""
    inputs: list[m.TensorRef] = []
    frames: list[Any] = []
    for step_input, name in input_map.items():
        ref, data = tensors[name]
        if ref is not None:
            inputs.append(renamed(ref, step_input, data, frames))
    return inputs, frames


def take_outputs(result: m.InferResult, frames: list[Any], output_map: Mapping[str, str],
                 tensors: Tensors, blocks: set[tuple[str, int]],
                 release: Callable[[list[tuple[str, int]]], None]) -> None:
    """A step's outputs become ensemble tensors (``output_map``: step output -> ensemble
    tensor); their blocks join ``blocks``, those of outputs no tensor takes are released.
    The tensors of outputs the step did not produce are ABSENT."""
    produced = set()
    for o in result.outputs:
        name = output_map.get(o.name)
        if name is None:
            if o.segment:
                release([(o.segment, o.offset)])
            continue
        produced.add(o.name)
        tensors[name] = (o, frames[o.frame] if o.frame >= 0 else None)
        if o.segment:
            blocks.add((o.segment, o.offset))
    for output, name in output_map.items():
        if output not in produced:
            tensors[name] = ABSENT


def answer_outputs(names: Iterable[str], tensors: Tensors
                   ) -> tuple[list[m.TensorRef], list[Any], set[tuple[str, int]]]:
    """The answer's outputs (those of ``names`` there are, with data), their frames, and the
    blocks that go out with them (the frontend hands those back)."""
    outputs: list[m.TensorRef] = []
    frames: list[Any] = []
    sent: set[tuple[str, int]] = set()
    for name in names:
        ref, data = tensors.get(name, ABSENT)
        if ref is not None:
            if ref.segment:
                sent.add((ref.segment, ref.offset))
            outputs.append(renamed(ref, name, data, frames))
    return outputs, frames, sent


def sequence_echo(params: Mapping[str, Any], outputs: list[m.TensorRef]) -> dict[str, Any]:
    """What Triton's ensemble answers carry of the request's sequence flags: all three, as
    the request set them (a string sequence id as a string) or their defaults, 0 and false,
    when it did not; none in an answer without outputs (Triton 2.51 writes them with each
    output it sets), over HTTP and gRPC."""
    if not outputs:
        return {}
    return {"sequence_id": params.get("sequence_id", 0),
            "sequence_start": params.get("sequence_start") is True,
            "sequence_end": params.get("sequence_end") is True}


def deadlock_text(request_id: str) -> str:
    """Triton's error when no step is left to run and no requested output is there."""
    prefix = f"[request id: {request_id}] " if request_id else ""
    return (f"{prefix}unexpected deadlock, at least one output is not set while no more "
            "ensemble steps can be made")

