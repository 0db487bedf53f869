"""The shared-memory arena of the Ray storage units (streamrl.arena): blocks never
overlap, freed space is merged and reused, and another process sees the bytes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

arena_mod = pytest.importorskip("streamrl.arena")
if not hasattr(os, "memfd_create"):
    pytest.skip("memfd is Linux-only", allow_module_level=True)

Arena = arena_mod.Arena
SEG = 1 << 20


def _check(a: Arena, live: dict) -> None:
    """Live blocks do not overlap each other or free space; free lists are sorted and
    merged; ``used`` is the sum of live blocks."""
    for i, seg in enumerate(a.segments):
        spans = sorted([(r.off, r.size) for r in live if r.seg == i] + [tuple(f) for f in seg.free])
        end = 0
        for off, size in spans:
            assert off >= end, f"overlap in segment {i}: {spans}"
            assert off % 64 == 0 and size > 0
            end = off + size
        assert end <= seg.size
        for (o1, s1), (o2, _) in zip(seg.free, seg.free[1:]):
            assert o1 + s1 < o2, f"free ranges not merged: {seg.free}"
    assert a.used == sum(r.size for r in live)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, SEG // 3), st.integers(0, 10**6)),
                min_size=1, max_size=60))
def test_blocks_never_overlap_and_free_space_is_merged(ops):
    a = Arena(0, segment_bytes=SEG)
    live: dict = {}
    for alloc, size, pick in ops:
        if alloc or not live:
            ref = a.alloc(size)
            assert ref.size >= size
            a.view(ref)[:] = len(live) % 251  # the whole block is writable
            live[ref] = len(live) % 251
        else:
            ref = list(live)[pick % len(live)]
            assert (a.view(ref) == live.pop(ref)).all()  # nobody wrote over it
            a.free(ref)
        _check(a, live)
    for ref in list(live):
        a.free(ref)
        del live[ref]
    _check(a, live)
    assert a.used == 0
    assert all(seg.free == [[0, seg.size]] for seg in a.segments)


def test_freed_space_is_reused_before_growing():
    a = Arena(0, segment_bytes=SEG)
    refs = [a.alloc(SEG // 4) for _ in range(4)]
    assert a.size == SEG
    for r in refs[1:3]:
        a.free(r)
    again = a.alloc(SEG // 2)  # fits the merged hole of the two freed blocks
    assert (again.seg, again.off) == (0, SEG // 4) and a.size == SEG
    assert a.alloc(SEG // 2, grow=False) is None  # no room, and told not to grow
    big = a.alloc(3 * SEG)  # bigger than a segment: a segment of its own
    assert big.seg == 1 and 3 * SEG <= a.segments[1].size < 3 * SEG + (2 << 20)


def test_another_process_sees_the_bytes():
    a = Arena(0, segment_bytes=SEG)
    ref = a.alloc(4096)
    a.view(ref)[:] = np.arange(4096, dtype=np.uint8)
    fd, size = a.where([ref])[ref.seg]
    code = (
        "import numpy as np, sys; from streamrl.arena import map_segment\n"
        f"mm = map_segment('/proc/{os.getpid()}/fd/{fd}', {size})\n"
        f"v = np.frombuffer(mm, np.uint8, count=4096, offset={ref.off})\n"
        "assert (v == np.arange(4096, dtype=np.uint8)).all()\n"
        "v[:] = 7\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (a.view(ref) == 7).all()  # and writes of that process are seen here


def _until(cond, what: str, timeout: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_reserve_makes_segments_ahead_and_alloc_takes_them():
    """reserve= makes that many bytes of segments on a background thread; blocks that
    need a new segment take a spare (no new memfd), and the arena holds no more than
    asked for."""
    a = Arena(0, segment_bytes=SEG, reserve=3 * SEG)
    try:
        _until(lambda: a.size == 3 * SEG, "the reserve")
        assert a.segments == [] and len(a._spare) == 3
        live = {}
        for i in range(3):
            r = a.alloc(SEG)  # one whole segment each
            live[r] = i
        _check(a, live)
        assert len(a.segments) == 3 and a._spare == [] and a.size == 3 * SEG
        a.alloc(SEG)  # past the reserve: made on demand
        assert a.size == 4 * SEG
    finally:
        a.close()


def test_ahead_keeps_spare_room_within_the_limit():
    """ahead= keeps that much spare beyond what blocks use, never past limit=."""
    a = Arena(0, segment_bytes=SEG, ahead=SEG, limit=3 * SEG)
    try:
        _until(lambda: a.size == SEG, "the first spare")
        refs = [a.alloc(SEG) for _ in range(2)]
        _until(lambda: a.size == 3 * SEG, "a spare beyond the 2 used segments")
        refs.append(a.alloc(SEG))
        import time

        time.sleep(0.2)
        assert a.size == 3 * SEG  # the limit: no spare past it
        for r in refs:
            a.free(r)
        assert a.used == 0
    finally:
        a.close()
