"""services.scheduler.metrics_host: Triton's CPU metrics from /proc (a fake one here, and the
real one), GPU metrics through NVML (a fake module; the real one only where a GPU is)."""
from __future__ import annotations

import asyncio
import importlib.util
import re
from types import SimpleNamespace

import pytest

from services.scheduler.metrics_host import CpuMetrics, GpuMetrics, HostMetrics

MEMINFO = "MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    4000000 kB\n"


class FakeProc:
    def __init__(self) -> None:
        self.stat = "cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 1 2 3\n"
        self.meminfo = MEMINFO

    def __call__(self, path: str) -> str:
        return {"/proc/stat": self.stat, "/proc/meminfo": self.meminfo}[path]


def values(lines: list[str]) -> dict[str, str]:
    return dict(ln.rsplit(" ", 1) for ln in lines if not ln.startswith("#"))


def test_cpu_help_texts_utilization_and_memory_as_triton():
    proc = FakeProc()
    cpu = CpuMetrics(proc)
    cpu.poll()                       # the baseline: utilization 0 until the next reading
    lines = cpu.gauges()
    assert "# HELP nv_cpu_utilization CPU utilization rate [0.0 - 1.0]" in lines
    assert "# HELP nv_cpu_memory_total_bytes CPU total memory (RAM), in bytes" in lines
    assert "# HELP nv_cpu_memory_used_bytes CPU used memory (RAM), in bytes" in lines
    assert "# TYPE nv_cpu_utilization gauge" in lines
    v = values(lines)
    assert v == {"nv_cpu_utilization": "0", "nv_cpu_memory_total_bytes": str(16000000 * 1024),
                 "nv_cpu_memory_used_bytes": str((16000000 - 4000000) * 1024)}
    # user +30, system +10, steal +10 busy; idle +40, iowait +10: 50 / 100
    proc.stat = "cpu  130 0 110 840 10 0 0 10 0 0\n"
    cpu.poll()
    assert values(cpu.gauges())["nv_cpu_utilization"] == "0.5"


def test_unreadable_proc_reads_zero_as_triton():
    def broken(path: str) -> str:
        raise OSError("no /proc")
    cpu = CpuMetrics(broken)
    cpu.poll()
    assert set(values(cpu.gauges()).values()) == {"0"}


def test_real_proc_is_plausible():
    cpu = CpuMetrics()
    cpu.poll()
    sum(range(200_000))
    cpu.poll()
    assert 0.0 <= cpu.utilization <= 1.0
    assert 0 < cpu.used <= cpu.total


class FakeNvml:
    def __init__(self, count: int = 2) -> None:
        self.count = count
        self.energy = 5_000_000
        self.shut = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-0000000{h}-aaaa"

    def nvmlDeviceGetUtilizationRates(self, h: int):
        return SimpleNamespace(gpu=37, memory=5)

    def nvmlDeviceGetMemoryInfo(self, h: int):
        return SimpleNamespace(total=80 * 2**30, used=2**30, free=79 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return 71_500

    def nvmlDeviceGetPowerManagementLimit(self, h: int) -> int:
        if h == 1:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 700_000

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        return self.energy


def test_gpu_families_names_labels_and_units_as_triton(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml()
    gpu = GpuMetrics.open(nvml)
    assert gpu is not None
    gpu.poll()
    nvml.energy += 2_500       # mJ
    gpu.poll()
    gauges, counters = gpu.gauges(), gpu.counters()
    for name, text in (("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)"),
                       ("nv_gpu_memory_total_bytes", "GPU total memory, in bytes"),
                       ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes"),
                       ("nv_gpu_power_usage", "GPU power usage in watts"),
                       ("nv_gpu_power_limit", "GPU power management limit in watts")):
        assert f"# HELP {name} {text}" in gauges and f"# TYPE {name} gauge" in gauges
    assert ("# HELP nv_energy_consumption GPU energy consumption in joules since the Triton "
            "Server started") in counters
    assert "# TYPE nv_energy_consumption counter" in counters
    v = values(gauges) | values(counters)
    a = 'gpu_uuid="GPU-00000000-aaaa"'
    assert v[f"nv_gpu_utilization{{{a}}}"] == "0.37"
    assert v[f"nv_gpu_memory_total_bytes{{{a}}}"] == str(80 * 2**30)
    assert v[f"nv_gpu_power_usage{{{a}}}"] == "71.5"
    assert v[f"nv_gpu_power_limit{{{a}}}"] == "700"
    assert v['nv_gpu_power_limit{gpu_uuid="GPU-00000001-aaaa"}'] == "0"   # unsupported: 0
    assert v[f"nv_energy_consumption{{{a}}}"] == "2.5"


def test_cuda_visible_devices_limits_the_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    gpu = GpuMetrics.open(FakeNvml())
    assert gpu is not None and [u for u, _ in gpu.handles] == ["GPU-00000001-aaaa"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert GpuMetrics.open(FakeNvml()) is None


def test_no_gpu_means_no_gpu_families():
    assert GpuMetrics.open(FakeNvml(count=0)) is None
    host = HostMetrics(cpu=True, gpu=True, interval_ms=2000, open_gpu=lambda: None)
    host.poll_cpu()
    text = "\n".join(host.counters() + host.gauges())
    assert "nv_gpu" not in text and "nv_energy" not in text and "nv_cpu_utilization" in text


def test_real_nvml_when_a_gpu_is_there():
    if importlib.util.find_spec("pynvml") is None:
        pytest.skip("nvidia-ml-py is not installed")
    gpu = GpuMetrics.open()
    if gpu is None:
        pytest.skip("NVML finds no GPU here")
    gpu.poll()
    v = values(gpu.gauges())
    assert all(re.fullmatch(r'nv_gpu_\w+\{gpu_uuid="GPU-[\w-]+"\}', k) for k in v)
    assert all(float(x) >= 0 for x in v.values())


def test_poller_reads_every_half_interval_and_stops():
    async def go() -> tuple[int, bool]:
        nvml = FakeNvml(count=1)
        host = HostMetrics(cpu=True, gpu=True, interval_ms=20, open_gpu=lambda: GpuMetrics.open(nvml))
        reads = []
        poll = host.poll_cpu
        host.poll_cpu = lambda: (reads.append(1), poll())[1]   # type: ignore[method-assign]
        host.start()
        while len(reads) < 4:
            await asyncio.sleep(0.005)
        await host.stop()
        n = len(reads)
        await asyncio.sleep(0.05)
        assert len(reads) == n
        return n, nvml.shut
    n, shut = asyncio.run(go())
    assert n >= 4 and shut


def test_cpu_metrics_off_and_gpu_off_start_nothing():
    async def go() -> HostMetrics:
        host = HostMetrics(cpu=False, gpu=False, interval_ms=20)
        host.start()
        await host.stop()
        return host
    host = asyncio.run(go())
    assert host.counters() == host.gauges() == []
