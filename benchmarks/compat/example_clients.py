#!/usr/bin/env python
"""Triton's shared-memory example clients, unmodified, against `trireme serve`.

    python benchmarks/compat/example_clients.py [--client-repo PATH] [--markdown]
                                                [--json OUT] [--work-dir DIR] [--keep]

Exports five Python examples from Triton's client repository (src/python/examples at HEAD
of the mirror /work/.mirror/triton-inference-server+client/repo by default; prints SKIP and
exits 0 when it is absent):

  simple_http_shm_client.py         'simple': both INT32 [1,16] inputs and outputs in
  simple_grpc_shm_client.py         system shared memory
  simple_http_shm_string_client.py  'simple_string': BYTES inputs and outputs in system
  simple_grpc_shm_string_client.py  shared memory
  reuse_infer_objects_client.py     'simple', the same InferInput/InferRequestedOutput
                                    objects used with and without shared memory

builds the two models they need in a temp repository:

  simple         INT32 [16] add/sub, max_batch_size 8, ONNX (tests/models.py add_sub)
  simple_string  Triton's docs/examples model as a Python model: INPUT0/INPUT1 BYTES [16]
                 holding decimal integers; OUTPUT0/OUTPUT1 their sum and difference as
                 decimal strings; max_batch_size 8

starts one `python -m services.cli serve --allow-client-shm=true` on the ports the
clients expect (HTTP 8000, gRPC 8001, metrics 8002: the run stops if one is taken;
benchmarks/compat/qa_server.py), and runs each client as Triton's qa/L0_http and L0_grpc
test.sh do: `python <client> -v`, and reuse_infer_objects_client.py once over HTTP and once
with `-i grpc -u localhost:8001`. A client passes when it exits 0 (test.sh's only check);
each row also shows the tail of its output. After each client the script checks that no
region is left registered with the server and nothing of the client's is left in /dev/shm.

Exit status: 0 when every client passes (or SKIP), 1 when one fails, 2 when it had to stop.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import qa_server  # noqa: E402  (benchmarks/compat/qa_server.py)

ROOT = qa_server.ROOT
DEFAULT_CLIENT_MIRROR = Path("/work/.mirror/triton-inference-server+client/repo")
EXAMPLES = "src/python/examples"
CLIENT_FILES = ("simple_http_shm_client.py", "simple_grpc_shm_client.py",
                "simple_http_shm_string_client.py", "simple_grpc_shm_string_client.py",
                "reuse_infer_objects_client.py")
# (client file, arguments): L0_http/test.sh and L0_grpc/test.sh's command lines
RUNS = (
    ("simple_http_shm_client.py", ("-v",)),
    ("simple_http_shm_string_client.py", ("-v",)),
    ("simple_grpc_shm_client.py", ("-v",)),
    ("simple_grpc_shm_string_client.py", ("-v",)),
    ("reuse_infer_objects_client.py", ("-v",)),
    ("reuse_infer_objects_client.py", ("-v", "-i", "grpc", "-u", "localhost:8001")),
)
CLIENT_TIMEOUT_S = 120.0

SIMPLE_STRING = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Triton's docs/examples simple_string: INPUT0 and INPUT1 hold decimal integers as
    strings; OUTPUT0 is their sum and OUTPUT1 their difference, as strings."""

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            x, y = a.astype(np.int32), b.astype(np.int32)

            def text(v):
                return np.array([str(i).encode() for i in v.reshape(-1)],
                                dtype=np.object_).reshape(v.shape)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", text(x + y)), pb_utils.Tensor("OUTPUT1", text(x - y))]))
        return responses
'''


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def export_clients(repo: Path, dest: Path) -> str:
    """The five clients from HEAD of `repo` (a git directory) into dest; HEAD's description."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in CLIENT_FILES:
        out = subprocess.run(["git", "-C", str(repo), "show", f"HEAD:{EXAMPLES}/{name}"],
                             capture_output=True, check=True)
        (dest / name).write_bytes(out.stdout)
    head = subprocess.run(["git", "-C", str(repo), "log", "-1", "--format=%H %cs %s", "HEAD"],
                          capture_output=True, text=True)
    return head.stdout.strip()


def build_repository(root: Path) -> Path:
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    import models  # tests/models.py
    from models_python import io_config, python_model  # tests/models_python.py

    repo = root / "models"
    models.add_sub(repo / "simple", dtype="int32")
    models.write_config(repo / "simple", 'name: "simple"\nbackend: "onnxruntime"\n'
                        'max_batch_size: 8\ninstance_group [{ kind: KIND_CPU, count: 1 }]\n')
    strings = [("INPUT0", "TYPE_STRING", "[ 16 ]"), ("INPUT1", "TYPE_STRING", "[ 16 ]")]
    python_model(repo, "simple_string", SIMPLE_STRING, io_config(
        "simple_string", strings, [("OUTPUT0", "TYPE_STRING", "[ 16 ]"),
                                   ("OUTPUT1", "TYPE_STRING", "[ 16 ]")], max_batch_size=8))
    return repo


def registered_regions() -> list[str]:
    """Names of the system shared-memory regions the server holds (HTTP status call)."""
    url = f"http://{qa_server.HOST}:{qa_server.HTTP_PORT}/v2/systemsharedmemory/status"
    with contextlib.suppress(OSError, ValueError):
        with urllib.request.urlopen(url, timeout=5) as r:
            return [x.get("name", "?") for x in json.loads(r.read())]
    return ["? (status call failed)"]


def client_objects() -> set[str]:
    """The /dev/shm objects the example clients create (keys /input0_simple, ...)."""
    with contextlib.suppress(OSError):
        return {p.name for p in Path("/dev/shm").iterdir() if p.name.endswith("_simple")}
    return set()


def run_client(clients: Path, name: str, args: tuple[str, ...], log_path: Path) -> dict:
    cmd = [sys.executable, name, *args]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    t0 = time.monotonic()
    with open(log_path, "wb") as f:
        try:
            rc = subprocess.run(cmd, cwd=clients, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, timeout=CLIENT_TIMEOUT_S).returncode
            why = "" if rc == 0 else f"exit status {rc}"
        except subprocess.TimeoutExpired:
            rc, why = -1, f"did not finish in {CLIENT_TIMEOUT_S:.0f} s (killed)"
    text = log_path.read_text(errors="replace")
    return {"client": name, "args": " ".join(args), "result": "pass" if rc == 0 else "fail",
            "why": why, "seconds": round(time.monotonic() - t0, 1),
            "tail": "\n".join(text.rstrip().splitlines()[-8:])}


def _first_error(tail: str) -> str:
    for line in reversed(tail.splitlines()):
        if any(k in line for k in ("Error", "Exception", "error:", "FAIL", "incorrect")):
            return line.strip()
    return tail.splitlines()[-1].strip() if tail else ""


def table(rows: list[dict], markdown: bool) -> str:
    head = ("client", "args", "result", "s", "failure")
    body = [(r["client"], r["args"], r["result"], f"{r['seconds']:.1f}",
             "; ".join(x for x in (r["why"], _first_error(r["tail"]) if r["result"] != "pass"
                                   else "", r.get("left", "")) if x)) for r in rows]
    if markdown:
        esc = [tuple(c.replace("|", "\\|") for c in row) for row in body]
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| `" + row[0] + "` | " + " | ".join(row[1:]) + " |" for row in esc])
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:{w}}}" for w in widths[:-1]) + "  {}"
    return "\n".join([fmt.format(*head), "  ".join("-" * w for w in widths),
                      *(fmt.format(*row) for row in body)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--client-repo", type=Path, default=DEFAULT_CLIENT_MIRROR,
                   help="Triton's client repository, a git directory (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--json", type=Path, help="also write the rows (with output tails) here")
    p.add_argument("--work-dir", type=Path, help="work folder (kept); default: a temp folder")
    p.add_argument("--keep", action="store_true", help="keep the temp work folder")
    args = p.parse_args(argv)

    probe = subprocess.run(["git", "-C", str(args.client_repo), "cat-file", "-e",
                            f"HEAD:{EXAMPLES}/{CLIENT_FILES[0]}"], capture_output=True)
    if not args.client_repo.exists() or probe.returncode != 0:
        print(f"SKIP: Triton's client repository not available at {args.client_repo} (or no "
              f"{EXAMPLES} at HEAD). Point --client-repo at a clone of "
              "https://github.com/triton-inference-server/client.")
        return 0
    taken = qa_server.ports_in_use()
    if taken:
        print(f"STOP: port(s) {', '.join(map(str, taken))} already in use; the example clients "
              "talk to localhost:8000 (HTTP) and :8001 (gRPC). Free them and run again.")
        return 2

    work = args.work_dir.resolve() if args.work_dir else Path(
        tempfile.mkdtemp(prefix="trireme-example-clients-"))
    keep = args.keep or args.work_dir is not None
    (work / "logs").mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    code = 0
    server = None
    try:
        head = export_clients(args.client_repo, work / "clients")
        log(f"Triton client repository: {head}")
        repo = build_repository(work)
        server = qa_server.TriremeServer(repo, work / "logs" / "server.log",
                                         ("--allow-client-shm=true",))
        log(f"starting: {' '.join(server.command)}")
        if not server.start(args.startup_timeout):
            print(f"STOP: the server did not become ready ({server.not_ready or 'see its log'}):\n"
                  + (work / "logs" / "server.log").read_text(errors="replace")[-3000:])
            return 2
        before = client_objects()
        for i, (name, cargs) in enumerate(RUNS):
            log(f"python {name} {' '.join(cargs)}")
            row = run_client(work / "clients", name, cargs, work / "logs" / f"{i}.{name}.log")
            left = registered_regions()
            objs = sorted(client_objects() - before)
            notes = []
            if left:
                notes.append(f"still registered afterwards: {', '.join(left)}")
            if objs:
                notes.append(f"left in /dev/shm: {', '.join(objs)}")
                for o in objs:   # do not let one client's leftovers fail the next
                    with contextlib.suppress(OSError):
                        (Path("/dev/shm") / o).unlink()
            row["left"] = "; ".join(notes)
            rows.append(row)
            log(f"  {row['result']} in {row['seconds']:.1f} s" + (f" ({row['why']})" if row["why"]
                                                                   else ""))
    except (RuntimeError, subprocess.CalledProcessError) as e:
        print(f"STOP: {e}")
        code = 2
    finally:
        if server is not None:
            note = server.stop()
            if note:
                log(f"server stop: {note}")
        if rows:
            print()
            print(table(rows, args.markdown))
            passed = sum(r["result"] == "pass" for r in rows)
            print(f"\n{passed}/{len(rows)} pass")
            for r in rows:
                if r["result"] != "pass" or r["left"]:
                    print(f"\n--- {r['client']} {r['args']}: output tail ---\n{r['tail']}")
        if args.json:
            args.json.write_text(json.dumps({"rows": rows}, indent=1))
        if keep:
            print(f"work folder (clients, logs, models): {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if code == 0 and any(r["result"] != "pass" or r["left"] for r in rows):
        code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
