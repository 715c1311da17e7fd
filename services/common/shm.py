"""POSIX shared-memory arenas for tensor bytes, and the map of other processes' segments.

Not multiprocessing.shared_memory: on 3.11 its resource_tracker unlinks segments a process
merely attached to. Segments live at /dev/shm/trireme-{pid}-{role}-{n}-n{pidns}; the owner
pid in the name lets a supervisor unlink a dead process's segments and start-up sweep stale
ones. Pids are unique only inside one pid namespace, and containers that share /dev/shm
(an IPC namespace) need not share one: the name also carries the owner's pid namespace, so
two owners never collide and a process only ever unlinks segments of its own namespace.

Whether two processes see the same segments at all (same host, shared IPC namespace) is
asked at run time, never configured: each reports domain(), an id kept in /dev/shm itself,
and two processes that read the same id can pass tensors by reference.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import mmap
import os
import re
import threading
import time
import weakref
from typing import NamedTuple

from services.common.errors import internal
from services.common.procutil import malloc_trim, pid_alive

# Where POSIX shared memory lives. Overridable for hosts that mount it elsewhere, and so
# tests can make it unusable to check the inline fallback.
SHM_DIR = os.environ.get("TRIREME_SHM_DIR", "/dev/shm")
PREFIX = "trireme-"
ALIGN = 64  # cache line; also enough for any numpy dtype and for DLPack consumers
_PAGE = mmap.PAGESIZE
_NAME_RE = re.compile(r"^trireme-(\d+)-[A-Za-z0-9_.]+-\d+(?:-n(\d+))?$")
_DOMAIN_FILE = ".trireme-domain"   # not a segment: sweeps and leak checks pass it by
_counter = itertools.count()  # per process, so two arenas of one role never collide


# Below this many bytes a tensor travels inline as a frame of its message; above it, through shared
# memory: the crossover measured by benchmarks/inline_threshold.py (figures in
# docs/benchmarks.md, "Figures behind design choices").
DEFAULT_INLINE_THRESHOLD = 128 * 1024

# A segment beyond an arena's first that has held no block this long is given back. Long
# enough that bursts a few seconds apart reuse their segments instead of paying a 64 MiB
# fallocate (and its page zeroing) each time; short enough that a burst's peak is gone
# soon after it. Steady traffic never waits on this: the first segment is always kept.
IDLE_S = 10.0
# How often a process tidies its shared memory (Housekeeper): a mapping of another
# process's segment that nobody read goes within two periods, an idle segment of its own
# within IDLE_S plus one. Each tick costs a few dict walks and, after traffic, one
# malloc_trim.
HOUSEKEEPING_S = 5.0


class ShmUnavailable(Exception):
    """No shared memory can be had; the caller falls back to sending bytes inline."""


class Block(NamedTuple):
    segment: str
    offset: int
    nbytes: int
    view: memoryview  # writable, exactly nbytes long


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


class _Segment:
    """One mapped file and its first-fit free list (sorted offsets, coalesced on free)."""

    def __init__(self, name: str, size: int, mm: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self.mm = mm
        self.whole = memoryview(mm)
        self.free_offs: list[int] = [0]
        self.free_sizes: list[int] = [size]
        self.used: dict[int, int] = {}  # offset -> aligned size
        self.idle_since: float | None = None  # monotonic time its last block was freed

    def alloc(self, size: int) -> int | None:
        for i, avail in enumerate(self.free_sizes):
            if avail >= size:
                off = self.free_offs[i]
                if avail == size:
                    del self.free_offs[i], self.free_sizes[i]
                else:
                    self.free_offs[i] = off + size
                    self.free_sizes[i] = avail - size
                self.used[off] = size
                return off
        return None

    def free(self, off: int) -> None:
        size = self.used.pop(off)  # KeyError: unknown block or double free
        offs, sizes = self.free_offs, self.free_sizes
        i = bisect.bisect_left(offs, off)
        if i > 0 and offs[i - 1] + sizes[i - 1] == off:  # merge into the previous hole
            i -= 1
            sizes[i] += size
        else:
            offs.insert(i, off)
            sizes.insert(i, size)
        if i + 1 < len(offs) and offs[i] + sizes[i] == offs[i + 1]:  # and the next one
            sizes[i] += sizes[i + 1]
            del offs[i + 1], sizes[i + 1]

    def unmap(self) -> None:
        try:
            self.whole.release()
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a block view; the mapping goes when it is collected


def _create_segment(name: str, size: int) -> mmap.mmap:
    path = _path(name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError:
        raise
    except OSError as e:
        raise ShmUnavailable(f"cannot create shared memory {path}: {e.strerror}") from e
    try:
        try:
            # Reserve the pages now: a full tmpfs fails here with ENOSPC, not later as SIGBUS.
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            os.ftruncate(fd, size)  # filesystem without fallocate: best effort
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        _unlink(name)
        hint = " (is /dev/shm full? raise the container's --shm-size)" \
            if e.errno == errno.ENOSPC else ""
        raise ShmUnavailable(f"cannot allocate {size} bytes of shared memory {path}: "
                             f"{e.strerror}{hint}") from e
    finally:
        os.close(fd)  # mmap keeps its own reference to the file


def _unlink(name: str) -> bool:
    try:
        os.unlink(_path(name))
        return True
    except FileNotFoundError:
        return False


def _release(segments: dict[str, _Segment], owner_pid: int) -> None:
    # Also the weakref finalizer: must not reference the Arena itself.
    for seg in list(segments.values()):
        seg.unmap()
        if os.getpid() == owner_pid:  # a forked child must not unlink its parent's memory
            _unlink(seg.name)
    segments.clear()


class Arena:
    """Shared memory owned by this process, handed out as 64-byte-aligned blocks.

    Segments are created lazily (the first on the first alloc) up to max_bytes in total,
    and filled first-fit in creation order, so load settles on the oldest and the ones a
    burst added fall idle: trim() gives back each that held no block for ``idle_s``, all
    but the first. Thread-safe. close() unmaps and unlinks everything; it also runs at
    interpreter exit.
    """

    def __init__(self, role: str, segment_size: int = 64 << 20, max_bytes: int = 1 << 30,
                 idle_s: float = IDLE_S) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.]+", role):
            raise ValueError(f"arena role must be alphanumeric, got {role!r}")
        self.role = role
        self.segment_size = _round_up(max(segment_size, _PAGE), _PAGE)
        self.max_bytes = max_bytes
        self.idle_s = idle_s
        self._pid = os.getpid()
        self._segs: dict[str, _Segment] = {}
        self._mapped = 0
        self._used = 0
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _release, self._segs, self._pid)

    @property
    def used_bytes(self) -> int:
        """Bytes held by live blocks (each rounded up to the alignment)."""
        return self._used

    @property
    def mapped_bytes(self) -> int:
        return self._mapped

    @property
    def segments(self) -> list[str]:
        return list(self._segs)

    def alloc(self, nbytes: int) -> Block:
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        size = _round_up(max(nbytes, 1), ALIGN)
        with self._lock:
            if self._closed:
                raise ShmUnavailable(f"arena '{self.role}' is closed")
            for seg in self._segs.values():
                off = seg.alloc(size)
                if off is not None:
                    break
            else:
                seg = self._grow(size)
                off = seg.alloc(size)
                assert off is not None
            seg.idle_since = None
            self._used += size
        return Block(seg.name, off, nbytes, seg.whole[off:off + nbytes])

    def free(self, segment: str, offset: int) -> None:
        """Return a block. KeyError for an unknown block or a double free."""
        with self._lock:
            if self._closed:
                return  # everything went with close(); late frees at shutdown are fine
            seg = self._segs.get(segment)
            if seg is None:
                raise KeyError(f"segment {segment!r} does not belong to this arena")
            size = seg.used.get(offset)
            if size is None:
                raise KeyError(f"no live block at {segment}+{offset} (double free?)")
            seg.free(offset)
            self._used -= size
            if not seg.used:
                seg.idle_since = time.monotonic()

    def trim(self, now: float | None = None) -> list[str]:
        """Unmap and unlink every segment but the first that has held no block for
        ``idle_s`` seconds (``now``: a time.monotonic() reading). Returns their names. A
        view of a freed block still held keeps its mapping until it is collected; a
        consumer's mapping keeps the pages until it unmaps (SegmentMap.sweep)."""
        if now is None:
            now = time.monotonic()
        with self._lock:
            if self._closed or len(self._segs) < 2:
                return []
            base = next(iter(self._segs))   # dicts keep creation order; it is never removed
            idle = [seg for seg in self._segs.values()
                    if seg.idle_since is not None and now - seg.idle_since >= self.idle_s
                    and seg.name != base]
            for seg in idle:
                del self._segs[seg.name]
                self._mapped -= seg.size
        for seg in idle:   # no block of theirs is live: nobody else can reach them now
            seg.unmap()
            if os.getpid() == self._pid:   # (as _release: never a parent's memory)
                _unlink(seg.name)
        return [seg.name for seg in idle]

    def close(self) -> None:
        """Unmap and unlink every segment. Idempotent."""
        with self._lock:
            self._closed = True
            self._mapped = self._used = 0
            self._finalizer()

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _grow(self, size: int) -> _Segment:
        left = self.max_bytes - self._mapped
        want = _round_up(size, _PAGE)
        if want > left:
            raise ShmUnavailable(
                f"arena '{self.role}' is full: {size} more bytes would exceed its limit of "
                f"{self.max_bytes} bytes ({self._used} in use)")
        seg_size = min(max(self.segment_size, want), left // _PAGE * _PAGE)
        while True:
            name = f"{PREFIX}{self._pid}-{self.role}-{next(_counter)}{_NS_SUFFIX}"
            try:
                mm = _create_segment(name, seg_size)
                break
            except FileExistsError:
                continue  # left by an earlier process with our pid: never touch it
        seg = _Segment(name, seg_size, mm)
        self._segs[name] = seg
        self._mapped += seg_size
        return seg


class SegmentMap:
    """Other processes' segments, mapped by name on first use and cached until a sweep()
    finds them unused: an owner's idle segment, unlinked by its trim(), keeps its pages for
    as long as anyone maps it."""

    def __init__(self, writable: bool = False) -> None:
        self._writable = writable
        self._maps: dict[str, tuple[mmap.mmap, memoryview]] = {}
        self._touched: set[str] = set()   # viewed since the last sweep
        self._lock = threading.Lock()

    def view(self, segment: str, offset: int, nbytes: int) -> memoryview:
        entry = self._maps.get(segment)
        if entry is None:
            entry = self._attach(segment)
        self._touched.add(segment)
        whole = entry[1]
        if offset < 0 or nbytes < 0 or offset + nbytes > len(whole):
            raise internal(f"block {segment}+{offset}:{nbytes} lies outside the "
                           f"{len(whole)}-byte segment")
        return whole[offset:offset + nbytes]

    def sweep(self) -> list[str]:
        """Drop every mapping not viewed since the previous sweep; returns their names.
        One still in use is mapped again by its next view() (segment names are never
        reused). Safe against a view() on another thread: the mappings are not closed
        here, only dropped, so a view() that already holds one finishes with it, and each
        is unmapped when its last view (or that caller) lets go of it: at once, mostly."""
        with self._lock:
            touched, self._touched = self._touched, set()
            gone = {name: entry for name, entry in self._maps.items() if name not in touched}
            for name in gone:
                del self._maps[name]
        names = list(gone)
        del gone   # the last references: their mmaps close now unless a view holds one
        return names

    def forget(self, segment: str) -> None:
        """Drop a mapping (its owner freed or died); views already handed out stay valid."""
        with self._lock:
            entry = self._maps.pop(segment, None)
        if entry is not None:
            unmap(entry)

    def close(self) -> None:
        with self._lock:
            entries = list(self._maps.values())
            self._maps.clear()
        for entry in entries:
            unmap(entry)

    def forget_owner(self, pid: int) -> None:
        """Unmap every segment of process ``pid`` (it exited; its names are unlinked)."""
        prefix = f"{PREFIX}{pid}-"
        for name in [n for n in list(self._maps) if n.startswith(prefix)]:
            self.forget(name)

    def __contains__(self, segment: str) -> bool:
        return segment in self._maps

    def _attach(self, segment: str) -> tuple[mmap.mmap, memoryview]:
        if not _NAME_RE.match(segment):  # names arrive in messages: no paths, no strangers
            raise internal(f"invalid shared memory segment name {segment!r}")
        with self._lock:
            entry = self._maps.get(segment)
            if entry is not None:
                return entry
            flags, prot = (os.O_RDWR, mmap.PROT_READ | mmap.PROT_WRITE) if self._writable \
                else (os.O_RDONLY, mmap.PROT_READ)
            try:
                fd = os.open(_path(segment), flags)
            except OSError as e:
                raise internal(f"cannot open shared memory segment {segment!r}: "
                               f"{e.strerror}") from e
            try:
                size = os.fstat(fd).st_size
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
            except (OSError, ValueError) as e:
                raise internal(f"cannot map shared memory segment {segment!r}: {e}") from e
            finally:
                os.close(fd)
            entry = (mm, memoryview(mm))
            self._maps[segment] = entry
            return entry


class Housekeeper:
    """A process's tidying, one tick every HOUSEKEEPING_S: its idle segments go
    (arena.trim), mappings of others' segments nobody read since the last tick go
    (segments.sweep), and once traffic stops (``busy``, set by the process on each request
    or batch, was not set this tick but was before) or after a release, the C heap hands
    its free pages back (malloc_trim: glibc keeps what big request bodies freed). Not under
    steady traffic: the pages it gives back would be faulted in again at once."""
    __slots__ = ("arena", "busy", "segments", "_dirty")

    def __init__(self, arena: Arena | None, segments: SegmentMap) -> None:
        self.arena, self.segments = arena, segments
        self.busy = False
        self._dirty = False              # traffic since the heap was last trimmed

    def tick(self, now: float | None = None) -> bool:
        """One tick; whether anything was released."""
        busy, self.busy = self.busy, False   # (a flag lost to a race: one tick later)
        released = bool(self.arena.trim(now)) if self.arena is not None else False
        released = bool(self.segments.sweep()) or released
        if busy:
            self._dirty = True
        elif released or self._dirty:
            malloc_trim()
            self._dirty = False
        return released


def unmap(entry: tuple[mmap.mmap, memoryview]) -> None:
    """Close a mapping and its whole-view; one still read through a view it handed out
    goes when that view is collected."""
    mm, whole = entry
    try:
        whole.release()
        mm.close()
    except BufferError:
        pass


def _pid_namespace() -> str:
    try:
        link = os.readlink("/proc/self/ns/pid")          # "pid:[4026531836]"
    except OSError:
        return ""
    return "".join(c for c in link if c.isdigit())


_PIDNS = _pid_namespace()
_NS_SUFFIX = f"-n{_PIDNS}" if _PIDNS else ""


def _owner_pid(name: str) -> int | None:
    """The owner pid of one of our segments: None for other names and for segments of
    another pid namespace (their pid means nothing here)."""
    m = _NAME_RE.match(name)
    if m is None or (m.group(2) or _PIDNS) != _PIDNS:
        return None
    return int(m.group(1))


def by_owner(blocks: list[tuple[str, int]]) -> dict[int, list[tuple[str, int]]]:
    """Blocks (segment, offset) grouped by the pid their segment's name gives: whose
    release message each goes in."""
    out: dict[int, list[tuple[str, int]]] = {}
    for segment, offset in blocks:   # trireme-<owner pid>-<role>-<n>[-n<pidns>]
        out.setdefault(int(segment.split("-")[1]), []).append((segment, offset))
    return out


def domain() -> str:
    """This process's shared-memory domain: processes that report the same id see the same
    /dev/shm, so one can map the other's segments; "" when there is no usable /dev/shm.
    The id is a random token in a file of /dev/shm, made by the first process to ask."""
    path = _path(_DOMAIN_FILE)
    for _ in range(2):
        try:
            with open(path, encoding="ascii") as f:
                token = f.read().strip()
            if token:
                return token
        except FileNotFoundError:
            pass
        except OSError:
            return ""
        try:   # write a private file whole, then link it in: readers never see it half made
            tmp = _path(f"{_DOMAIN_FILE}.{os.getpid()}.{next(_counter)}")
            with open(tmp, "w", encoding="ascii") as f:
                f.write(os.urandom(12).hex())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass   # another process won the race: read its token
            finally:
                os.unlink(tmp)
        except OSError:
            return ""
    return ""


def _listdir() -> list[str]:
    try:
        return os.listdir(SHM_DIR)
    except OSError:
        return []


def unlink_segments_of(pid: int) -> list[str]:
    """Unlink every segment owned by `pid` (a dead child); returns the names removed."""
    return [name for name in _listdir()
            if _owner_pid(name) == pid and _unlink(name)]




def sweep_stale() -> list[str]:
    """Unlink segments whose owner process no longer exists; returns the names removed."""
    me = os.getpid()
    removed = []
    for name in _listdir():
        pid = _owner_pid(name)
        if pid is not None and pid != me and not pid_alive(pid) and _unlink(name):
            removed.append(name)
    return removed


def shm_available(min_bytes: int) -> bool:
    """Whether /dev/shm exists and has at least min_bytes free."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= min_bytes
