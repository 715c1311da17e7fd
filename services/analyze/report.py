"""What `trireme analyze` makes of its results: the configurations ranked (the best
throughput at a concurrency whose p99 keeps within the budget), the table it prints, the
winner's config.pbtxt and report.html with its plots."""
from __future__ import annotations

import base64
import html
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BREAKDOWN = (("client_send_us", "client send"), ("network_us", "network + server send/recv"),
             ("queue_us", "queue"), ("compute_input_us", "compute input"),
             ("compute_infer_us", "compute infer"), ("compute_output_us", "compute output"),
             ("client_recv_us", "client recv"))


@dataclass
class Ranked:
    key: str
    variant: dict[str, Any]
    best: dict[str, Any] | None      # the level chosen (None: none within the budget)


def rank(results: dict[str, Any], budget_ms: float | None) -> list[Ranked]:
    """Every measured configuration, best first; those with no level within the budget
    last (by their best p99)."""
    out = []
    for key, r in results["variants"].items():
        levels = [lv for lv in r.get("levels", [])
                  if budget_ms is None or lv["p99_us"] <= budget_ms * 1000]
        best = max(levels, key=lambda lv: lv["throughput"]) if levels else None
        out.append(Ranked(key, r["variant"], best))
    within = sorted((x for x in out if x.best is not None),
                    key=lambda x: -(x.best or {}).get("throughput", 0.0))
    over = [x for x in out if x.best is None]
    return within + over


def table(ranked: list[Ranked], budget_ms: float | None) -> str:
    head = ("rank", "configuration", "instances", "max_batch_size", "dynamic batching",
            "best concurrency", "infer/s", "p99 ms", "stable")
    rows = []
    for i, r in enumerate(ranked, 1):
        v = r.variant
        dyn = f"on, {v['delay_us']} us" if v["dynamic"] else "off"
        if r.best is None:
            rows.append((str(i), r.key, str(v["instances"]), str(v["max_batch_size"]), dyn,
                         "—", "—", f"over {budget_ms:g}" if budget_ms else "—", "—"))
            continue
        b = r.best
        rows.append((str(i), r.key, str(v["instances"]), str(v["max_batch_size"]), dyn,
                     str(b["concurrency"]), f"{b['throughput']:,.1f}", f"{b['p99_us'] / 1000:.2f}",
                     "yes" if b["stable"] else "no"))
    widths = [max(len(h), *(len(row[c]) for row in rows)) if rows else len(h)
              for c, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def config_pbtxt(config: dict[str, Any]) -> str:
    """A JSON configuration (as the server answers it) as config.pbtxt text."""
    from google.protobuf import text_format

    from services.common.config import config_from_json
    return str(text_format.MessageToString(config_from_json(config)))


# ---------------------------------------------------------------------- the report

def _plots(results: dict[str, Any], ranked: list[Ranked], budget_ms: float | None,
           out: Path) -> list[tuple[str, Path]]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[tuple[str, Path]] = []
    fig, ax = plt.subplots(figsize=(10, 5))
    for r in ranked:
        levels = sorted(results["variants"][r.key].get("levels", []), key=lambda lv: lv["concurrency"])
        if levels:
            ax.plot([lv["p99_us"] / 1000 for lv in levels], [lv["throughput"] for lv in levels],
                    marker="o", label=r.key)
    if budget_ms is not None:
        ax.axvline(budget_ms, color="red", linestyle="--", label=f"budget {budget_ms:g} ms")
    ax.set_xlabel("p99 latency (ms)")
    ax.set_ylabel("throughput (infer/s)")
    ax.set_title(f"{results['model']}: throughput against p99, one point per concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    made.append(_save(fig, out / "throughput_vs_p99.png", "Throughput against p99 latency"))

    shown = [r for r in ranked if r.best is not None]
    if shown:
        fig, ax = plt.subplots(figsize=(10, 0.5 * len(shown) + 1.5))
        left = [0.0] * len(shown)
        for field, label in BREAKDOWN:
            values = [float(r.best[field]) if r.best else 0.0 for r in shown]
            ax.barh([r.key for r in shown], values, left=left, label=label)
            left = [a + b for a, b in zip(left, values)]
        ax.set_xlabel("µs per request, at each configuration's best concurrency")
        ax.set_title("Latency breakdown")
        ax.invert_yaxis()
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        made.append(_save(fig, out / "latency_breakdown.png", "Latency breakdown"))

        win = shown[0]
        sizes = results["variants"][win.key].get("batch_sizes", {})
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar([str(k) for k in sorted(sizes, key=int)], [sizes[k] for k in sorted(sizes, key=int)])
        ax.set_xlabel("batch size (up to)")
        ax.set_ylabel("executions")
        ax.set_title(f"{win.key}: the batch sizes it ran (nv_inference_batch_size)")
        made.append(_save(fig, out / "batch_sizes.png", "Batch sizes of the best configuration"))
    return made


def _save(fig: Any, path: Path, title: str) -> tuple[str, Path]:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return title, path


def write_report(results: dict[str, Any], ranked: list[Ranked], budget_ms: float | None,
                 out: Path) -> Path:
    plots = _plots(results, ranked, budget_ms, out)
    winner = ranked[0] if ranked and ranked[0].best is not None else None
    parts = ["<!doctype html><meta charset='utf-8'>",
             f"<title>trireme analyze: {html.escape(results['model'])}</title>",
             "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
             "td,th{padding:2px 8px;text-align:right}th{text-align:left}</style>",
             f"<h1>{html.escape(results['model'])}</h1>",
             f"<p>Latency budget (p99): {budget_ms:g} ms.</p>" if budget_ms is not None
             else "<p>No latency budget: ranked by throughput.</p>"]
    if winner is not None:
        parts.append(f"<p>Best: <b>{html.escape(winner.key)}</b>, "
                     f"{winner.best['throughput']:,.1f} infer/s at concurrency "
                     f"{winner.best['concurrency']}, p99 {winner.best['p99_us'] / 1000:.2f} ms "
                     "(config.pbtxt beside this report).</p>" if winner.best else "")
    parts.append("<pre>" + html.escape(table(ranked, budget_ms)) + "</pre>")
    for title, path in plots:
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<h2>{html.escape(title)}</h2><img alt='{html.escape(path.name)}' "
                     f"src='data:image/png;base64,{data}'>")
    if winner is not None:
        parts.append("<h2>config.pbtxt</h2><pre>" + html.escape(
            config_pbtxt(results["variants"][winner.key]["config"])) + "</pre>")
    path = out / "report.html"
    path.write_text("\n".join(parts))
    return path
