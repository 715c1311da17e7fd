"""Where should tensors switch from inline ZeroMQ frames to shared memory?

Runs an identity model round trip through the full multi-process path (a DataPlane in
this process stands in for the frontend, so no HTTP/gRPC cost blurs the transport), once
with every tensor inline and once with every tensor in shared memory, for sizes from
1 KiB to 16 MiB, and prints the median round trip of each.

    python benchmarks/inline_threshold.py
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import models  # noqa: E402
import numpy as np  # noqa: E402

from services.dataplane.client import DataPlane  # noqa: E402
from services.dataplane.types import CoreRequest, InputTensor  # noqa: E402
from services.frontend.settings import FrontendSettings  # noqa: E402

SIZES = sorted({1 << k for k in range(10, 25, 2)} | {96 << 10, 128 << 10, 192 << 10})  # 1 KiB .. 16 MiB


async def measure(addr: str, threshold: int, reps: int) -> dict[int, float]:
    dp = DataPlane(FrontendSettings(scheduler_addr=addr, inline_threshold=threshold,
                                    result_addr=f"ipc:///tmp/trireme-bench-{os.getpid()}-{threshold}.sock"))
    await dp.start()
    deadline = time.monotonic() + 60
    while not dp.ready():
        if time.monotonic() > deadline:
            raise TimeoutError("server not ready")
        await asyncio.sleep(0.05)
    out = {}
    for size in SIZES:
        data = np.random.default_rng(0).random(size // 4, dtype=np.float32).tobytes()
        ts = []
        for i in range(reps + 5):
            t = time.perf_counter()
            resp = await dp.infer(CoreRequest("identity_fp32", inputs=[
                InputTensor("INPUT0", "FP32", [1, size // 4], data)]))
            got = bytes(resp.outputs[0].data[:16])
            dp.release(resp)
            assert got == data[:16]
            if i >= 5:
                ts.append(time.perf_counter() - t)
        out[size] = sorted(ts)[len(ts) // 2]
    dp.close()
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        models.identity(repo / "identity_fp32", "fp32")
        models.write_config(repo / "identity_fp32", "max_batch_size: 8\n"
                            "instance_group [{ kind: KIND_CPU, count: 1 }]\n")
        results = {}
        for label, threshold, worker_flag in (("inline", 1 << 40, ["--no-shm"]),
                                              ("shm", 0, ["--inline-threshold", "0"])):
            fport, wport = f"ipc://{tmp}/f-{label}.sock", f"ipc://{tmp}/w-{label}.sock"
            cmd = [sys.executable, "-m", "services.cli", "scheduler", "--model-repository", str(repo),
                   "--frontend-addr", fport, "--worker-addr", wport, "--allow-metrics", "false",
                   "--local-workers", "true",
                   *worker_flag]
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                results[label] = asyncio.run(measure(fport, threshold, reps=30))
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
        print("| tensor size | inline frames (ms) | shared memory (ms) | faster |")
        print("|---:|---:|---:|---|")
        for size in SIZES:
            a, b = results["inline"][size], results["shm"][size]
            label = f"{size // 1024} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
            print(f"| {label} | {a * 1e3:.3f} | {b * 1e3:.3f} | {'inline' if a < b else 'shm'} |")


if __name__ == "__main__":
    main()
