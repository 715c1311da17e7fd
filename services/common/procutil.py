"""Process-level helpers: titles that name the role, dying with the parent, the collector's
and the C heap's tuning."""
from __future__ import annotations

import ctypes
import gc
import os
import signal
from types import ModuleType
from typing import Any

_spt: ModuleType | None
try:
    import setproctitle as _spt
except ImportError:  # titles are a convenience, never a requirement
    _spt = None

_PR_SET_PDEATHSIG = 1

# SIGTERM to SIGKILL, for every worker stop (an unload's, a restart's, a worker host's) and
# for the worker's own guard (services/workers/main.py), which ends it this long after a
# SIGTERM whoever sent it. A worker that obeys closes in well under a second (finalize(),
# Goodbye to its frontends, sockets and segments); past that it is a model that does not
# cooperate (it swallows the SystemExit, or is stuck in native code) and no wait helps. 3 s
# leaves a finalize() that really works (flushing, freeing a device) its time and keeps
# an unload or a shutdown from waiting on a hung model. The time work in flight gets is
# another setting: --model-unload-timeout-secs, --exit-timeout-secs.
TERM_GRACE_S = 3.0


# The hot paths allocate a few hundred short-lived objects per request; with the default
# threshold (700) the collector runs every few requests and its full passes walk every
# object the process holds (frameworks, protobufs): 6 % of the frontend's and the worker's
# samples under load (docs/benchmarks.md, vs Triton). What exists after start-up is frozen
# out of the collector's view, and young collections run every 20,000 allocations.
GC_THRESHOLDS = (20_000, 20, 20)


def tune_gc() -> None:
    """Call once start-up has imported and built what the process keeps."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


_malloc_trim: Any = None   # libc's malloc_trim once looked up; False where there is none


def malloc_trim() -> bool:
    """Hand the C heap's free pages back to the system: glibc keeps memory that big
    request bodies freed, counted in RSS, until told. A no-op (False) where libc has no
    malloc_trim (musl). Whether anything was given back."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            fn = ctypes.CDLL(None).malloc_trim
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            _malloc_trim = fn
        except (OSError, AttributeError):
            _malloc_trim = False
    return bool(_malloc_trim and _malloc_trim(0))


def set_title(title: str) -> None:
    if _spt is not None:
        _spt.setproctitle(title)


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` when the parent exits, so a killed parent leaves no orphan.

    Only for processes spawned by another Trireme process (``parent_pid``); a piece run
    alone under a container's init must not tie its life to that init."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resident_bytes(pid: int | str = "self") -> int:
    """A process's proportional set size (its private pages plus its share of the pages it
    maps with others: numpy's and the frameworks' libraries count once across workers, so
    the figures of several workers add up to what they hold together); its resident set
    size where the kernel has no smaps_rollup; 0 where neither can be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
