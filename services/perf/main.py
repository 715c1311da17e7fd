"""`trireme perf`: the run, start to end.

    flags ─▶ model metadata/config ─▶ input data ─▶ load processes (LoadManager)
          ─▶ Profiler: per level, windows until stable (server statistics diffed per window)
          ─▶ per-level report, summary table, -f CSV ─▶ exit code (0, 2 unstable, 99 error)
"""
from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np

from services.perf import clients, flags, inputs, report, server_stats
from services.perf import model as model_mod
from services.perf.flags import GENERIC_ERROR, SUCCESS, PerfSettings, UsageError
from services.perf.load_lean import why_not_lean
from services.perf.manager import LoadError, LoadManager, process_count
from services.perf.model import ModelInfo
from services.perf.profiler import ProfileError, Profiler
from services.perf.worker_core import SequenceSpec, WorkerSpec


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("trireme")
    except PackageNotFoundError:
        return "unknown"


def check_model(s: PerfSettings, model: ModelInfo) -> None:
    """perf_analyzer's checks of the settings against the model; UsageError says why."""
    if model.is_sequence:
        if not s.async_mode and not s.forced_sync:
            s.async_mode = True   # (perf_analyzer's default for sequence models)
        if s.load_mode == "request_rate":
            raise UsageError("--request-rate-range with a sequence model is not supported by "
                             "trireme perf: measure it with --concurrency-range.")
        end = s.sequence_id_range[1]
        if end is not None and end - s.sequence_id_range[0] < max(s.concurrency_range[:2]):
            raise UsageError("sequence id range specified is smaller than the maximum possible "
                             "concurrency, sequence id collision may occur.")
    if s.streaming:
        s.async_mode = True
    if model.decoupled and not s.streaming:
        raise UsageError("Decoupled models must be run with `--async` and `--streaming` and "
                         "either `-i grpc` or `--service-kind=triton_c_api`")


def use_lean(s: PerfSettings, model: ModelInfo) -> bool:
    """Whether the load takes the lean path (--load-impl, and what the run needs)."""
    reason = why_not_lean(s, model)
    if s.load_impl == "lean" and reason is not None:
        raise UsageError(f"--load-impl lean does not cover {reason}: use --load-impl "
                         "tritonclient (or auto).")
    return s.load_impl != "tritonclient" and reason is None


def _specs(s: PerfSettings, model: ModelInfo, streams: list, processes: int,
           lean: bool) -> list[WorkerSpec]:
    batched = model.max_batch_size > 0
    if model.is_sequence:
        seq_streams = [[{k: (v[np.newaxis] if batched else v) for k, v in sample.items()}
                        for sample in stream] for stream in streams]
        requests: list = []
        seq = SequenceSpec(s.sequence_length, s.sequence_length_variation,
                           s.sequence_length_specified, s.sequence_id_range[0],
                           s.sequence_id_range[1])
    else:
        flat = [sample for stream in streams for sample in stream]
        try:
            requests = inputs.batch(flat, s.batch_size, batched)
        except ValueError as e:
            raise inputs.InputError(f"the input data's samples cannot be batched together "
                                    f"(-b {s.batch_size}): {e}") from None
        seq_streams, seq = [], None
    base = WorkerSpec(index=0, processes=processes, protocol=s.protocol, url=s.url, ssl=s.ssl,
                      headers=s.headers, model=s.model, version=s.version, inputs=model.inputs,
                      outputs=model.outputs, requests=requests, streams=seq_streams,
                      sequence=seq, streaming=s.streaming, shared_memory=s.shared_memory,
                      output_shm_size=s.output_shm_size, batch_size=s.batch_size,
                      batched=batched, grpc_compression=s.grpc_compression,
                      parameters=s.request_parameters,
                      input_json=s.input_tensor_format == "json",
                      output_json=s.output_tensor_format == "json", lean=lean)
    return [replace(base, index=i) for i in range(processes)]


def run(s: PerfSettings) -> int:
    try:
        control = clients.Control(s.protocol, s.url, s.ssl, s.headers)
    except Exception as e:   # noqa: BLE001  (tritonclient's errors are of many kinds)
        _err(f"error: failed to create client: {e}")
        return GENERIC_ERROR
    manager = sampler = None
    try:
        try:
            model = model_mod.load(control, s.model, s.version, s.batch_size)
            check_model(s, model)
            lean = use_lean(s, model)
            streams = inputs.load(model, s.input_data, s.shapes, s.string_length, s.string_data)
        except (model_mod.ModelError, inputs.InputError, UsageError) as e:
            _err(f"error: {e}")
            return GENERIC_ERROR
        try:
            extensions = control.server_metadata().get("extensions", [])
        except Exception as e:   # noqa: BLE001
            _err(f"error: failed to get server metadata: {e}")
            return GENERIC_ERROR
        with_stats = "statistics" in extensions
        start: float
        end: float
        if s.load_mode == "concurrency":
            start, end = s.concurrency_range[0], s.concurrency_range[1]
        else:
            start, end = s.rate_range[0], s.rate_range[1]
        n = process_count(s.load_mode, start, end, s.max_threads, lean=lean)
        try:
            specs = _specs(s, model, streams, n, lean)
        except inputs.InputError as e:
            _err(f"error: {e}")
            return GENERIC_ERROR
        report.settings(s, model, n, lean=lean)
        manager = LoadManager(specs)
        if s.collect_metrics:
            sampler = server_stats.MetricsSampler(s.metrics_url, s.metrics_interval_ms)

        def read():
            return server_stats.snapshot(control, model.name, model.version, model.is_ensemble)

        def diff(a, b):
            return server_stats.diff(a, b, model.name, model.version, model.composing)

        profiler = Profiler(s, manager, read if with_stats else None,
                            diff if with_stats else None, sampler,
                            lambda st: report.level(st, s, model))
        try:
            profiler.run()
        except KeyboardInterrupt:
            _err("Interrupt signal received. Reporting the levels measured so far.")
        if sampler is not None and sampler.error:
            _err(f"warning: {sampler.error}")
        report.summary(profiler.statuses, s)
        if s.filename:
            report.write_csv(s.filename, profiler.statuses, s, model)
        return SUCCESS
    except ProfileError as e:
        _err(str(e))
        return e.code
    except (LoadError, KeyError) as e:
        _err(f"error: {e}")
        return GENERIC_ERROR
    except Exception as e:   # noqa: BLE001  (a server call failed mid-run: say which, exit 99)
        _err(f"error: {type(e).__name__}: {e}")
        return GENERIC_ERROR
    finally:
        if manager is not None:
            manager.close()
        if sampler is not None:
            sampler.close()
        control.close()


def main(argv: list[str] | None = None) -> int:
    ns = flags.build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if ns.show_version:
        print(f"trireme perf {_version()} (perf_analyzer's interface)")
        return SUCCESS
    try:
        s = flags.settings_from(ns)
    except UsageError as e:
        _err(f"error: {e}")
        return GENERIC_ERROR
    return run(s)
