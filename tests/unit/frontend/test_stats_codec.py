"""Statistics extension: ModelStat -> Triton's HTTP JSON and gRPC ModelStatisticsResponse.

Imports only our generated protos (never tritonclient's), so this module is safe in any
pytest process.
"""
from __future__ import annotations

from google.protobuf import json_format

from protos import grpc_service_pb2 as pb
from services.common.messages import BatchStat, Duration, ModelStat
from services.frontend.stats_codec import stats_to_json, stats_to_proto

STAT = ModelStat("m", "3", last_inference=1700000000123, inference_count=5, execution_count=2,
                 success=Duration(2, 900), queue=Duration(2, 100),
                 compute_input=Duration(2, 10), compute_infer=Duration(2, 500),
                 compute_output=Duration(2, 20),
                 batch_stats=[BatchStat(1, Duration(1, 4), Duration(1, 200), Duration(1, 8)),
                              BatchStat(4, Duration(1, 6), Duration(1, 300), Duration(1, 12))])


def test_json_is_tritons_layout():
    zero = {"count": 0, "ns": 0}
    assert stats_to_json([STAT]) == {"model_stats": [{
        "name": "m", "version": "3", "last_inference": 1700000000123, "inference_count": 5,
        "execution_count": 2,
        "inference_stats": {"success": {"count": 2, "ns": 900}, "fail": zero,
                            "queue": {"count": 2, "ns": 100},
                            "compute_input": {"count": 2, "ns": 10},
                            "compute_infer": {"count": 2, "ns": 500},
                            "compute_output": {"count": 2, "ns": 20},
                            "cache_hit": zero, "cache_miss": zero},
        "response_stats": {},
        "batch_stats": [
            {"batch_size": 1, "compute_input": {"count": 1, "ns": 4},
             "compute_infer": {"count": 1, "ns": 200}, "compute_output": {"count": 1, "ns": 8}},
            {"batch_size": 4, "compute_input": {"count": 1, "ns": 6},
             "compute_infer": {"count": 1, "ns": 300}, "compute_output": {"count": 1, "ns": 12}}],
        "memory_usage": []}]}
    assert list(stats_to_json([STAT])["model_stats"][0]) == [
        "name", "version", "last_inference", "inference_count", "execution_count",
        "inference_stats", "response_stats", "batch_stats", "memory_usage"]
    assert stats_to_json([]) == {"model_stats": []}


def test_proto_matches_json():
    proto = stats_to_proto([STAT, ModelStat("idle", "1")])
    assert proto == json_format.ParseDict(stats_to_json([STAT, ModelStat("idle", "1")]),
                                          pb.ModelStatisticsResponse())
    idle = proto.model_stats[1]
    for field in ("success", "fail", "queue", "compute_input", "compute_infer",
                  "compute_output", "cache_hit", "cache_miss"):   # sent even when zero
        assert idle.inference_stats.HasField(field)
    assert pb.ModelStatisticsResponse.FromString(proto.SerializeToString()) == proto
