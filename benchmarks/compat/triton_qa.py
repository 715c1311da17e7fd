#!/usr/bin/env python
"""Triton's own QA tests (triton-inference-server/server, unmodified) against Trireme.

    python benchmarks/compat/triton_qa.py [--triton-repo PATH] [--only SUITES]
                                          [--nop-backend identity|python|both]
                                          [--markdown] [--json OUT] [--work-dir DIR] [--keep]

Exports qa/common, qa/L0_simple_ensemble, qa/L0_infer_zero (and the two qa/python_models
the backpressure sections use) from Triton's server repository (default: the mirror at
/work/.mirror/triton-inference-server+server/repo; exits 0 with a SKIP line when it is
absent), builds each test.sh's model repositories (qa_tree.py: Triton's own generators for
the ONNX and ensemble models, Dockerfile.QA's 'simple' model), then replays each test.sh:
for every `python <test>.py <cases>` line, a fresh `trireme serve` on ports 8000/8001/8002
(qa_server.py; the QA tests hard-code them: the run stops if one is taken), the test run
unmodified by a small unittest wrapper (qa_unittest.py) with the shims for the old client
module names on PYTHONPATH, the server stopped. Prints one row per test case: the test
file, the run (which test.sh section), the case, the result (pass / fail / error / n/a, or
xfail: a failure of the test's own expectation that Triton fails as well, in a section
test.sh does not run) and the first line of the failure message, then a summary and the
models that did not load.

Suites (--only, comma separated; default simple_ensemble,infer_zero):
  simple_ensemble   L0_simple_ensemble: ensemble_test.py, its four EnsembleTest cases, one
                    server each, as test.sh runs them (the last with --log-verbose 1 and
                    SERVER_LOG pointing at Trireme's log)
  infer_zero        L0_infer_zero: infer_zero_test.py (28 cases) with BACKENDS=onnx (the
                    libtorch models are not generated). Every case runs the onnx identity
                    models and then the simple/sequence/fan ensembles of nop models. The
                    nop models are `backend: "identity"`, Triton's identity backend:
                    --nop-backend identity (default) runs the repository as generated, on
                    Trireme's own identity backend (services/workers/backends/identity.py);
                    python serves the nop models with a Python model that does the same
                    (the stand-in used before Trireme had the backend); both runs it twice.
  backpressure      (not by default: about 5 minutes, 4 1/2 of them the max_inflight_requests
                    cases) L0_simple_ensemble's ensemble_backpressure_test.py sections
                    (max_queue_size in ensemble steps, a failed enqueue in a parallel step,
                    max_inflight_requests) and test.sh's server-log checks around them,
                    including the invalid max_inflight_requests values

  infer, input_validation, string_io, nan_inf, output_name, initializer_as_input, http,
  grpc, batcher, model_namespacing
                    (not by default) ten more L0 suites, ONNX and Python backends only:
                    qa_infer.py, qa_small.py, qa_http_grpc.py, qa_batcher.py,
                    qa_namespacing.py (results: docs/compat.md)
  response_cache    (not by default) L0_response_cache (qa_cache.py): test.sh's server
                    sections (decoupled models with the cache, the --cache-config /
                    --response-cache-byte-size flags, Redis flags and auth against a
                    redis-server it starts) and ensemble_cache_test.py's four cases
  warmup            (not by default) L0_warmup (qa_warmup.py), BACKENDS=onnx: the warmup
                    log lines of the onnx addsub/sequence/string models, the failing and
                    decoupled Python models

A case that asks for a model the generators did not make (a framework left out) counts as
n/a, not as an error.

The work folder (a temp folder unless --work-dir) holds the exported tests, the generated
models and every server and client log; it is removed at the end unless --keep (or
--work-dir) is given. Not part of the pytest suite: it needs the Triton repository, writes
models, and takes the fixed ports.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import qa_batcher  # noqa: E402  (L0_batcher)
import qa_cache  # noqa: E402  (L0_response_cache)
import qa_http_grpc  # noqa: E402  (L0_http, L0_grpc)
import qa_infer  # noqa: E402  (L0_infer)
import qa_namespacing  # noqa: E402  (L0_model_namespacing)
import qa_server  # noqa: E402  (benchmarks/compat/qa_server.py)
import qa_shared_memory  # noqa: E402  (benchmarks/compat/qa_shared_memory.py: L0_shared_memory)
import qa_small  # noqa: E402  (L0_input_validation, string_io, nan_inf, output_name, initializer_as_input)
import qa_tree  # noqa: E402  (benchmarks/compat/qa_tree.py)
import qa_warmup  # noqa: E402  (L0_warmup)

MORE_SUITES = (qa_infer, qa_small, qa_http_grpc, qa_batcher, qa_namespacing, qa_cache,
               qa_warmup)
SUITES = ("simple_ensemble", "backpressure", "infer_zero", *qa_shared_memory.SUITES,
          *(s for m in MORE_SUITES for s in m.SUITES))
DEFAULT_SUITES = ("simple_ensemble", "infer_zero")
INFER_ZERO_CASES = 28   # test.sh EXPECTED_NUM_TESTS


def trireme_version() -> str:
    """HEAD of the Trireme checkout, and the tracked files changed on top of it."""
    def git(*a: str) -> str:
        out = subprocess.run(["git", "-C", str(qa_server.ROOT), *a], capture_output=True, text=True)
        return out.stdout.rstrip("\n") if out.returncode == 0 else ""
    head = git("log", "-1", "--format=%h %cs") or "unknown"
    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return head + (f" + uncommitted changes to {', '.join(changed)}" if changed else "")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Phase:
    """One server lifetime of a test.sh: start, (checks), one test command, stop."""
    key: str                          # unique, names the log files
    suite: str                        # "L0_simple_ensemble"
    run: str                          # the test.sh section, as shown in the table
    test_file: str | None             # "ensemble_test.py"; None: log checks only
    names: tuple[str, ...] = ()       # unittest names on the command line (none: all)
    repository: Path = Path()
    server_args: tuple[str, ...] = ()
    env: dict[str, str | None] = dataclasses.field(default_factory=dict)   # None: unset
    expected: int | None = None       # check_test_results' expected count
    server_must_fail: bool = False    # test.sh expects run_server to fail
    log_checks: tuple[tuple[str, str], ...] = ()   # (what, text the server log must hold)
    live_after: bool = False          # test.sh checks the server is still live afterwards
    server_env: dict[str, str] = dataclasses.field(default_factory=dict)   # exported before run_server
    # log_checks' and log_absent's texts: a str (grep TEXT) or a re.Pattern (grep -i, ...)
    server_must_start: bool = False   # test.sh fails when run_server fails (SERVER_PID == 0)
    log_absent: tuple[tuple[str, str | re.Pattern], ...] = ()   # (what, text it must not hold)
    log_after: tuple[tuple[str, str | re.Pattern], ...] = ()    # log_checks after the test ran
    before: Callable[[], None] | None = None   # test.sh's steps before run_server (redis-cli ...)
    not_run: str = ""                 # why this section is not run here: one n/a row, no server
    # (text of the failure, why): a case the test's own expectation fails on Triton as well
    # (a section test.sh does not run); such a failure is "xfail", anything else "fail"
    expected_failure: tuple[str, str] | None = None


@dataclasses.dataclass
class Row:
    test: str
    run: str
    case: str
    result: str
    message: str = ""
    seconds: float = 0.0


@dataclasses.dataclass
class PhaseInfo:
    key: str
    ready: bool
    startup_s: float
    not_ready: list[dict]
    stop_note: str
    server_log: Path


class PortsTaken(Exception):
    pass


# -------------------------------------------------------------------------------- the phases
def simple_ensemble_phases(work: Path) -> list[Phase]:
    models = qa_tree.setup_simple_ensemble(work)
    phases = []
    for case in ("test_ensemble_add_sub", "test_ensemble_sequence_flags",
                 "test_ensemble_add_sub_one_output"):
        phases.append(Phase(key=f"simple_ensemble.{case}", suite="L0_simple_ensemble",
                            run="ensemble", test_file="ensemble_test.py",
                            names=(f"EnsembleTest.{case}",), repository=models, expected=1))
    # test.sh: SERVER_ARGS="$SERVER_ARGS --log-verbose=1"; SERVER_LOG=$SERVER_LOG python ...
    phases.append(Phase(key="simple_ensemble.test_ensemble_partial_add_sub",
                        suite="L0_simple_ensemble", run="ensemble (--log-verbose 1)",
                        test_file="ensemble_test.py",
                        names=("EnsembleTest.test_ensemble_partial_add_sub",),
                        repository=models, server_args=("--log-verbose", "1"), expected=1,
                        env={"SERVER_LOG": "<server log>"}))
    return phases


def backpressure_phases(work: Path) -> list[Phase]:
    repos = qa_tree.setup_backpressure(work)
    suite, test = "L0_simple_ensemble", "ensemble_backpressure_test.py"
    return [
        Phase(key="backpressure.max_queue_size", suite=suite, run="step max_queue_size",
              test_file=test, names=("EnsembleStepMaxQueueSizeTest",),
              repository=repos["max_queue_size"], expected=2),
        Phase(key="backpressure.parallel_failed_enqueue", suite=suite,
              run="parallel failed enqueue", test_file=test,
              names=("EnsembleParallelFailedEnqueueTest.test_parallel_step_failed_enqueue",),
              repository=repos["parallel_failed_enqueue"], expected=1,
              env={"PARALLEL_FAILED_ENQUEUE_LOOPS": "1"}, live_after=True),
        Phase(key="backpressure.max_inflight_requests", suite=suite,
              run="max_inflight_requests", test_file=test, names=("EnsembleBackpressureTest",),
              repository=repos["max_inflight_requests"], expected=4,
              log_checks=(
                  ("ensemble_limit_1 loaded",
                   "Ensemble model 'ensemble_limit_1' configured with max_inflight_requests: 1"),
                  ("ensemble_limit_4 loaded",
                   "Ensemble model 'ensemble_limit_4' configured with max_inflight_requests: 4"),
              )),
        Phase(key="backpressure.invalid_max_inflight_requests", suite=suite,
              run="invalid max_inflight_requests", test_file=None,
              repository=repos["invalid_max_inflight_requests"], server_must_fail=True,
              log_checks=(
                  ("negative value fails the load", "Expected integer, got: -"),
                  ("string value fails the load", 'Expected integer, got: "invalid_value"'),
                  ("too large value fails the load", "Integer out of range (12345678901)"),
              )),
    ]


def infer_zero_phases(work: Path, nop_backend: str) -> tuple[list[Phase], list[str]]:
    gen = qa_tree.generate_identity_repositories(work, log)
    phases, notes = [], []
    pinned = qa_tree.pin_onnx_versions(work, gen)
    if pinned:
        log(pinned)
        notes.append(pinned)
    models = qa_tree.setup_infer_zero(work, gen)
    if nop_backend in ("identity", "both"):
        phases.append(Phase(key="infer_zero.identity", suite="L0_infer_zero",
                            run="as generated (nop: identity backend)",
                            test_file="infer_zero_test.py", repository=models,
                            env={"BACKENDS": "onnx"}, expected=INFER_ZERO_CASES))
    if nop_backend in ("python", "both"):
        py_models, changed = qa_tree.nop_on_python(
            models, work / "qa" / "L0_infer_zero" / "models_nop_python")
        notes.append(f"infer_zero 'nop: Python model' run: {len(changed)} nop_* models "
                     f"({', '.join(changed)}) served by a Python model doing what Triton's "
                     "identity backend does (OUTPUTn = INPUTn)")
        phases.append(Phase(key="infer_zero.python", suite="L0_infer_zero",
                            run="nop: Python model", test_file="infer_zero_test.py",
                            repository=py_models, env={"BACKENDS": "onnx"},
                            expected=INFER_ZERO_CASES))
    return phases, notes


# ---------------------------------------------------------------------------- running a phase
def _run_tests(phase: Phase, work: Path, server_log: Path, timeout_s: float) -> list[dict]:
    test_dir = work / "qa" / phase.suite
    out = work / "logs" / f"{phase.key}.results.json"
    client_log = work / "logs" / f"{phase.key}.client.log"
    out.unlink(missing_ok=True)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["PYTHONPATH"] = str(work / "shims")
    for k, v in phase.env.items():
        if v is None:   # unset, whatever the runner's own environment holds
            env.pop(k, None)
        else:
            env[k] = str(server_log) if v == "<server log>" else v
    assert phase.test_file is not None
    cmd = [sys.executable, str(HERE / "qa_unittest.py"), "--out", str(out),
           "--module", Path(phase.test_file).stem, *phase.names]
    with open(client_log, "wb") as f:
        child = subprocess.Popen(cmd, cwd=test_dir, env=env, stdout=f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        timed_out = False
        try:
            child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(10)
    try:
        records = json.loads(out.read_text()) if out.exists() else []
    except ValueError:
        records = []
    for r in records:
        if r["result"] == "unfinished":
            r["result"] = "error"
            r["message"] = (f"did not finish in {timeout_s:.0f} s (killed)" if timed_out
                            else f"did not finish (test process exited {child.returncode})")
    if not records:
        why = (f"timed out after {timeout_s:.0f} s" if timed_out
               else f"test process exited {child.returncode} without results")
        records = [{"id": n, "result": "error", "message": why, "seconds": 0.0}
                   for n in (phase.names or (Path(phase.test_file).stem,))]
    return records


_UNKNOWN_MODEL = re.compile(r"unknown model: '([^']+)'")


def _not_applicable(record: dict, repository: Path) -> None:
    """A case that failed on a model the repository does not hold at all (its framework's
    generator was not run) is n/a, not a Trireme failure."""
    if record["result"] not in ("fail", "error"):
        return
    m = _UNKNOWN_MODEL.search(record.get("message", ""))
    if m and not (repository / m.group(1)).exists():
        record["result"] = "n/a"
        record["message"] = f"model '{m.group(1)}' not generated (its framework is left out)"


def _expected_failure(record: dict, expected: tuple[str, str] | None) -> None:
    """A case whose failure is the test's expectation, not the server's answer: "xfail"
    when it failed with that text; a pass or another failure stays a failure."""
    if expected is None or record["result"] == "n/a":
        return
    text, why = expected
    if record["result"] in ("fail", "error") and text in record.get("message", ""):
        record["result"] = "xfail"
        record["message"] = f"{why} ({record.get('message', '')})"
    elif record["result"] == "pass":
        record["result"] = "fail"
        record["message"] = f"passed, but expected to fail with '{text}': {why}"


def _case_name(test_id: str, module: str) -> str:
    return test_id[len(module) + 1:] if test_id.startswith(module + ".") else test_id


def _found(needle: str | re.Pattern, text: str) -> bool:
    return needle.search(text) is not None if isinstance(needle, re.Pattern) else needle in text


def _shown(needle: str | re.Pattern) -> str:
    return f"/{needle.pattern}/" if isinstance(needle, re.Pattern) else f"'{needle}'"


def run_phase(phase: Phase, work: Path, args) -> tuple[list[Row], PhaseInfo]:
    test_name = f"{phase.suite}/{phase.test_file or 'test.sh'}"
    if phase.not_run:
        return ([Row(test_name, phase.run, "(section)", "n/a", phase.not_run)],
                PhaseInfo(phase.key, False, 0.0, [], "", Path()))
    taken = qa_server.ports_in_use()
    if taken:
        raise PortsTaken(f"port(s) {', '.join(map(str, taken))} already in use before "
                         f"starting the server for {phase.key}")
    server_log = work / "logs" / f"{phase.key}.server.log"
    server = qa_server.TriremeServer(phase.repository, server_log, phase.server_args)
    if phase.before is not None:
        phase.before()
    log(f"{phase.key}: starting trireme serve ({phase.repository.name})")
    rows: list[Row] = []
    try:
        saved_env = {k: os.environ.get(k) for k in phase.server_env}
        os.environ.update(phase.server_env)
        try:
            ready = server.start(args.startup_timeout)
        finally:
            for k, v in saved_env.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        if "<server pid>" in phase.env.values():   # SERVER_PID=$SERVER_PID python ...
            phase = dataclasses.replace(phase, env={k: str(server.pid) if v == "<server pid>"
                                                    else v for k, v in phase.env.items()})
        log(f"{phase.key}: {'ready' if ready else 'NOT ready'} after {server.startup_s:.1f} s"
            + (f", {len(server.not_ready)} model(s) not READY" if server.not_ready else ""))
        if phase.server_must_fail:
            rows.append(Row("test.sh", phase.run, "server fails to start (run_server)",
                            "pass" if not ready else "fail",
                            "" if not ready else "server became ready; test.sh expects "
                            "the model loads to fail the start"))
        if phase.server_must_start:
            rows.append(Row("test.sh", phase.run, "server starts (run_server)",
                            "pass" if ready else "fail",
                            "" if ready else "server did not become ready: "
                            + _last_error(server_log)))
        text = server_log.read_text(errors="replace")
        for what, needle in phase.log_checks:
            ok = _found(needle, text)
            rows.append(Row("test.sh", phase.run, f"server log: {what}",
                            "pass" if ok else "fail",
                            "" if ok else f"server log lacks {_shown(needle)}"))
        for what, needle in phase.log_absent:
            bad = _found(needle, text)
            rows.append(Row("test.sh", phase.run, f"server log: {what}",
                            "fail" if bad else "pass",
                            f"server log holds {_shown(needle)}" if bad else ""))
        if phase.test_file is not None:
            module = Path(phase.test_file).stem
            if not server.alive():
                rc = server.proc.returncode if server.proc else "?"
                rows += [Row(test_name, phase.run, n, "error",
                             f"server exited during startup (code {rc})")
                         for n in (phase.names or (module,))]
            else:
                log(f"{phase.key}: python {phase.test_file} {' '.join(phase.names)}")
                records = _run_tests(phase, work, server_log, args.test_timeout)
                for r in records:
                    _not_applicable(r, phase.repository)
                    _expected_failure(r, phase.expected_failure)
                    rows.append(Row(test_name, phase.run, _case_name(r["id"], module),
                                    r["result"], r.get("message", ""), r.get("seconds", 0.0)))
                if phase.expected is not None and len(records) != phase.expected:
                    rows.append(Row("test.sh", phase.run, "check_test_results count", "fail",
                                    f"expected {phase.expected} tests, got {len(records)}"))
        text = server_log.read_text(errors="replace")
        for what, needle in phase.log_after:
            ok = _found(needle, text)
            rows.append(Row("test.sh", phase.run, f"server log: {what}",
                            "pass" if ok else "fail",
                            "" if ok else f"server log lacks {_shown(needle)}"))
        if phase.live_after:
            ok = server.alive() and server.live()
            rows.append(Row("test.sh", phase.run, "server still live after the test",
                            "pass" if ok else "fail", "" if ok else "server exited or not live"))
    finally:
        stop_note = server.stop()
        left = server.wait_ports_free()
        if left:
            stop_note = (stop_note + "; " if stop_note else "") + f"ports still taken: {left}"
    if stop_note:
        log(f"{phase.key}: stop: {stop_note}")
    return rows, PhaseInfo(phase.key, server.ready, server.startup_s, server.not_ready,
                           stop_note, server_log)


def _last_error(server_log: Path) -> str:
    """The server log's last line that looks like an error (for a start that failed)."""
    lines = [ln.strip() for ln in server_log.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"error|fail|unavailable|refused", ln, re.I):
            return ln
    return lines[-1] if lines else "(empty log)"


# ---------------------------------------------------------------------------------- reporting
def _clip(s: str, n: int) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[:n - 1] + "…"


def table(rows: list[Row], markdown: bool, width: int = 110) -> str:
    head = ("test", "run", "case", "result", "first line of the failure")
    body = [(r.test, r.run, r.case, r.result, _clip(r.message, width)) for r in rows]
    if markdown:
        esc = [tuple(c.replace("|", "\\|") for c in row) for row in body]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(f"`{c}`" if i == 2 else c for i, c in enumerate(row)) + " |"
                  for row in esc]
        return "\n".join(lines)
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:{w}}}" for w in widths[:-1]) + "  {}"
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([fmt.format(*head), sep, *(fmt.format(*row) for row in body)])


def summary(rows: list[Row]) -> str:
    lines = []
    groups: dict[tuple[str, str], dict[str, int]] = {}
    for r in rows:
        c = groups.setdefault((r.test, r.run), {})
        c[r.result] = c.get(r.result, 0) + 1
    for (test, run), c in groups.items():
        total = sum(c.values())
        parts = ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: kv[0] != "pass"))
        lines.append(f"{test} [{run}]: {c.get('pass', 0)}/{total} pass ({parts})")
    return "\n".join(lines)


def not_ready_report(infos: list[PhaseInfo]) -> str:
    lines = []
    for info in infos:
        if not info.not_ready:
            continue
        by_reason: dict[str, list[str]] = {}
        for m in info.not_ready:
            reason = " ".join((m.get("reason") or m.get("state") or "?").split())
            if len(reason) > 200:   # keep the start and the end (the parser's own words)
                reason = reason[:80] + " … " + reason[-110:]
            by_reason.setdefault(reason, []).append(m.get("name", "?"))
        lines.append(f"{info.key}: {len(info.not_ready)} model(s) not READY at start")
        for reason, names in by_reason.items():
            shown = ", ".join(sorted(names)[:6]) + (" …" if len(names) > 6 else "")
            lines.append(f"  {len(names)} × {reason}: {shown}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--triton-repo", type=Path, default=qa_tree.DEFAULT_MIRROR,
                   help="Triton's server repository: a git directory (bare or not) or a "
                        "checkout (default: %(default)s)")
    p.add_argument("--only", default=",".join(DEFAULT_SUITES),
                   help=f"comma-separated suites to run, of {', '.join(SUITES)} "
                        "(default: %(default)s)")
    p.add_argument("--nop-backend", choices=("identity", "python", "both"), default="identity",
                   help="infer_zero: serve the nop_* models as generated, on Trireme's identity "
                        "backend (default), with a Python stand-in, or both runs")
    p.add_argument("--startup-timeout", type=float, default=120.0,
                   help="seconds to wait for the server to be ready (util.sh SERVER_TIMEOUT)")
    p.add_argument("--test-timeout", type=float, default=600.0,
                   help="seconds one test command may take")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--work-dir", type=Path, help="work folder (kept); default: a temp folder")
    p.add_argument("--keep", action="store_true", help="keep the temp work folder")
    args = p.parse_args(argv)

    suites = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(suites) - set(SUITES)
    if unknown:
        p.error(f"unknown suite(s): {', '.join(sorted(unknown))}")
    try:
        source = qa_tree.TritonSource(args.triton_repo)
    except qa_tree.SourceMissing as e:
        print(f"SKIP: Triton's server repository not available: {e}. Point --triton-repo at "
              "a clone of https://github.com/triton-inference-server/server.")
        return 0
    taken = qa_server.ports_in_use()
    if taken:
        print(f"STOP: port(s) {', '.join(map(str, taken))} already in use; Triton's QA tests "
              "hard-code localhost:8000 (HTTP) and :8001 (gRPC), and the server takes 8002 for "
              "metrics. Free them and run again.")
        return 2

    work = args.work_dir.resolve() if args.work_dir else Path(tempfile.mkdtemp(prefix="trireme-triton-qa-"))
    keep = args.keep or args.work_dir is not None
    t0 = time.monotonic()
    rows: list[Row] = []
    infos: list[PhaseInfo] = []
    notes: list[str] = []
    trireme = ""
    code = 0
    try:
        (work / "logs").mkdir(parents=True, exist_ok=True)
        trireme = trireme_version()
        log(f"Triton repository: {source.describe()}")
        log(f"Trireme: {trireme}")
        exported = source.export(work)
        log(f"exported {', '.join(exported)} to {work}")
        qa_tree.write_shims(work / "shims")
        phases: list[Phase] = []
        if "simple_ensemble" in suites:
            phases += simple_ensemble_phases(work)
        if "backpressure" in suites:
            phases += backpressure_phases(work)
        if "infer_zero" in suites:
            zero, zero_notes = infer_zero_phases(work, args.nop_backend)
            phases += zero
            notes += zero_notes
        phases += qa_shared_memory.phases(suites, source, work, Phase, log)
        for m in MORE_SUITES:
            phases += m.phases(suites, source, work, Phase, log)
        for phase in phases:
            phase_rows, info = run_phase(phase, work, args)
            rows += phase_rows
            infos.append(info)
    except (PortsTaken, RuntimeError) as e:
        print(f"STOP: {e}")
        code = 2
    finally:
        elapsed = time.monotonic() - t0
        if rows:
            print()
            print(table(rows, args.markdown))
            print()
            print(summary(rows))
            total = len(rows)
            passed = sum(r.result == "pass" for r in rows)
            print(f"all: {passed}/{total} pass in {elapsed:.0f} s "
                  f"(Triton {source.describe().split(' ')[0][:12]}, Trireme {trireme})")
            report = not_ready_report(infos)
            if report:
                print()
                print(report)
            stops = [f"{i.key}: {i.stop_note}" for i in infos if i.stop_note]
            if stops:
                print()
                print("server stop notes:\n  " + "\n  ".join(stops))
            for n in notes:
                print(f"note: {n}")
        if args.json:
            args.json.write_text(json.dumps({"triton": source.describe(), "trireme": trireme,
                                             "seconds": elapsed,
                                             "rows": [dataclasses.asdict(r) for r in rows],
                                             "notes": notes}, indent=1))
        if keep:
            print(f"work folder (logs, models): {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if code == 0 and any(r.result in ("fail", "error") for r in rows):
        code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
