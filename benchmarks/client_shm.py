#!/usr/bin/env python
"""Client system shared memory: Trireme vs Triton 2.51, identity 4 KiB and 64 MiB.

    python benchmarks/client_shm.py [--quick] [--duration S] [--repeats 3] [--no-onnx]
                                    [--json out.json] [--keep] [--triton-sh PATH]

One temp model repository holds `identity`, a Triton Python-backend model (OUTPUT0 =
INPUT0.as_numpy(), FP32 dims [-1], max_batch_size 0, one KIND_CPU instance) that both
servers load unchanged; Trireme's copy of the repository also holds `identity_onnx` (an
ONNX Identity, FP32 [-1, -1], max_batch_size 0, one KIND_CPU instance, one intra-op thread),
measured on Trireme only (Triton 2.51 here has no onnxruntime backend). Triton runs through
../shared/tools/triton.sh (tritonserver 2.51, CPU; its client shared memory is always on:
2.51 predates --allow-client-shm), Trireme as `python -m services.cli serve
--allow-client-shm=true`. Both are up at once on free ports; one is measured at a time, in
the order Triton, Trireme, Triton, Trireme... (--repeats pairs), medians reported. Trireme
gets --http-max-input-size 134217728: its default, 64 MiB as in newer Tritons, refuses a
64 MiB tensor plus the JSON header of the request; 2.51 has no such limit.

Rows: a 4 KiB and a 64 MiB FP32 tensor round-tripped through the identity, one request at a
time (c1), over four paths:

  shm, gRPC   input and output in client system shared memory (tritonclient.grpc carries
              the request; the regions are registered and the input written once before
              the timed loop)
  shm, HTTP   the same with tritonclient.http
  gRPC wire   tritonclient.grpc, the tensor in raw_input_contents / raw_output_contents
  HTTP binary tritonclient.http, binary tensor data in and out

Each run: the answer checked once, byte for byte (for shm: read from the output region;
the response must carry no tensor bytes), a short warm-up, then sequential requests for
--duration seconds. Value: the p50 round trip; "GiB/s per direction" is the tensor's bytes
/ p50 round trip. The timed loop does not read the output region: tritonclient's
shm.get_contents_as_numpy is a view over the mapping (no copy), so reading is the client's
own business, as it is with the wire paths' already-decoded numpy array. Server CPU per
request comes from /proc (every process of the server), the server's own time split from
its statistics extension (queue / compute input / infer / output, per request).

The in-process ceiling: numpy copies of 64 MiB in this process (heap to heap, and heap
into a shared-memory mapping, which is what an identity model's output costs at least:
its output must be written into the client's output region once).

The targets: 64 MiB through client shm at >= 10 GiB/s effective per direction;
a 64 MiB input and output through shm costing no more than a 4 KiB one plus the model's
own time (here: p50(64 MiB) - p50(4 KiB) <= one 64 MiB copy into a shm mapping, the
identity's unavoidable output write).

Every region this script creates is unregistered and destroyed at the end, also on error;
at the end it lists what it left in /dev/shm (nothing, or it says so). Exits 0 with a
message (and measures Trireme alone) when triton.sh is absent.
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import pct
from bench_server import Server, log, machine_info, model_config, wait_quiet
from client_shm_runs import PREFIX, REGIONS, c1_run, dev_shm
from vs_triton_models import IDENTITY, _python_config
from vs_triton_runs import TRITON_SH, Sample, TritonServer, server_version, wait_models_ready

SIZES = {"4 KiB": 4 << 10, "64 MiB": 64 << 20}
PATHS = {"shm-grpc": "shm, gRPC", "shm-http": "shm, HTTP", "grpc": "gRPC wire",
         "http": "HTTP binary"}
MODEL, ONNX_MODEL = "identity", "identity_onnx"
READY_TIMEOUT_S = 120.0
CONTENDED_PCT = 20.0
TARGET_GIBS = 10.0
GIB = float(1 << 30)
# Trireme's default --http-max-input-size (64 MiB, as newer Triton's) refuses a 64 MiB tensor
# plus the request's JSON header; Triton 2.51 has no such limit (nor the flag).
HTTP_MAX_INPUT = 128 << 20


# --------------------------------------------------------------------------- repository

def build_repositories(tmp: Path, onnx: bool) -> tuple[Path, Path]:
    """(Triton's repository, Trireme's): the Python identity in both; with onnx, Trireme's
    also holds identity_onnx (tritonserver exits when any model of its repository fails to
    load, and 2.51 here has no onnxruntime backend)."""
    import models  # tests/models.py (bench_server put tests/ on sys.path)

    def python_identity(repo: Path) -> None:
        d = repo / MODEL
        (d / "1").mkdir(parents=True)
        (d / "1" / "model.py").write_text(IDENTITY)
        (d / "config.pbtxt").write_text(
            _python_config(MODEL, 0, {"INPUT0": "-1"}, {"OUTPUT0": "-1"}))

    triton, trireme = tmp / "triton_models", tmp / "trireme_models"
    python_identity(triton)
    python_identity(trireme)
    if onnx:
        d = trireme / ONNX_MODEL
        models.identity(d, "fp32")
        models.write_config(d, model_config(ONNX_MODEL, 1, max_batch=0))
    return triton, trireme


def wait_ready(srv: Server, names: list[str]) -> None:
    wait_models_ready(srv, READY_TIMEOUT_S, names)


# --------------------------------------------------------------------------- ceiling

def _copy_p50(dst: np.ndarray, src: np.ndarray, n: int) -> float:
    np.copyto(dst, src)   # touch every page first
    times = []
    for _ in range(n):
        t = time.perf_counter_ns()
        np.copyto(dst, src)
        times.append(time.perf_counter_ns() - t)
    return pct(times)[0]


def copy_ceiling(nbytes: int, n: int) -> dict[str, float]:
    """p50 ms of np.copyto of nbytes: heap to heap, and heap into a (pre-touched) shared-
    memory mapping, as a model writing its output into a client's region does."""
    src = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    out = {"heap": _copy_p50(np.empty_like(src), src, n)}
    key, handle = REGIONS.create("ceiling", nbytes)
    try:
        out["shm"] = _copy_p50(np.ndarray(src.shape, np.float32, buffer=handle._mpsm_handle.buf),
                               src, n)
    finally:
        REGIONS.destroy(key)   # the view above is gone: the mapping can close
    return out


# --------------------------------------------------------------------------- tables

@dataclass
class Row:
    size: str
    path: str
    model: str
    servers: tuple[str, ...]
    samples: dict[str, list[Sample]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return SIZES[self.size]

    def median(self, who: str) -> float | None:
        s = self.samples.get(who)
        return statistics.median(v.value for v in s) if s else None

    def median_sample(self, who: str) -> Sample | None:
        s = self.samples.get(who)
        return sorted(s, key=lambda v: v.value)[len(s) // 2] if s else None

    def gibs(self, who: str) -> float | None:
        m = self.median(who)
        return self.nbytes / GIB / (m / 1e3) if m else None


def _ms(v: float | None) -> str:
    return "—" if v is None else (f"{v:.3f}" if v < 10 else f"{v:.1f}")


def _gibs(v: float | None) -> str:
    return "—" if v is None else f"{v:.3g}"


def _runs(row: Row, who: str) -> str:
    s = row.samples.get(who)
    if not s:
        return "—"
    return ", ".join(_ms(v.value) + ("*" if v.other_pct > CONTENDED_PCT else "")
                     + ("" if v.ok else " (ERR)") for v in s)


def results_table(rows: list[Row]) -> str:
    out = ["| size | path | model | Triton p50 runs (ms) | Trireme p50 runs (ms) | Triton p50 | "
           "Trireme p50 | Triton GiB/s per direction | Trireme GiB/s per direction | "
           "Triton / Trireme p50 |",
           "|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        t, m = r.median("Triton"), r.median("Trireme")
        ratio = f"**{t / m:.2f}**" if t and m else "—"
        out.append(f"| {r.size} | {PATHS[r.path]} | {r.model} | {_runs(r, 'Triton')} | "
                   f"{_runs(r, 'Trireme')} | {_ms(t)} | {_ms(m)} | {_gibs(r.gibs('Triton'))} | "
                   f"{_gibs(r.gibs('Trireme'))} | {ratio} |")
    return "\n".join(out)


def ceiling_table(ceiling: dict) -> str:
    out = ["| in this process, 64 MiB FP32 | p50 (ms) | GiB/s |", "|---|---:|---:|"]
    for label, key in (("numpy copy, heap → heap", "heap"),
                       ("numpy copy, heap → shm mapping (what writing an output into a client "
                        "region costs at least)", "shm")):
        ms = ceiling.get(key)
        if ms:
            out.append(f"| {label} | {_ms(ms)} | {_gibs(SIZES['64 MiB'] / GIB / (ms / 1e3))} |")
    return "\n".join(out)


def detail_table(rows: list[Row]) -> str:
    out = ["| size | path | model | server | median run | server CPU µs/req | "
           "server's own time per request, µs: queue / input / infer / output |",
           "|---|---|---|---|---|---:|---|"]
    for r in rows:
        for who in r.servers:
            s = r.median_sample(who)
            if s is None:
                continue
            st = s.extra.get("server_time_us") or {}
            split = " / ".join(f"{st.get(k, 0):,.0f}" for k in
                               ("queue", "compute_input", "compute_infer", "compute_output")
                               ) if st else "—"
            cpu = "—" if s.server_us is None else f"{s.server_us:,.0f}"
            out.append(f"| {r.size} | {PATHS[r.path]} | {r.model} | {who} | {s.note} | {cpu} | "
                       f"{split} |")
    return "\n".join(out)


def verdicts(rows: list[Row], ceiling: dict) -> list[str]:
    def find(size: str, path: str) -> Row | None:
        return next((r for r in rows if r.size == size and r.path == path and r.model == MODEL),
                    None)
    out = []
    copy_ms = ceiling.get("shm")
    for path in ("shm-grpc", "shm-http"):
        big, small = find("64 MiB", path), find("4 KiB", path)
        if big is None:
            continue
        g = big.gibs("Trireme")
        ok = g is not None and g >= TARGET_GIBS and all(
            s.ok for v in big.samples.values() for s in v)
        out.append(f"- 64 MiB through client shm ({PATHS[path]}) ≥ {TARGET_GIBS:.0f} GiB/s per "
                   f"direction: Trireme **{_gibs(g)} GiB/s** (p50 {_ms(big.median('Trireme'))} "
                   f"ms) — **{'met' if ok else 'MISSED'}**"
                   + (f"; Triton {_gibs(big.gibs('Triton'))} GiB/s" if big.median("Triton") else "")
                   + (f"; one 64 MiB copy into a shm mapping alone runs at "
                      f"{_gibs(SIZES['64 MiB'] / GIB / (copy_ms / 1e3))} GiB/s" if copy_ms else ""))
        if small is not None and copy_ms:
            for who in big.servers:
                b, s = big.median(who), small.median(who)
                if b is None or s is None:
                    continue
                extra = b - s
                st = (big.median_sample(who).extra.get("server_time_us") or {})
                infer = (st["compute_infer"] + st["compute_output"]) if st else None
                verdict = "met" if extra <= copy_ms else "MISSED"
                out.append(
                    f"- 64 MiB costs no more than 4 KiB plus the model's own time "
                    f"({PATHS[path]}, {who}): p50 {_ms(b)} − {_ms(s)} = **{_ms(extra)} ms** more, "
                    f"against one 64 MiB copy into a shm mapping {_ms(copy_ms)} ms "
                    f"({extra / copy_ms:.1f}×)"
                    + (f"; the server's own compute infer + output time for 64 MiB "
                       f"{infer / 1e3:.1f} ms"
                       if infer is not None else "")
                    + (f" — **{verdict}**" if who == "Trireme" else ""))
    return out


# --------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=None, help="seconds per run (3; --quick 1)")
    ap.add_argument("--quick", action="store_true", help="~1 minute smoke run: 1 pair, 1 s runs")
    ap.add_argument("--repeats", type=int, default=None, help="Triton/Trireme pairs (3; --quick 1)")
    ap.add_argument("--no-onnx", action="store_true", help="leave out Trireme's identity_onnx rows")
    ap.add_argument("--sizes", default=",".join(SIZES), help="of %(default)s")
    ap.add_argument("--paths", default=",".join(PATHS), help="of %(default)s")
    ap.add_argument("--quiet-wait", type=float, default=5.0,
                    help="before each run wait up to this many seconds for the machine to go "
                         "idle (20x this in all; 0: don't wait)")
    ap.add_argument("--triton-sh", type=Path, default=TRITON_SH, help="triton.sh to run")
    ap.add_argument("--json", type=Path, help="also write every sample here")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (server logs)")
    args = ap.parse_args()
    duration = args.duration or (1.0 if args.quick else 3.0)
    repeats = args.repeats or (1 if args.quick else 3)
    with_triton = args.triton_sh.is_file()
    sizes = [v.strip() for v in args.sizes.split(",") if v.strip()]
    paths = [v.strip() for v in args.paths.split(",") if v.strip()]
    bad = [v for v in sizes if v not in SIZES] + [v for v in paths if v not in PATHS]
    if bad:
        ap.error(f"unknown size or path: {', '.join(bad)}")
    onnx = not args.no_onnx

    # SIGTERM/SIGHUP end the run through the finally blocks (regions destroyed, servers
    # stopped) like Ctrl-C does.
    def _stop(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)

    cmd = "python benchmarks/client_shm.py " + " ".join(sys.argv[1:])
    print(f"# Client system shared memory: Trireme vs Triton 2.51\n\n"
          f"command: `{cmd.strip()}`  \ndate: {time.strftime('%Y-%m-%d %H:%M %Z')}\n")
    if not with_triton:
        print(f"NOTE: {args.triton_sh} not found: Trireme only (no Triton column).\n")
    shm_before = dev_shm()
    info = machine_info(1)
    tmp = Path(tempfile.mkdtemp(prefix="trireme-client-shm-"))
    triton_repo, trireme_repo = build_repositories(tmp, onnx)
    servers: dict[str, Server] = {}
    rows: list[Row] = []
    ceiling: dict[str, float] = {}
    swept: list[str] = []
    budget = [args.quiet_wait * 20]
    t_start = time.monotonic()

    def quiet() -> None:
        if args.quiet_wait > 0 and budget[0] > 0:
            t = time.monotonic()
            wait_quiet(min(args.quiet_wait, budget[0]))
            budget[0] -= time.monotonic() - t

    who_all = ("Triton", "Trireme") if with_triton else ("Trireme",)
    for model, who in ((MODEL, who_all), (ONNX_MODEL, ("Trireme",))):
        if model == ONNX_MODEL and not onnx:
            continue
        rows += [Row(size, path, model, who) for size in sizes for path in paths]
    code = 0
    try:
        if with_triton:
            servers["Triton"] = TritonServer(triton_repo, tmp / "triton.log", args.triton_sh)
        servers["Trireme"] = Server(trireme_repo, 1, tmp / "trireme.log",
                                    extra=["--allow-client-shm=true",
                                           "--http-max-input-size", str(HTTP_MAX_INPUT)])
        for who, srv in servers.items():
            log(f"starting {who}: {' '.join(srv.cmd)}")
            srv.start()
            wait_ready(srv, [MODEL] + ([ONNX_MODEL] if onnx and who == "Trireme" else []))
            log(f"{who} ready; processes: {srv.processes()}")
        info["servers"] = {w: server_version(s) for w, s in servers.items()}
        info["commands"] = {w: " ".join(s.cmd) for w, s in servers.items()}

        quiet()
        ceiling = copy_ceiling(SIZES["64 MiB"], 10 if args.quick else 30)
        log(f"in-process 64 MiB copy p50: heap {ceiling['heap']:.2f} ms, "
            f"into shm {ceiling['shm']:.2f} ms")
        rng = np.random.default_rng(16)
        data = {size: rng.random(n // 4, dtype=np.float32) for size, n in SIZES.items()}
        for i, row in enumerate(rows):
            x = data[row.size] if row.model == MODEL else data[row.size].reshape(1, -1)
            for rep in range(repeats):
                for who in row.servers:
                    quiet()
                    tag = f"{i}_{rep}_{who.lower()}"
                    s = c1_run(servers[who], who, row.path, row.model, x, tag, duration)
                    row.samples.setdefault(who, []).append(s)
                    log(f"{row.size} {PATHS[row.path]} {row.model} [{who} {rep + 1}/{repeats}] "
                        f"p50 {_ms(s.value)} ms; {s.note}"
                        + (f"; other processes {s.other_pct:.0f}%" if s.other_pct > 5 else ""))
    except BaseException:
        code = 1
        for who, srv in servers.items():
            log(f"{who} log tail:\n{srv.tail()}")
        raise
    finally:
        swept = REGIONS.destroy_all()
        for who, srv in servers.items():
            srv.stop()
            log(f"{who} stopped (exit code {srv.proc.returncode if srv.proc else None})")
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        time.sleep(1.0)   # the servers' own segments go with their processes
        ours = sorted(p for p in dev_shm() if p.startswith(PREFIX))
        new = sorted(dev_shm() - shm_before)
        print(f"/dev/shm after the run: {len(ours)} object(s) of this script left"
              + (f" ({', '.join(ours)})" if ours else "")
              + (f"; {len(swept)} unlinked by the final sweep ({', '.join(swept)})" if swept else "")
              + (f"; {len(new)} other new object(s), not this script's (other processes on the "
                 f"machine, or a server's leftovers): {', '.join(new[:10])}" if new else
                 "; nothing else new") + "\n")
        if code == 0 and ours:
            code = 1

    print("| machine | |\n|---|---|")
    for k, v in info.items():
        if isinstance(v, dict):
            v = "; ".join(f"{a}: `{b}`" if k == "commands" else f"{a}: {b}" for a, b in v.items())
        print(f"| {k} | {v} |")
    print(f"\n## Results ({repeats} run(s) per server, alternating "
          f"{', '.join(who_all)}; {duration:g} s each, c1)\n")
    print("GiB/s per direction = tensor bytes / p50 round trip. Triton / Trireme p50: > 1 means "
          f"Trireme is faster. `*`: other processes used > {CONTENDED_PCT:.0f}% of a core during "
          "that run. The output region is not read inside the timed loop (a zero-copy view).\n")
    print(results_table(rows))
    print("\nThe in-process ceiling (one direction: a copy of the tensor, no server):\n")
    print(ceiling_table(ceiling))
    print("\n### Against the issue's targets\n")
    print("\n".join(verdicts(rows, ceiling)) or "(no 64 MiB shared-memory rows in this run)")
    print("\n### Per run (the median run of each server)\n")
    print(detail_table(rows))
    print(f"\n(total {time.monotonic() - t_start:.0f} s; server CPU: user+sys of every process "
          "of that server, from /proc, per request; own time: the statistics extension)")
    if args.json:
        args.json.write_text(json.dumps({
            "command": cmd, "machine": info, "ceiling_ms": ceiling,
            "rows": [{"size": r.size, "path": r.path, "model": r.model,
                      "median_ms": {w: r.median(w) for w in r.servers},
                      "gibs": {w: r.gibs(w) for w in r.servers},
                      "samples": {w: [asdict(s) for s in v] for w, v in r.samples.items()}}
                     for r in rows],
            "verdicts": verdicts(rows, ceiling)}, indent=1, default=str))
        log(f"wrote {args.json}")
    if not with_triton:
        print(f"\n{args.triton_sh} not found: measured Trireme only.")
    return code


if __name__ == "__main__":
    sys.exit(main())
