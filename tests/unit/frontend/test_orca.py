"""services.frontend.http.orca: the endpoint-load-metrics header, as Triton's orca_http.cc
writes it and its qa/L0_orca/orca_http_test.py parses it."""
from __future__ import annotations

import json

from services.frontend.http.orca import endpoint_load_metrics, header_value, kv_cache_metrics

TEXT = """# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="llm",version="1"} 64
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="llm",version="1"} 3
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="llm",version="1"} 12
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="llm",version="1"} 9
nv_inference_count{model="llm",version="1"} 5
"""


def parse_like_tritons_qa(header: str, fmt: str) -> dict:
    """qa/L0_orca/orca_http_test.py parse_header_data."""
    if fmt == "json":
        return json.loads(header.replace("JSON ", ""))["named_metrics"]
    data = {}
    for kv in header.replace("TEXT ", "").split(", "):
        key, value = kv.split("=")
        prefix, nested = key.split(".", 1)
        if prefix == "named_metrics":
            data[nested] = float(value)
    return data


def test_kv_metrics_from_the_exposition_text():
    assert kv_cache_metrics(TEXT) == (0.25, 768.0)
    assert kv_cache_metrics(TEXT.replace('"max"', '"maximum"')) is None     # one missing
    assert kv_cache_metrics(TEXT.replace("} 12", "} 0")) == (0.0, 0.0)      # max 0: no division


def test_header_formats_as_triton():
    assert header_value("json", 0.25, 768.0) == \
        'JSON {"named_metrics":{"kv_cache_utilization":0.25,"max_token_capacity":768}}'
    assert header_value("text", 0.25, 768.0) == \
        "TEXT named_metrics.kv_cache_utilization=0.250000, named_metrics.max_token_capacity=768"
    assert header_value("xml", 0.25, 768.0) is None


def test_qa_parser_reads_both_formats():
    for fmt in ("json", "text"):
        data = parse_like_tritons_qa(endpoint_load_metrics(fmt, TEXT) or "", fmt)
        assert data == {"kv_cache_utilization": 0.25, "max_token_capacity": 768}


def test_no_header_without_format_or_metrics():
    assert endpoint_load_metrics(None, TEXT) is None
    assert endpoint_load_metrics("yaml", TEXT) is None
    assert endpoint_load_metrics("json", "nv_inference_count 1\n") is None
