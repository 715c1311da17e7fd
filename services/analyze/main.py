"""`trireme analyze`: the run (see the package docstring)."""
from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.analyze.flags import parser
from services.analyze.measure import AnalyzeError, Target, run_perf
from services.analyze.report import config_pbtxt, rank, table, write_report
from services.analyze.variants import Variant, refusal, sweep


def _load_results(path: Path, model: str) -> dict[str, Any]:
    """An earlier run's results, to resume (a different model's: an error)."""
    if not path.exists():
        return {"model": model, "variants": {}}
    try:
        results = json.loads(path.read_text())
    except ValueError as e:
        raise AnalyzeError(f"{path} cannot be read ({e}): remove it to start again") from None
    if results.get("model") != model:
        raise AnalyzeError(f"{path} holds the results of model '{results.get('model')}': "
                           "use another --output")
    return dict(results)


def _save(path: Path, results: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(path)


def _progress(total: int, done: int, enabled: bool):
    """A rich progress bar over the measurements (or a stand-in that does nothing)."""
    if not enabled:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), transient=True)
    bar.start()
    bar.add_task("measuring", total=total, completed=done)
    return bar


def run(args: Any) -> int:
    out: Path = args.output
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results = _load_results(results_path, args.model)
    target = Target(args.model_repository, args.model, args.url, out / "server.log")
    try:
        target.start()
        target.ensure_loaded()
        base = results.get("base") or target.base_config()
        results["base"] = base
        why = refusal(base, args.max_batch_sizes)
        if why is not None:
            raise AnalyzeError(f"'{args.model}': {why}")
        variants = sweep(base, args.instance_counts, args.max_batch_sizes,
                         args.dynamic_batching, args.max_queue_delays_us)
        todo = [v for v in variants if v.key not in results["variants"]]
        if len(todo) < len(variants):
            print(f"resuming: {len(variants) - len(todo)} of {len(variants)} configurations "
                  f"already measured in {results_path}")
        total = len(variants) * len(args.concurrency)
        bar = _progress(total, (len(variants) - len(todo)) * len(args.concurrency),
                        sys.stdout.isatty() and not args.no_progress)
        try:
            for v in todo:
                results["variants"][v.key] = _measure(target, v, base, args, out, bar)
                _save(results_path, results)
        finally:
            if bar is not None:
                bar.stop()
    finally:
        if target.given and "base" in results:   # a server of the user's: as it was
            with contextlib.suppress(AnalyzeError):
                target.load(results["base"])
        target.stop()
    ranked = rank(results, args.latency_budget_ms)
    print(table(ranked, args.latency_budget_ms))
    report = write_report(results, ranked, args.latency_budget_ms, out)
    if not ranked or ranked[0].best is None:
        print(f"no configuration keeps p99 within {args.latency_budget_ms:g} ms; report: {report}")
        return 1
    winner = results["variants"][ranked[0].key]
    (out / "config.pbtxt").write_text(config_pbtxt(winner["config"]))
    print(f"best: {ranked[0].key}; wrote {out / 'config.pbtxt'} and {report}")
    return 0


def _measure(target: Target, v: Variant, base: dict[str, Any], args: Any, out: Path,
             bar: Any) -> dict[str, Any]:
    config = v.config(base)
    target.load(config)
    before = target.batch_sizes()
    levels = []
    for c in args.concurrency:
        if bar is not None:
            bar.update(bar.task_ids[0], description=f"{v.key} at concurrency {c}")
        level = run_perf(target, c, args.protocol, args.measurement_interval, args.max_trials,
                         args.perf_arg, out / f"{v.key}_c{c}.csv")
        if level is None:
            print(f"{v.key} c{c}: no stable measurement, left out", flush=True)
        else:
            levels.append(level.as_dict())
            print(f"{v.key} c{c}: {level.throughput:,.1f} infer/s, p99 "
                  f"{level.p99_us / 1000:.2f} ms" + ("" if level.stable else " (not stable)"),
                  flush=True)
        if bar is not None:
            bar.advance(bar.task_ids[0])
    after = target.batch_sizes()
    sizes = {str(k): n - before.get(k, 0) for k, n in after.items() if n - before.get(k, 0) > 0}
    return {"variant": asdict(v), "config": config, "levels": levels, "batch_sizes": sizes}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except AnalyzeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
