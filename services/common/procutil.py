"""Process-level helpers: titles that name the role, and dying with the parent."""
from __future__ import annotations

import ctypes
import os
import signal
from types import ModuleType

_spt: ModuleType | None
try:
    import setproctitle as _spt
except ImportError:  # titles are a convenience, never a requirement
    _spt = None

_PR_SET_PDEATHSIG = 1


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
