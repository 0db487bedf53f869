"""Shared-memory arenas: where a storage unit of the Ray transport keeps tensor bytes.

An :class:`Arena` is a set of segments, each a ``memfd`` (anonymous shared memory the
kernel frees once no process maps it or holds its descriptor), carved into blocks by a
first-fit allocator. On the unit's node, producers and readers map the same segments
(``/proc/<unit pid>/fd/<fd>``): a producer copies a tensor into a block once, and a reader
views the block in place, so a put copies the bytes once and a read copies nothing.

Freed blocks are reused, so pages stay warm (on a VM a page written for the first time
can cost 20x a page written before) and memory stays bounded: the arena grows only when
no free block fits.

This module does not import torch: storage-unit actors run without it.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import mmap
import os
import threading
from collections.abc import Iterable
from typing import Literal, NamedTuple, overload

import numpy as np

__all__ = ["Arena", "ShmRef", "SEGMENT_BYTES", "map_segment", "map_private"]

log = logging.getLogger("streamrl.arena")

#: default segment size; bigger blocks get a segment of their own size. Small enough that
#: an arena holds little more than its rows (it grows a segment at a time), big enough that
#: few are needed
SEGMENT_BYTES = 16 << 20
_ALIGN = 64  # block alignment (a cache line; enough for every dtype)
_GROW = 2 << 20  # segment sizes are multiples of this


class ShmRef(NamedTuple):
    """Where a block lives: storage unit, segment, offset and size (bytes)."""

    unit: int
    seg: int
    off: int
    size: int


def map_segment(path: str, size: int) -> mmap.mmap:
    """Map a segment (by its ``/proc/<pid>/fd/<fd>`` path) read-write, pages populated.
    The mapping stays valid after the segment's owner dies."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)


def map_private(path: str, size: int) -> mmap.mmap:
    """Map a segment (by its ``/proc/<pid>/fd/<fd>`` path) copy-on-write: reads see the
    segment's bytes, writes go to pages of this process's own and never reach the
    segment. Pages are mapped as they are touched (no copy until written). Bytes the
    owner changes later show through pages not written here yet, so map only blocks that
    stay pinned while the mapping is used."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class _MemfdSegment:
    __slots__ = ("fd", "size", "array", "free")

    def __init__(self, fd: int, size: int):
        self.fd = fd
        self.size = size
        self.array = np.frombuffer(map_segment(f"/proc/self/fd/{fd}", size), dtype=np.uint8)
        self.free: list[list[int]] = [[0, size]]  # [offset, size], sorted by offset


class Arena:
    """Blocks of shared memory for one storage unit.

    Args:
        unit: the unit's index (stamped into each :class:`ShmRef`).
        segment_bytes: size of a new segment (a block bigger than this gets a segment of
            its own).

    Keyword Args:
        reserve: bytes of segments to make at once, on a background thread, so that the
            first puts find their pages already faulted in (a page's first write costs
            many times a later one on a VM). Default 0.
        ahead: bytes of spare segments to keep made beyond what blocks use, on the same
            thread, so a growing arena rarely waits for a new segment. Default 0.
        limit: the arena never makes spare segments past this size (``None``: no bound
            but ``reserve`` and ``ahead``).

    Spare segments are handed to :meth:`alloc` when a block needs a new standard-size
    segment; until then they hold memory (they count in :attr:`size`).

    Examples:
        >>> a = Arena(0, segment_bytes=1 << 20)
        >>> ref = a.alloc(1000)
        >>> a.view(ref)[:3] = 7
        >>> a.used
        1024
        >>> a.free(ref)
        >>> a.used, a.size
        (0, 1048576)
    """

    def __init__(self, unit: int = 0, segment_bytes: int = SEGMENT_BYTES, *,
                 reserve: int = 0, ahead: int = 0, limit: int | None = None):
        self.unit = unit
        self.segment_bytes = segment_bytes
        self.segments: list[_MemfdSegment] = []
        self.used = 0  # bytes in allocated blocks
        self._names = itertools.count()
        # spare segments made ahead of need by the prefault thread
        self._spare: list[_MemfdSegment] = []
        self._spare_lock = threading.Lock()
        self.reserve, self.ahead, self.limit = reserve, ahead, limit
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        if reserve > 0 or ahead > 0:
            self._thread = threading.Thread(target=self._prefault, daemon=True,
                                            name=f"streamrl-arena{unit}-prefault")
            self._thread.start()
            self._wake.set()

    @property
    def size(self) -> int:
        """Bytes of shared memory the arena holds (used, free, or spare)."""
        with self._spare_lock:
            spare = sum(s.size for s in self._spare)
        return sum(s.size for s in self.segments) + spare

    def _more(self) -> bool:
        """Whether the prefault thread makes another segment: the arena is smaller than
        ``reserve`` or than what blocks use plus ``ahead`` (whole segments, rounded up),
        and one more stays within ``limit``."""
        size = self.size
        if self.limit is not None and size + self.segment_bytes > self.limit:
            return False
        return size < max(self.reserve, self.used + self.ahead)

    def _prefault(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            while not self._closed and self._more():
                try:
                    seg = self._make(self.segment_bytes)
                except OSError as e:  # out of shared memory: puts grow (or go inline)
                    log.warning("streamrl: arena of unit %d cannot make spare segments (%s)",
                                self.unit, e)
                    return
                with self._spare_lock:
                    self._spare.append(seg)

    def close(self) -> None:
        """Stop the prefault thread (the segments stay until the process lets go)."""
        self._closed = True
        self._wake.set()

    @overload
    def alloc(self, nbytes: int, grow: Literal[True] = True) -> ShmRef: ...
    @overload
    def alloc(self, nbytes: int, grow: bool) -> ShmRef | None: ...

    def alloc(self, nbytes: int, grow: bool = True) -> ShmRef | None:
        """A block of at least ``nbytes`` (first fit; a new segment when none fits, or
        ``None`` without ``grow``)."""
        need = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        for i, seg in enumerate(self.segments):
            for j, (off, size) in enumerate(seg.free):
                if size >= need:
                    if size == need:
                        del seg.free[j]
                    else:
                        seg.free[j] = [off + need, size - need]
                    self.used += need
                    return ShmRef(self.unit, i, off, need)
        if not grow:
            return None
        seg = self._grow(need)
        if self._thread is not None:
            self._wake.set()  # make the next spare while this block is written
        off, size = seg.free[0]
        seg.free[0] = [need, size - need]
        if size == need:
            del seg.free[0]
        self.used += need
        return ShmRef(self.unit, len(self.segments) - 1, 0, need)

    def _grow(self, need: int) -> _MemfdSegment:
        seg = None
        if need <= self.segment_bytes:
            with self._spare_lock:
                if self._spare:
                    seg = self._spare.pop(0)
        if seg is None:
            seg = self._make(self.segment_bytes if need <= self.segment_bytes
                             else -(-need // _GROW) * _GROW)
        self.segments.append(seg)
        return seg

    def _make(self, size: int) -> _MemfdSegment:
        fd = os.memfd_create(f"streamrl-unit{self.unit}-{next(self._names)}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # the pages exist now, not at first write
            return _MemfdSegment(fd, size)
        except OSError:
            os.close(fd)
            raise

    def free(self, ref: ShmRef) -> None:
        """Give a block back (merged with free neighbours)."""
        seg = self.segments[ref.seg]
        free = seg.free
        i = bisect.bisect_left(free, [ref.off, 0])
        off, size = ref.off, ref.size
        if i < len(free) and free[i][0] == off + size:  # merge the next one
            size += free[i][1]
            del free[i]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == off:  # merge the previous one
            free[i - 1][1] += size
        else:
            free.insert(i, [off, size])
        self.used -= ref.size

    def view(self, ref: ShmRef) -> np.ndarray:
        """The block's bytes (a flat ``uint8`` view, no copy)."""
        return self.segments[ref.seg].array[ref.off:ref.off + ref.size]

    def where(self, refs: Iterable[ShmRef]) -> dict[int, tuple[int, int]]:
        """``{segment: (fd, size)}`` of the segments ``refs`` lie in: what a process on
        this node needs to map them (``/proc/<this pid>/fd/<fd>``)."""
        return {r.seg: (self.segments[r.seg].fd, self.segments[r.seg].size) for r in refs}
