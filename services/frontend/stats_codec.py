"""Statistics extension: the scheduler's ModelStat records -> Triton's HTTP JSON and gRPC
ModelStatisticsResponse. One module for both renderings so that they stay field for field
alike (the HTTP body is the JSON that Triton's core writes in TRITONSERVER_ServerModelStatistics).

Trireme keeps no per-response statistics (decoupled models) and no memory accounting yet:
`response_stats` is always empty and `memory_usage` always [], as Triton answers for a model
that reports neither.
"""
from __future__ import annotations

from collections.abc import Iterable

from protos import grpc_service_pb2 as pb
from services.common.messages import Duration, ModelStat

__all__ = ["stats_to_json", "stats_to_proto"]

# inference_stats keys, in Triton's order; each is a ModelStat attribute of the same name.
_INFER_KEYS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
               "cache_hit", "cache_miss")


def _duration(d: Duration) -> dict:
    return {"count": d.count, "ns": d.ns}


def stats_to_json(stats: Iterable[ModelStat]) -> dict:
    """-> {"model_stats": [...]} in Triton's key order (HTTP GET .../stats)."""
    return {"model_stats": [{
        "name": s.name,
        "version": s.version,
        "last_inference": s.last_inference,
        "inference_count": s.inference_count,
        "execution_count": s.execution_count,
        "inference_stats": {k: _duration(getattr(s, k)) for k in _INFER_KEYS},
        "response_stats": {},
        "batch_stats": [{
            "batch_size": b.batch_size,
            "compute_input": _duration(b.compute_input),
            "compute_infer": _duration(b.compute_infer),
            "compute_output": _duration(b.compute_output),
        } for b in s.batch_stats],
        "memory_usage": [],
    } for s in stats]}


def _set(target: pb.StatisticDuration, d: Duration) -> None:
    target.SetInParent()   # present even when zero, as Triton sends every duration
    target.count = d.count
    target.ns = d.ns


def stats_to_proto(stats: Iterable[ModelStat]) -> pb.ModelStatisticsResponse:
    """-> ModelStatisticsResponse (gRPC ModelStatistics)."""
    resp = pb.ModelStatisticsResponse()
    for s in stats:
        out = resp.model_stats.add(name=s.name, version=s.version,
                                   last_inference=s.last_inference,
                                   inference_count=s.inference_count,
                                   execution_count=s.execution_count)
        infer = out.inference_stats
        for k in _INFER_KEYS:
            _set(getattr(infer, k), getattr(s, k))
        for b in s.batch_stats:
            bs = out.batch_stats.add(batch_size=b.batch_size)
            _set(bs.compute_input, b.compute_input)
            _set(bs.compute_infer, b.compute_infer)
            _set(bs.compute_output, b.compute_output)
    return resp
