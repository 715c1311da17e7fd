import gc
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from services.common import shm
from services.common.errors import Code, TriremeError
from services.common.shm import ALIGN, Arena, SegmentMap, ShmUnavailable

ROOT = Path(__file__).resolve().parents[3]
KIB = 1024


def my_segments() -> list[str]:
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"trireme-{os.getpid()}-"))


@pytest.fixture(autouse=True)
def no_leaks():
    before = set(my_segments())
    yield
    gc.collect()
    assert set(my_segments()) == before, "test left segments in /dev/shm"


@pytest.fixture
def arena():
    a = Arena("test", segment_size=64 * KIB, max_bytes=256 * KIB)
    yield a
    a.close()


def run_child(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_lazy_first_segment_and_naming(arena):
    assert arena.segments == [] and my_segments() == []
    block = arena.alloc(10)
    assert len(arena.segments) == 1
    name = arena.segments[0]
    assert name.startswith(f"trireme-{os.getpid()}-test-")
    assert my_segments() == [name]
    assert os.stat(f"/dev/shm/{name}").st_mode & 0o777 == 0o600
    assert (block.segment, block.offset, block.nbytes, len(block.view)) == (name, 0, 10, 10)


def test_alignment_and_writable_views(arena):
    blocks = [arena.alloc(n) for n in (1, 63, 64, 65, 0, 1000)]
    for b in blocks:
        assert b.offset % ALIGN == 0
        assert len(b.view) == b.nbytes and not b.view.readonly
    starts = [b.offset for b in blocks]
    assert len(set(starts)) == len(starts)
    blocks[3].view[:] = b"\xab" * 65
    assert bytes(blocks[3].view) == b"\xab" * 65
    assert arena.used_bytes == 64 + 64 + 64 + 128 + 64 + 1024


def test_free_coalesces_and_reuses(arena):
    a, b, c = (arena.alloc(KIB) for _ in range(3))
    arena.free(a.segment, a.offset)
    arena.free(c.segment, c.offset)
    arena.free(b.segment, b.offset)  # joins both neighbours: one hole again
    assert arena.used_bytes == 0
    big = arena.alloc(64 * KIB)  # needs the whole segment, so the holes must have merged
    assert big.offset == 0 and len(arena.segments) == 1
    arena.free(big.segment, big.offset)


def test_first_fit_fills_earliest_hole(arena):
    blocks = [arena.alloc(256) for _ in range(4)]
    arena.free(blocks[1].segment, blocks[1].offset)
    again = arena.alloc(200)
    assert again.offset == blocks[1].offset


def test_random_alloc_free_keeps_invariants():
    with Arena("fuzz", segment_size=128 * KIB, max_bytes=128 * KIB) as a:
        rng = random.Random(7)
        live = []
        for _ in range(3000):
            if live and (rng.random() < 0.5 or a.used_bytes > 64 * KIB):
                b = live.pop(rng.randrange(len(live)))
                assert bytes(b.view[:1]) == bytes([b.offset % 251])  # nobody overwrote it
                a.free(b.segment, b.offset)
            else:
                b = a.alloc(rng.randrange(1, 4 * KIB))
                b.view[:1] = bytes([b.offset % 251])
                spans = sorted((x.offset, x.offset + x.nbytes) for x in live + [b])
                assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))
                live.append(b)
        for b in live:
            a.free(b.segment, b.offset)
        assert a.used_bytes == 0
        assert a.alloc(128 * KIB).offset == 0  # fully coalesced back into one hole


def test_grows_then_refuses_beyond_max(arena):
    blocks = [arena.alloc(64 * KIB) for _ in range(3)]
    assert len({b.segment for b in blocks}) == 3
    oversized = arena.alloc(60 * KIB)  # 64 KiB left under the limit
    assert len(arena.segments) == 4
    assert arena.alloc(4 * KIB).segment == oversized.segment  # the tail still fits
    with pytest.raises(ShmUnavailable, match="exceed its limit"):
        arena.alloc(1)
    arena.free(oversized.segment, oversized.offset)
    assert arena.alloc(60 * KIB).segment == oversized.segment


def test_oversized_request_gets_its_own_segment():
    with Arena("big", segment_size=64 * KIB, max_bytes=1 << 20) as a:
        b = a.alloc(200 * KIB + 1)
        assert os.stat(f"/dev/shm/{b.segment}").st_size >= 200 * KIB + 1
        with pytest.raises(ShmUnavailable):
            a.alloc(2 << 20)


def test_double_free_and_unknown_block(arena):
    b = arena.alloc(100)
    arena.free(b.segment, b.offset)
    with pytest.raises(KeyError, match="double free"):
        arena.free(b.segment, b.offset)
    with pytest.raises(KeyError):
        arena.free("trireme-1-other-0", 0)
    c = arena.alloc(100)
    with pytest.raises(KeyError):
        arena.free(c.segment, c.offset + ALIGN)


def test_close_unlinks_everything_and_is_idempotent():
    a = Arena("closing", segment_size=64 * KIB, max_bytes=1 << 20)
    held = [a.alloc(40 * KIB) for _ in range(3)]  # live views must not break close()
    assert len(my_segments()) == 3
    a.close()
    assert my_segments() == []
    a.close()
    a.free(held[0].segment, held[0].offset)  # late free after close is ignored
    with pytest.raises(ShmUnavailable):
        a.alloc(1)


def test_segment_creation_failure_is_shm_unavailable(monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", "/nonexistent-trireme-dir")
    a = Arena("nodir", segment_size=64 * KIB)
    with pytest.raises(ShmUnavailable, match="cannot create shared memory"):
        a.alloc(1)
    a.close()


def test_segment_visible_from_child_process(arena):
    b = arena.alloc(11)
    b.view[:] = b"hello world"
    out = run_child(f"""
        from services.common.shm import SegmentMap
        m = SegmentMap(writable=True)
        v = m.view({b.segment!r}, {b.offset}, {b.nbytes})
        print(bytes(v).decode())
        v[:5] = b"HELLO"
        del v
        m.close()
    """)
    assert out.strip() == "hello world"
    assert bytes(b.view) == b"HELLO world"


def test_segment_map_in_process(arena):
    b = arena.alloc(8)
    b.view[:] = b"abcdefgh"
    m = SegmentMap()
    v = m.view(b.segment, b.offset, 8)
    assert v.readonly and bytes(v) == b"abcdefgh"
    assert b.segment in m
    b.view[:1] = b"z"
    assert bytes(v[:1]) == b"z"  # shared, not copied
    with pytest.raises(TriremeError, match="outside") as e:
        m.view(b.segment, 64 * KIB - 4, 8)
    assert e.value.code == Code.INTERNAL
    m.forget(b.segment)  # live view v: tolerated, not a crash
    assert b.segment not in m
    m.close()
    assert bytes(v) == b"zbcdefgh"


def test_segment_map_missing_and_bad_names():
    m = SegmentMap()
    with pytest.raises(TriremeError, match="cannot open") as e:
        m.view(f"trireme-{os.getpid()}-ghost-999999", 0, 1)
    assert e.value.code == Code.INTERNAL
    for bad in ("../etc/passwd", "trireme-1-x/../../y-0", "other"):
        with pytest.raises(TriremeError, match="invalid"):
            m.view(bad, 0, 1)
    m.close()


CHILD_LEAKS = """
    import os
    from services.common.shm import Arena
    a = Arena("leak", segment_size=64 * 1024)
    print(a.alloc(10).segment, flush=True)
    os._exit(0)  # dies without close(): its segment stays behind
"""


def test_sweep_stale_removes_dead_owners_segments(arena):
    name = run_child(CHILD_LEAKS).strip()
    assert os.path.exists(f"/dev/shm/{name}")
    arena.alloc(1)  # ours is alive and must survive the sweep
    removed = shm.sweep_stale()
    assert name in removed and not os.path.exists(f"/dev/shm/{name}")
    assert all(os.path.exists(f"/dev/shm/{n}") for n in arena.segments)


def test_unlink_segments_of_pid():
    name = run_child(CHILD_LEAKS).strip()
    pid = int(name.split("-")[1])
    assert shm.unlink_segments_of(pid) == [name]
    assert shm.unlink_segments_of(pid) == []  # racing a second supervisor is harmless


def test_shm_available():
    assert shm.shm_available(1)
    assert not shm.shm_available(1 << 62)


# ---------------------------------------------------------------- idle segments, sweeps
def mapped_in_process(name: str) -> int:
    """How many mappings of segment ``name`` this process holds (unlinked ones too)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f
                   if line.rstrip().removesuffix(" (deleted)").endswith(f"/{name}"))


class Ref(NamedTuple):
    """A block without its view (a view held keeps its segment mapped)."""
    segment: str
    offset: int


def full_segments(a: Arena, n: int) -> list[Ref]:
    """One block filling each of ``n`` segments (64 KiB each): segment i holds block i."""
    blocks = [Ref(*a.alloc(64 * KIB)[:2]) for _ in range(n)]
    assert [b.segment for b in blocks] == a.segments
    return blocks


def free(a: Arena, *blocks: Ref | shm.Block) -> None:
    for b in blocks:
        a.free(b.segment, b.offset)


def test_trim_releases_idle_segments_but_the_first(arena):
    blocks = full_segments(arena, 3)
    free(arena, *blocks)
    t = time.monotonic()
    assert arena.trim(t) == []                      # not idle long enough yet
    assert len(arena.segments) == 3
    released = arena.trim(t + arena.idle_s + 1)
    assert released == [blocks[1].segment, blocks[2].segment]
    assert arena.segments == [blocks[0].segment]    # the base stays, idle or not
    assert my_segments() == [blocks[0].segment]     # the others' files are gone
    assert arena.mapped_bytes == 64 * KIB and arena.used_bytes == 0
    assert mapped_in_process(blocks[1].segment) == 0
    assert arena.trim(t + 10 * arena.idle_s) == []


def test_trim_keeps_segments_with_a_live_block(arena):
    blocks = full_segments(arena, 2)
    small = arena.alloc(KIB)                        # a third segment, kept busy
    free(arena, blocks[1])
    assert arena.trim(time.monotonic() + arena.idle_s + 1) == [blocks[1].segment]
    assert arena.segments == [blocks[0].segment, small.segment]
    small.view[:] = b"x" * KIB                      # still mapped and writable
    free(arena, blocks[0], small)


def test_trim_keeps_a_segment_used_again(arena):
    blocks = full_segments(arena, 2)
    free(arena, blocks[1])
    again = arena.alloc(64 * KIB)                   # reuses the freed segment
    assert again.segment == blocks[1].segment
    assert arena.trim(time.monotonic() + arena.idle_s + 1) == []
    free(arena, again)                              # idle from now, not from the first free
    t = time.monotonic()
    assert arena.trim(t + arena.idle_s / 2) == []
    assert arena.trim(t + arena.idle_s + 1) == [blocks[1].segment]
    free(arena, blocks[0])


def test_allocation_after_trim_fills_older_segments_first(arena):
    blocks = full_segments(arena, 3)
    free(arena, *blocks)
    arena.trim(time.monotonic() + arena.idle_s + 1)
    again = [arena.alloc(64 * KIB) for _ in range(2)]
    assert again[0].segment == blocks[0].segment
    assert again[1].segment not in (b.segment for b in blocks)   # a new name, never reused
    assert arena.mapped_bytes == 128 * KIB
    free(arena, *again)


def test_trim_tolerates_a_view_still_held(arena):
    base = arena.alloc(64 * KIB)
    block = arena.alloc(64 * KIB)
    block.view[:4] = b"kept"
    held, name = block.view, block.segment
    free(arena, base, block)
    del block
    assert arena.trim(time.monotonic() + arena.idle_s + 1) == [name]
    assert not os.path.exists(f"{shm.SHM_DIR}/{name}")
    assert bytes(held[:4]) == b"kept"               # unlinked, but its pages live on
    assert mapped_in_process(name) == 1
    del held                                        # ... until the view goes
    assert mapped_in_process(name) == 0


def test_sweep_unmaps_untouched_and_maps_again_on_view(arena):
    b = arena.alloc(8)
    b.view[:] = b"abcdefgh"
    m = SegmentMap()
    assert bytes(m.view(b.segment, b.offset, 8)) == b"abcdefgh"
    assert mapped_in_process(b.segment) == 2        # the arena's and the map's
    assert m.sweep() == []                          # viewed since the last sweep
    assert b.segment in m
    assert m.sweep() == [b.segment]                 # not since
    assert b.segment not in m and mapped_in_process(b.segment) == 1
    b.view[:1] = b"z"
    assert bytes(m.view(b.segment, b.offset, 8)) == b"zbcdefgh"   # mapped again
    assert b.segment in m
    m.close()


def test_views_handed_out_before_a_sweep_stay_readable(arena):
    b = arena.alloc(8)
    b.view[:] = b"abcdefgh"
    m = SegmentMap()
    v = m.view(b.segment, b.offset, 8)
    m.sweep()
    assert m.sweep() == [b.segment]
    assert bytes(v) == b"abcdefgh"                  # the view keeps its mapping alive
    assert mapped_in_process(b.segment) == 2
    del v                                           # ... until it goes
    assert mapped_in_process(b.segment) == 1
    m.close()


def test_sweep_after_owner_trimmed_frees_the_pages(arena):
    blocks = full_segments(arena, 2)
    m = SegmentMap()
    bytes(m.view(blocks[1].segment, 0, 16))
    free(arena, *blocks)
    arena.trim(time.monotonic() + arena.idle_s + 1)
    assert mapped_in_process(blocks[1].segment) == 1   # unlinked; the consumer maps it
    m.sweep()
    m.sweep()
    assert mapped_in_process(blocks[1].segment) == 0
    m.close()


def test_sweep_is_safe_against_views_on_another_thread(arena):
    b = arena.alloc(64)
    b.view[:] = bytes(range(64))
    m = SegmentMap()
    stop = threading.Event()
    errors: list[Exception] = []

    def read() -> None:
        try:
            while not stop.is_set():
                assert bytes(m.view(b.segment, b.offset, 64)) == bytes(range(64))
        except Exception as e:  # noqa: BLE001 - any failure of a view is the finding
            errors.append(e)

    t = threading.Thread(target=read)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)                 # threads take turns as often as they can
    t.start()
    try:
        for _ in range(5000):
            m.sweep()
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(interval)
    assert errors == []
    m.close()


def test_housekeep_trims_sweeps_and_says_so(arena, monkeypatch):
    trims: list[int] = []
    monkeypatch.setattr(shm, "malloc_trim", lambda: trims.append(1) or True)
    blocks = full_segments(arena, 2)
    m = SegmentMap()
    m.view(blocks[0].segment, 0, 1)
    free(arena, *blocks)
    now = time.monotonic() + arena.idle_s + 1
    keeper = shm.Housekeeper(arena, m)
    assert not keeper.tick(now=now - arena.idle_s - 1)
    assert trims == []                              # nothing released, no traffic
    assert keeper.tick(now=now)
    assert arena.segments == [blocks[0].segment] and blocks[0].segment not in m
    assert trims == [1]
    keeper = shm.Housekeeper(None, m)
    keeper.busy = True
    assert not keeper.tick() and trims == [1]       # under traffic: not yet
    assert not keeper.tick() and trims == [1, 1]    # traffic stopped: the heap is trimmed
    assert not keeper.tick() and trims == [1, 1]    # ... once
    m.close()
