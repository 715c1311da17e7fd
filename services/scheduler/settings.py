"""What the scheduler is started with: `trireme serve`'s and `trireme scheduler`'s flags,
as services/cli.py reads them."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.scheduler.memory import MemorySettings
from services.scheduler.trace_config import TraceConfig


@dataclass
class SchedulerSettings:
    repositories: list[Path]
    frontend_addr: str
    """ROUTER socket frontends connect to."""
    worker_addr: str
    """ROUTER socket workers connect to."""
    control_mode: str = "none"
    """none | explicit | poll (--model-control-mode)."""
    load_models: list[str] = field(default_factory=list)
    repository_poll_secs: float = 15.0
    config_name: str | None = None
    disable_autocomplete: bool = False
    strict_readiness: bool = True
    metrics_port: int = 8002
    allow_metrics: bool = True
    host: str = "0.0.0.0"
    worker_args: list[str] = field(default_factory=list)
    """Extra flags for every spawned worker (e.g. --no-shm)."""
    rate_limit: str = "off"
    """off | execution_count (--rate-limit)."""
    rate_limit_resources: list[str] = field(default_factory=list)
    """--rate-limit-resource name:count[:device], repeatable."""
    execution_timeout_secs: float = 0.0
    """--model-execution-timeout-secs: the watchdog's limit on one execution (0: off); a
    model's `execution_timeout_secs` parameter overrides it (watchdog.py)."""
    unload_timeout_secs: float = 30.0
    """--model-unload-timeout-secs: how long an unload waits for the batches in flight."""
    local_workers: bool = True
    """Spawn workers here (`trireme serve`); False: only on worker hosts that connect."""
    state_file: str = ""
    """--model-state-file: the models loaded in explicit mode, kept across restarts."""
    allow_client_shm: bool = False
    """--allow-client-shm: clients may register shared-memory regions (shm_regions.py)."""
    trace: TraceConfig | None = None
    """--trace-config (and Triton's deprecated --trace-* flags): the start-up trace settings."""
    metrics_config: list[str] = field(default_factory=list)
    """--metrics-config <setting>=<value>, repeatable: Triton's counter_latencies,
    histogram_latencies, summary_latencies, summary_quantiles (metrics_config.py)."""
    metrics_interval_ms: int = 2000
    """--metrics-interval-ms: how often the CPU and GPU metrics are read."""
    allow_cpu_metrics: bool = True
    """--allow-cpu-metrics: nv_cpu_* on /metrics (with --allow-metrics)."""
    allow_gpu_metrics: bool = True
    """--allow-gpu-metrics: nv_gpu_* on /metrics where NVML finds a GPU (with --allow-metrics)."""
    model_namespacing: bool = False
    """--model-namespacing: a model name may be in several repositories (lifecycle.py)."""
    direct_path: bool = True
    """Requests to versions with nothing to decide per request go from the frontend to a
    worker directly (routes.py); False (--no-direct-path): every request comes here."""
    cache: tuple[str, dict[str, str]] | None = None
    """--cache-config (or --response-cache-byte-size): the response cache and its settings
    (response_cache.py); None: no cache."""
    memory: MemorySettings = field(default_factory=MemorySettings)
    """--model-memory-budget, --model-load-on-demand and its timeout (memory.py)."""
