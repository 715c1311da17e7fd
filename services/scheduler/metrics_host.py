"""The machine's figures on /metrics: CPU (from /proc, as Triton reads them) and GPUs (from
NVML, when nvidia-ml-py is installed and finds one), read every --metrics-interval-ms.

Names, help texts and labels are Triton's (core/src/metrics.cc). Triton's poll thread sleeps
half the interval between reads (Metrics::StartPollingThread); so does this. The values are
read on the scheduler's loop (reading /proc takes microseconds); NVML calls run in a thread.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("trireme.scheduler")

CPU_GAUGES = (
    ("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]"),
    ("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes"),
    ("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes"),
)
GPU_GAUGES = (
    ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)"),
    ("nv_gpu_memory_total_bytes", "GPU total memory, in bytes"),
    ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes"),
    ("nv_gpu_power_usage", "GPU power usage in watts"),
    ("nv_gpu_power_limit", "GPU power management limit in watts"),
)
GPU_COUNTER = ("nv_energy_consumption",
               "GPU energy consumption in joules since the Triton Server started")


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _read(path: str) -> str:
    return Path(path).read_text()


class CpuMetrics:
    """nv_cpu_utilization over the last poll interval (Metrics::CpuUtilization: busy ticks
    over busy + idle ticks of /proc/stat's aggregate line), and memory from /proc/meminfo
    (used = MemTotal - MemAvailable). A file that cannot be read gives 0, as in Triton."""

    def __init__(self, read: Callable[[str], str] = _read) -> None:
        self.read = read
        self.last: list[int] | None = None
        self.utilization = 0.0
        self.total = 0
        self.used = 0

    def _ticks(self) -> list[int] | None:
        try:
            line = self.read("/proc/stat").split("\n", 1)[0]
            if not line.startswith("cpu "):
                return None
            return ([int(v) for v in line.split()[1:9]] + [0] * 8)[:8]
        except (OSError, ValueError):
            return None

    def poll(self) -> None:
        ticks = self._ticks()
        self.utilization = 0.0
        if ticks is not None:
            if self.last is not None:
                d = [max(0, a - b) for a, b in zip(ticks, self.last)]
                user, nice, system, idle, iowait, irq, softirq, steal = d
                busy = user + nice + system + irq + softirq + steal
                total = busy + idle + iowait
                self.utilization = busy / total if total else 0.0
            self.last = ticks
        self.total = self.used = 0
        try:
            info = {}
            for line in self.read("/proc/meminfo").splitlines():
                name, _, rest = line.partition(":")
                info[name] = int(rest.split()[0]) * 1024
            if info["MemAvailable"] <= info["MemTotal"]:
                self.total, self.used = info["MemTotal"], info["MemTotal"] - info["MemAvailable"]
        except (OSError, ValueError, KeyError, IndexError):
            pass

    def gauges(self) -> list[str]:
        out = []
        for (name, text), v in zip(CPU_GAUGES, (self.utilization, self.total, self.used)):
            out += [f"# HELP {name} {text}", f"# TYPE {name} gauge", f"{name} {_num(v)}"]
        return out


class GpuMetrics:
    """Per GPU (label gpu_uuid, as Triton's DCGM metrics): utilization, memory, power and the
    energy used since start. A value NVML cannot give reads 0, as Triton does with DCGM's."""

    def __init__(self, nvml: Any, handles: list[tuple[str, Any]]) -> None:
        self.nvml = nvml
        self.handles = handles                      # (uuid, NVML handle)
        self.values: dict[str, tuple[float, ...]] = {}
        self.energy: dict[str, float] = {}         # joules since start
        self._first_mj: dict[str, int] = {}

    @classmethod
    def open(cls, nvml: Any = None) -> GpuMetrics | None:
        """None when nvidia-ml-py is missing or finds no GPU (the families are then absent).
        Only the GPUs CUDA_VISIBLE_DEVICES shows, when it is set, as Triton."""
        if nvml is None:
            try:
                nvml = importlib.import_module("pynvml")   # nvidia-ml-py, optional
            except ImportError:
                return None
        try:
            nvml.nvmlInit()
            handles = []
            for i in range(nvml.nvmlDeviceGetCount()):
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = nvml.nvmlDeviceGetUUID(h)
                handles.append((i, uuid.decode() if isinstance(uuid, bytes) else uuid, h))
        except Exception as e:  # noqa: BLE001 - NVMLError or a missing driver: no GPU metrics
            log.info("GPU metrics not available: %s", e)
            return None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            wanted = [v.strip() for v in visible.split(",") if v.strip()]
            handles = [(i, u, h) for i, u, h in handles
                       if any(w == str(i) or (w.startswith("GPU-") and u.startswith(w)) for w in wanted)]
        if not handles:
            return None
        log.info("Collecting metrics for GPU %s", ", ".join(u for _, u, _ in handles))
        return cls(nvml, [(u, h) for _, u, h in handles])

    def _get(self, fn: str, h: Any) -> Any:
        try:
            return getattr(self.nvml, fn)(h)
        except Exception:  # noqa: BLE001 - one field unsupported on this GPU: 0
            return None

    def poll(self) -> None:
        for uuid, h in self.handles:
            util = self._get("nvmlDeviceGetUtilizationRates", h)
            mem = self._get("nvmlDeviceGetMemoryInfo", h)
            power = self._get("nvmlDeviceGetPowerUsage", h)                 # mW
            limit = self._get("nvmlDeviceGetPowerManagementLimit", h)       # mW
            energy = self._get("nvmlDeviceGetTotalEnergyConsumption", h)    # mJ since boot
            self.values[uuid] = (
                util.gpu * 0.01 if util is not None else 0.0,
                mem.total if mem is not None else 0, mem.used if mem is not None else 0,
                power / 1000.0 if power is not None else 0.0,
                limit / 1000.0 if limit is not None else 0.0)
            if energy is not None:
                first = self._first_mj.setdefault(uuid, energy)
                self.energy[uuid] = (energy - first) * 0.001

    def _label(self, uuid: str) -> str:
        return f'gpu_uuid="{uuid}"'

    def counters(self) -> list[str]:
        name, text = GPU_COUNTER
        return [f"# HELP {name} {text}", f"# TYPE {name} counter"] + [
            f"{name}{{{self._label(u)}}} {_num(self.energy.get(u, 0.0))}" for u, _ in self.handles]

    def gauges(self) -> list[str]:
        out = []
        for i, (name, text) in enumerate(GPU_GAUGES):
            out += [f"# HELP {name} {text}", f"# TYPE {name} gauge"]
            out += [f"{name}{{{self._label(u)}}} {_num(self.values.get(u, (0,) * 5)[i])}"
                    for u, _ in self.handles]
        return out


class HostMetrics:
    """The CPU and GPU families /metrics shows, as their flags allow, and their poller."""

    def __init__(self, cpu: bool, gpu: bool, interval_ms: int,
                 open_gpu: Callable[[], GpuMetrics | None] = GpuMetrics.open) -> None:
        self.cpu = CpuMetrics() if cpu else None
        self.want_gpu = gpu
        self.open_gpu = open_gpu
        self.gpu: GpuMetrics | None = None
        self.interval_s = max(1, interval_ms) / 1000.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """First reading now (the CPU baseline and memory), then every half interval."""
        if self.want_gpu:
            self.gpu = self.open_gpu()
        if self.cpu is None and self.gpu is None:
            return
        self.poll_cpu()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def poll_cpu(self) -> None:
        if self.cpu is not None:
            self.cpu.poll()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s / 2)
            self.poll_cpu()
            if self.gpu is not None:
                try:
                    await asyncio.to_thread(self.gpu.poll)
                except Exception:
                    log.exception("reading the GPU metrics failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.gpu is not None:
            with contextlib.suppress(Exception):
                self.gpu.nvml.nvmlShutdown()
            self.gpu = None

    def counters(self) -> list[str]:
        return self.gpu.counters() if self.gpu is not None else []

    def gauges(self) -> list[str]:
        return (self.gpu.gauges() if self.gpu is not None else []) + \
            (self.cpu.gauges() if self.cpu is not None else [])
