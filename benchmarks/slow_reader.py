#!/usr/bin/env python
"""A gRPC client that never reads: what it makes the frontend hold.

    python benchmarks/slow_reader.py [--seconds 15] [--impl native aio] [--source DIR]
                                     [-- extra trireme serve flags]

One `trireme serve` per gRPC server (native, grpc.aio) with an ONNX identity model. After a
warm-up of 4 MiB round trips (the arena's pages and the allocator settle), one client opens
ModelStreamInfer, sends up to 200 requests of 4 MiB and never reads an answer. For
``--seconds`` the frontend's RSS is sampled each second while another client (its own
connection) makes 4 MiB round trips and checks them; then the slow client goes away and the
frontend's RSS is sampled once the housekeeping has given memory back. Prints a table: RSS
before, peak growth while the client sits there, the requests it managed to send, the
other client's answers and their worst latency, and RSS once it left.

``--source DIR`` runs the server from another checkout (e.g. a `git worktree` of an older
commit) to compare before and after in one run. Not a test: the figures go in
docs/benchmarks.md with the command.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
import conftest  # noqa: E402
import models  # noqa: E402

from protos import grpc_service_pb2 as pb  # noqa: E402
from protos import grpc_service_pb2_grpc as pbg  # noqa: E402

N = 1 << 20                      # FP32 elements: 4 MiB a request
SENT = 200
MIB = 1 << 20
OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def request(x: np.ndarray) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="identity")
    t = r.inputs.add()
    t.name, t.datatype = "INPUT0", "FP32"
    t.shape.extend([1, x.size])
    r.raw_input_contents.append(x.tobytes())
    return r


def repository(root: Path) -> Path:
    repo = root / "models"
    if not repo.exists():
        models.identity(repo / "identity", "fp32")
        models.write_config(repo / "identity", 'max_batch_size: 8\n'
                            'input [{name: "INPUT0" data_type: TYPE_FP32 dims: [-1]}]\n'
                            'output [{name: "OUTPUT0" data_type: TYPE_FP32 dims: [-1]}]\n')
    return repo


def measure(repo: Path, extra: list[str], seconds: float) -> dict:
    with conftest.start_server(repo, *extra) as srv:
        fe = psutil.Process(srv.proc.pid) if "--in-process-frontend" in extra else srv.frontend()
        x = np.random.default_rng(0).random(N, dtype=np.float32)
        good_req = request(x)
        # its own connection: grpc python shares one between channels of equal arguments
        good = pbg.GRPCInferenceServiceStub(grpc.insecure_channel(
            srv.grpc_url, options=[*OPTIONS, ("grpc.use_local_subchannel_pool", 1)]))
        for _ in range(8):
            good.ModelInfer(good_req, timeout=30)
        before = fe.memory_info().rss
        sent = [0]

        def requests():
            for _ in range(SENT):
                sent[0] += 1
                yield good_req
            time.sleep(seconds + 30)       # the stream stays open, unread
        slow_channel = grpc.insecure_channel(srv.grpc_url, options=OPTIONS)
        call = pbg.GRPCInferenceServiceStub(slow_channel).ModelStreamInfer(requests())
        answers, worst, stop = [0], [0.0], threading.Event()

        def served():
            while not stop.is_set():
                t0 = time.monotonic()
                out = good.ModelInfer(good_req, timeout=30).raw_output_contents[0]
                assert out == good_req.raw_input_contents[0], "a wrong answer"
                answers[0] += 1
                worst[0] = max(worst[0], time.monotonic() - t0)
        other = threading.Thread(target=served)
        other.start()
        peak = before
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(1)
            peak = max(peak, fe.memory_info().rss)
        stop.set()
        other.join()
        call.cancel()
        slow_channel.close()
        left = time.monotonic() + 40
        while time.monotonic() < left and fe.memory_info().rss > before + 64 * MIB:
            time.sleep(1)
        after = fe.memory_info().rss
    return {"before": before, "peak": peak, "after": after, "sent": sent[0],
            "answers": answers[0], "worst_s": worst[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--impl", nargs="+", default=["native", "aio"])
    ap.add_argument("--source", type=Path, help="run the server from this checkout")
    ap.add_argument("extra", nargs="*", help="more `trireme serve` flags (after --)")
    args = ap.parse_args()
    if args.source is not None:
        conftest.ROOT = args.source.resolve()
    import tempfile
    repo = repository(Path(tempfile.mkdtemp(prefix="trireme-slow-reader-")))
    print(f"command: `python benchmarks/slow_reader.py {' '.join(sys.argv[1:])}`\n")
    print("| gRPC server | RSS before MiB | peak growth MiB | requests the client sent | "
          "other client: answers, worst ms | RSS after it left MiB |")
    print("|---|---:|---:|---:|---|---:|")
    for impl in args.impl:
        extra = [*args.extra, *(["--grpc-impl", "aio"] if impl == "aio" else [])]
        r = measure(repo, extra, args.seconds)
        print(f"| {impl} | {r['before'] / MIB:.0f} | {(r['peak'] - r['before']) / MIB:+.0f} | "
              f"{r['sent']} of {SENT} | {r['answers']}, {r['worst_s'] * 1000:.0f} | "
              f"{r['after'] / MIB:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
