"""Load-time rules of `batch_input` / `batch_output` (Triton's ValidateBatchIO), shared by
the scheduler's config validation and the worker that generates them
(services/workers/batch_io.py)."""
from __future__ import annotations

from protos import model_config_pb2 as mc
from services.common.errors import invalid_arg


def validate_batch_io(cfg: mc.ModelConfig) -> None:
    """Triton's ValidateBatchIO (texts and " for <model>" included), plus what Triton leaves
    to fail later: a target input named twice, or named like a model input."""
    sfx, inputs = f" for {cfg.name}", {io.name for io in cfg.input}
    outputs = {io.name for io in cfg.output}
    inputs_seen: set[str] = set()
    outputs_seen: set[str] = set()
    for kinds, ios, what in ((mc.BatchInput.Kind, cfg.batch_input, "input"),
                             (mc.BatchOutput.Kind, cfg.batch_output, "output")):
        for b in ios:
            if b.kind not in kinds.values():
                raise invalid_arg(f"unknown batch {what} kind '{b.kind}'{sfx}")
            if len(b.source_input) != 1:
                raise invalid_arg(f"batch {what} kind '{kinds.Name(b.kind)}' expects 1 source input, "
                                 f"got {len(b.source_input)}{sfx}")
            if what == "input" and b.data_type not in (mc.TYPE_INT32, mc.TYPE_FP32):
                raise invalid_arg(f"batch input data type must be TYPE_INT32 or TYPE_FP32{sfx}")
            for source in b.source_input:
                if source not in inputs:
                    raise invalid_arg(f"unknown source input name '{source}'{sfx}")
            for t in b.target_name:
                if what == "output" and t not in outputs:
                    raise invalid_arg(f"unknown target output name '{t}'{sfx}")
                if what == "input" and t in inputs:
                    raise invalid_arg(f"target input name '{t}' is also the name of a model input{sfx}")
                seen = inputs_seen if what == "input" else outputs_seen
                if t in seen:
                    raise invalid_arg(f"target {what} name '{t}' can only be specified once{sfx}")
                seen.add(t)
