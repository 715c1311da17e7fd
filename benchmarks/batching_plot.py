"""Dynamic-batching benchmark (see batching.py): the Markdown tables and the plot."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batching_runs import CONFIGS, ORT_BATCHES, TARGET_RATIO, Run, stats_summary

# --------------------------------------------------------------------------- tables

def fmt(v: float | None, spec: str = ",.3f", none: str = "n/a") -> str:
    return none if v is None else format(v, spec)


def load_table(runs: list[Run]) -> str:
    out = ["| configuration | model | conc. | infer/s | p50 ms | p99 ms | errors | "
           "requests (wrk / server ok) | mean batch (stats) | mean batch (metrics) | "
           "largest batch (executions) | worker compute_infer µs/row @ largest | "
           "… all batches | notes |",
           "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        s = stats_summary(r.stats)
        notes = []
        if r.wrk_threads != 2:
            notes.append(f"wrk -t{r.wrk_threads}")
        if not r.count_ok:
            notes.append("**server success count does not match wrk**")
        if r.other_cpu_pct > 20:
            notes.append(f"**contended: other processes {r.other_cpu_pct:.0f}% of a core**")
        errs = (f"{r.errors + r.server_fail:.0f}" if r.ok or not r.count_ok else
                f"**{r.errors} client, {r.server_fail:.0f} server**")
        largest = (f"{s['largest']} ({s['largest_execs']:,})" if "largest" in s else "n/a")
        out.append(
            f"| {r.label} | {r.model} | {r.concurrency} | {r.throughput:,.0f} | "
            f"{r.p50_ms:.3f} | {r.p99_ms:.3f} | {errs} | {r.requests:,} / {r.server_ok:,.0f} | "
            f"{fmt(s.get('mean_batch'), '.2f')} | {fmt(r.metrics_mean_batch, '.2f')} | "
            f"{largest} | {fmt(s.get('us_per_row'), ',.1f')} | "
            f"{fmt(s.get('us_per_row_all'), ',.1f')} | {'; '.join(notes)} |")
    return "\n".join(out)


def ort_table(ort: dict[int, dict]) -> str:
    out = ["| batch | ms per batch (mean) | p50 ms | p99 ms | µs per row | rows/s |",
           "|---:|---:|---:|---:|---:|---:|"]
    for bs, o in sorted(ort.items()):
        out.append(f"| {bs} | {o['ms_per_batch']:.3f} | {o['p50_ms']:.3f} | {o['p99_ms']:.3f} | "
                   f"{o['us_per_row']:.1f} | {o['rows_per_s']:,.0f} |")
    return "\n".join(out)


def ratio_rows(runs: list[Run], ort: dict[int, dict]) -> list[dict]:
    rows = []
    for r in runs:
        s = stats_summary(r.stats)
        if "largest" not in s or s["largest"] not in ort:
            continue
        base = ort[s["largest"]]["us_per_row"]
        rows.append({"model": r.model, "label": r.label, "concurrency": r.concurrency,
                     "batch": s["largest"], "executions": s["largest_execs"],
                     "worker_us_per_row": s["us_per_row"], "inprocess_us_per_row": base,
                     "ratio": s["us_per_row"] / base})
    return rows


def ratio_table(rows: list[dict]) -> str:
    out = ["| configuration | conc. | batch size (largest) | executions | worker µs/row | "
           "in-process µs/row | ratio | target |",
           "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        tgt = ""
        if r["batch"] == 64 and r["executions"] < 20:
            tgt = "(too few executions to judge)"
        elif r["batch"] == 64:
            tgt = f"≤ {TARGET_RATIO}×: " + ("yes" if r["ratio"] <= TARGET_RATIO else "**MISS**")
        out.append(f"| {r['label']} | {r['concurrency']} | {r['batch']} | {r['executions']:,} | "
                   f"{r['worker_us_per_row']:.1f} | {r['inprocess_us_per_row']:.1f} | "
                   f"{r['ratio']:.2f}× | {tgt} |")
    return "\n".join(out)


# --------------------------------------------------------------------------- plot

def plot(runs: list[Run], ort: dict[int, dict], conc: list[int], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.6))
    styles = {"mlp_off_x1": ("tab:blue", "--", "o"), "mlp_on_x1": ("tab:blue", "-", "s"),
              "mlp_off_x2": ("tab:orange", "--", "o"), "mlp_on_x2": ("tab:orange", "-", "s")}
    for c in CONFIGS:
        rs = sorted((r for r in runs if r.model == c.name), key=lambda r: r.concurrency)
        if not rs:
            continue
        color, ls, mk = styles[c.name]
        xs = [r.concurrency for r in rs]
        a1.plot(xs, [r.throughput for r in rs], color=color, ls=ls, marker=mk, label=c.label)
        a2.plot(xs, [r.p99_ms for r in rs], color=color, ls=ls, marker=mk, label=c.label)
    # The in-process ceiling as text: as lines they would flatten the measured ones.
    ceil = [f"batch {bs}: {ort[bs]['rows_per_s']:,.0f} rows/s" for bs in ORT_BATCHES if bs in ort]
    if ceil:
        a1.text(0.02, 0.98, "in-process onnxruntime (ceiling)\n" + "\n".join(ceil),
                transform=a1.transAxes, va="top", fontsize=8, color="dimgray")
    for ax, ylabel in ((a1, "throughput (infer/s)"), (a2, "p99 latency (ms)")):
        ax.set_xscale("log")
        ax.set_xticks(conc)
        ax.set_xticklabels([str(c) for c in conc])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (wrk connections, batch-1 requests)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    a1.set_ylim(bottom=0)
    a2.set_yscale("log")
    a1.set_title("throughput")
    a2.set_title("p99 latency")
    a1.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
