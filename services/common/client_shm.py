"""Client shared memory (Triton's system shared-memory extension): the regions a client
registers, how they are named and checked, and the map a worker reads and writes them by.

A client creates a POSIX shared-memory object (``shm_open(key)``), registers a region of
it by name (key, offset, byte_size), and then names that region in a request's inputs and
outputs instead of sending bytes. The registry is the scheduler's (services/scheduler/
shm_regions.py): every frontend reaches it, so a region registered through one connection
serves a request on any other. The scheduler resolves a request's regions into keys and
file offsets; the worker maps the key, hands the model a view of the input bytes and
writes requested outputs straight into the region. No frontend touches a region's bytes.

Every text here is Triton's (server src/shared_memory_manager.cc, common.cc), except where
a comment says otherwise.
"""
from __future__ import annotations

import mmap
import os
import threading

from services.common.errors import Code, TriremeError, invalid_arg, not_found
from services.common.shm import PREFIX, SHM_DIR, unmap

DISABLED_TEXT = ("Client shared memory is disabled. Start the server with "
                 "'--allow-client-shm=true' to enable.")
# Names of shared memory that is not the client's to register: Triton's Python backend's
# and Trireme's own segments (a client naming one would read other requests' tensors).
_RESERVED = ("triton_python_backend_shm_region_", PREFIX)


def unknown_region(name: str) -> TriremeError:
    """A request names a region nobody registered (GetMemoryInfo)."""
    return not_found(f"Unable to find shared memory region: '{name}'")


def check_key(name: str, key: str) -> None:
    """Triton's ValidateSharedMemoryKey, with Trireme's own prefix reserved too."""
    rest = key.lstrip("/")
    if not rest:
        raise invalid_arg(f"cannot register shared memory region '{name}' - invalid shm key "
                          f"'{key}'")
    for prefix in _RESERVED:
        if rest.startswith(prefix):
            raise invalid_arg(f"cannot register shared memory region '{name}' with key "
                              f"'{key}' as the key contains the reserved prefix '{prefix}'")


def _open(key: str, flags: int) -> int:
    """shm_open(key): the object's file under SHM_DIR. glibc refuses a name with a slash
    after the leading ones, so no key can reach outside SHM_DIR."""
    rest = key.lstrip("/")
    if "/" in rest or rest in (".", "..") or "\0" in rest:
        raise TriremeError(Code.INTERNAL, f"Unable to open shared memory region: '{key}'")
    try:
        return os.open(os.path.join(SHM_DIR, rest), flags)
    except OSError:
        raise TriremeError(Code.INTERNAL,
                           f"Unable to open shared memory region: '{key}'") from None


def check_region(name: str, key: str, offset: int, byte_size: int) -> None:
    """What registering checks of the object itself: it opens (read-write, as Triton opens
    it), the region lies inside it, and it maps (page-aligned offset, non-zero size)."""
    fd = _open(key, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if offset + byte_size > size:
        raise invalid_arg(f"failed to register shared memory region '{name}': invalid args")
    if byte_size == 0 or offset % mmap.ALLOCATIONGRANULARITY:   # mmap() would refuse it
        raise invalid_arg(f"failed to register shared memory region '{name}': unable to "
                          f"process address spaceInvalid argument")


def output_too_small(output: str, region_bytes: int, needed: int) -> TriremeError:
    return TriremeError(Code.INTERNAL,
                        f"shared memory size specified with the request for output "
                        f"'{output}' ({region_bytes} bytes) should be at least {needed} "
                        f"bytes to hold the results")


class RegionMap:
    """Client shared-memory objects a worker has mapped, by key, read-write. A mapping is
    kept until the scheduler says its region was unregistered (forget), so a region used
    by every request is mapped once; the whole object is mapped and refs carry offsets
    into it. The object's descriptor stays open: every use checks its size first, so a
    client that shrinks its object under a registered region gets an error, never a
    SIGBUS in the worker."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, memoryview, int]] = {}
        self._lock = threading.Lock()

    def view(self, key: str, offset: int, nbytes: int) -> memoryview:
        end = offset + nbytes
        entry = self._maps.get(key)
        if entry is None or end > len(entry[1]):
            entry = self._attach(key)
        size = os.fstat(entry[2]).st_size
        if end > size or end > len(entry[1]):
            raise invalid_arg(f"shared memory region '{key}' holds {size} bytes, fewer than "
                              f"the {end} its registration promised")
        return entry[1][offset:end]

    def _attach(self, key: str) -> tuple[mmap.mmap, memoryview, int]:
        with self._lock:
            old = self._maps.pop(key, None)
            if old is not None:
                _close(old)
            fd = _open(key, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) \
                    if size else mmap.mmap(-1, 1)
            except BaseException:
                os.close(fd)
                raise
            entry = self._maps[key] = (mm, memoryview(mm)[:size], fd)
            return entry

    def forget(self, keys: list[str]) -> None:
        with self._lock:
            entries = [e for e in (self._maps.pop(k, None) for k in keys) if e is not None]
        for e in entries:
            _close(e)

    def close(self) -> None:
        self.forget(list(self._maps))

    def __len__(self) -> int:
        return len(self._maps)


def _close(entry: tuple[mmap.mmap, memoryview, int]) -> None:
    mm, whole, fd = entry
    os.close(fd)
    unmap((mm, whole))
