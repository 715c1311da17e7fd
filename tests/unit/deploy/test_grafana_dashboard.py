"""deploy/grafana/trireme-dashboard.json: valid, laid out, and every series it queries is one
the scheduler's /metrics serves (names taken from the rendering code, not retyped)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from services.scheduler import metrics, metrics_host
from services.scheduler.metrics_config import FIRST_RESPONSE

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "trireme-dashboard.json"


def served_names() -> set[str]:
    families = set(metrics.COUNTERS) | {FIRST_RESPONSE, metrics.HISTOGRAM[0],
                                        "trireme_frontend_requests"}
    families |= {name for name, _ in metrics.SUMMARY_FAMILIES}
    families |= {name for name, _ in metrics_host.CPU_GAUGES + metrics_host.GPU_GAUGES}
    out = set(families)
    for f in families:
        out |= {f + "_bucket", f + "_sum", f + "_count"}
    return out


def panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def test_every_query_names_a_served_series():
    names = served_names()
    exprs = [t["expr"] for p in panels() for t in p["targets"]]
    assert exprs
    for e in exprs:
        for used in re.findall(r"\b(?:nv|trireme)_\w+", e):
            assert used in names, (used, e)


def test_it_covers_what_operators_look_at():
    text = DASHBOARD.read_text()
    for family in ("nv_inference_request_success", "nv_inference_request_failure",
                   "nv_inference_request_summary_us", f"{FIRST_RESPONSE}_bucket",
                   "nv_inference_queue_duration_us", "nv_inference_batch_size_bucket",
                   "nv_inference_pending_request_count", "nv_cpu_utilization"):
        assert family in text, family
    assert "sum by (model, reason)" in text      # failures by reason


def test_layout_ids_and_model_variable():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource", "model"]
