"""Checkpoints on the Ray transport: each storage unit writes and reads its own files.

:class:`UnitCheckpoint` (mixed into :class:`~streamrl.transport.ray.unit.StorageActorImpl`)
writes a unit's rows of a checkpoint's cut beside its other calls and fills a new unit
from a checkpoint, big tensors straight into its shared-memory arena.
:class:`PlaneCheckpoint` (mixed into :class:`~streamrl.transport.ray.data.RayDataPlane`)
fans these calls out to every unit at once and, if one fails or the checkpoint is
cancelled, stops the others before it returns. The file layout is
:mod:`streamrl.checkpoint.units`'s.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ray

from ..._aio import wait_whole
from ...arena import Arena, ShmRef
from ...checkpoint.units import Sink
from ...errors import TransportError
from ...wire import WireTensor
from .calls import unwrap
from .wire import SHM_MIN, refs_in

if TYPE_CHECKING:
    from .unit import _Block

__all__ = ["UnitCheckpoint", "PlaneCheckpoint"]


class UnitCheckpoint:
    """The storage unit's half: writes its part of a checkpoint, and loads one."""

    if TYPE_CHECKING:  # (what the storage unit it is mixed into provides)
        index: int
        unit: Any
        lock: threading.Lock
        arena: Arena
        blocks: dict[ShmRef, _Block]

        def _alloc(self, nbytes: int, writer: int) -> ShmRef: ...
        def _maybe_free(self, ref: ShmRef, b: _Block) -> None: ...
        def node_id(self) -> str: ...

    def _init_checkpoint(self) -> None:
        self._ckpt_stops: set[str] = set()  # checkpoint directories told to stop

    def checkpoint_write(self, directory: str, plan: dict, rows: list[int]) -> dict:
        """Write this unit's rows of a checkpoint's cut under ``directory`` (see
        :func:`streamrl.checkpoint.units.write_unit`): each batch of rows is read under
        the lock, its arena blocks pinned until written (an overwrite or a spill may
        release them meanwhile), and written outside the lock, so puts and reads go on.
        Ray actor call (it takes seconds): it runs on one of the actor's threads."""
        from ...checkpoint.units import write_unit

        def fetch(batch: list[int], field: str):
            with self.lock:
                pieces = self.unit.get(batch, [field])[field]
                refs = refs_in({field: pieces})
                for ref in refs:
                    self.blocks[ref].pins += 1

            def release() -> None:
                with self.lock:
                    for ref in refs:
                        b = self.blocks.get(ref)
                        if b is not None:
                            b.pins -= 1
                            self._maybe_free(ref, b)

            return pieces, release

        def raw(piece):
            if isinstance(piece, WireTensor):
                t = piece.inlined()
                return ("t", t.dtype, t.itemsize, t.shape, t.buf)
            return ("o", list(piece))  # objects: encoded bytes already

        stops = self._ckpt_stops
        try:
            return write_unit(os.path.join(directory, f"unit-{self.index:05d}"), self.index,
                              plan, rows, self._checkpoint_fetch(fetch), raw,
                              node=self.node_id(), stopped=lambda: directory in stops)
        finally:
            stops.discard(directory)

    def _checkpoint_fetch(self, fetch: Any) -> Any:
        """Hook: the ``fetch`` :meth:`checkpoint_write` reads the unit's rows with (a data
        path that keeps some tensors elsewhere wraps it to bring their bytes in)."""
        return fetch

    def checkpoint_stop(self, directory: str) -> None:
        """Stop a :meth:`checkpoint_write` into ``directory`` at its next read (the
        checkpoint was cancelled or another unit failed). Ray actor call."""
        self._ckpt_stops.add(directory)

    def checkpoint_load(self, directory: str, sources: list[dict]) -> int:
        """Fill this new unit from the checkpoint's units ``sources`` (manifest entries)
        under ``directory``: every file is read and checked first; tensors of at least
        ``SHM_MIN`` bytes are read straight into blocks of the arena (one read, no
        copy), smaller ones inline. Returns rows held. Ray actor call."""
        from ...checkpoint.units import read_unit, unit_state

        sink = _ArenaSink(self)
        rows: list[int] = []
        chunks: list = []
        for entry in sources:
            r, c = read_unit(os.path.join(directory, entry["dir"]), entry, sink,
                             f"storage unit {entry['shard']}'s part")
            rows += r
            chunks += c
        with self.lock:
            self.unit.load_state_dict(unit_state(self.index, rows, chunks))
            return self.unit.stats()[0]


class _ArenaSink(Sink):
    """Where a unit's checkpoint is read into: arena blocks for big tensors (what a put
    through the arena stores), numpy arrays for the rest; objects stay encoded."""

    def __init__(self, unit: UnitCheckpoint):
        self.unit = unit

    def alloc(self, nbytes: int) -> tuple[Any, Any]:
        import numpy as np

        if nbytes >= SHM_MIN:
            u = self.unit
            with u.lock:
                try:
                    ref = u._alloc(nbytes, os.getpid())
                except OSError:  # no shared memory left: inline
                    ref = None
                if ref is not None:
                    b = u.blocks[ref]
                    b.stored, b.writer = True, None
                    return u.arena.view(ref), ref
        buf = np.empty(nbytes, dtype=np.uint8)
        return buf, buf

    def tensor(self, dtype: str, itemsize: int, shape: tuple, handle: Any) -> WireTensor:
        if isinstance(handle, ShmRef):
            return WireTensor(dtype, itemsize, shape, None, handle).pinned(
                self.unit.arena.view(handle))
        return WireTensor(dtype, itemsize, shape, handle)

    def objects(self, values: list) -> list:
        return values

    def discard(self, handle: Any) -> None:
        if isinstance(handle, ShmRef):
            u = self.unit
            with u.lock:
                b = u.blocks.get(handle)
                if b is not None:
                    b.stored = False
                    u._maybe_free(handle, b)


class PlaneCheckpoint:
    """The data plane's half: every unit writes (or loads) its part, all at once."""

    if TYPE_CHECKING:  # (what the data plane it is mixed into provides)
        num_shards: int
        units: list[Any]

    async def checkpoint_write(self, directory: str, plans: Mapping[int, Mapping],
                               rows: Mapping[int, Sequence[int]]) -> list[dict]:
        """Every unit actor writes its rows of the cut to its own files, all at once
        (Ray actor calls: they take seconds, and run on an actor thread, beside the
        unit's other calls). If this is cancelled or a unit fails, the others are told
        to stop, and this returns once no unit writes into ``directory`` any more."""
        calls = [asyncio.ensure_future(
            self._actor_call(s, "checkpoint_write", directory, dict(plans.get(s, {})),
                             list(rows.get(s, ()))))
            for s in range(self.num_shards)]
        try:
            return list(await asyncio.gather(*calls))
        except BaseException:
            # (to its end, however often this is cancelled: the caller removes the
            # directory once this raises, and no unit may still write into it then)
            await wait_whole(self._stop_writes(directory, calls))
            raise

    async def _stop_writes(self, directory: str, calls: Sequence[asyncio.Future]) -> None:
        if all(c.done() for c in calls):
            return
        await asyncio.gather(*[self._actor_call(s, "checkpoint_stop", directory)
                               for s in range(self.num_shards)], return_exceptions=True)
        await asyncio.gather(*calls, return_exceptions=True)

    async def checkpoint_load(self, directory: str,
                              sources: Mapping[int, Sequence[dict]]) -> None:
        """Every unit actor reads and checks its part of a checkpoint, all at once."""
        await asyncio.gather(*[self._actor_call(s, "checkpoint_load", directory, list(src))
                               for s, src in sources.items() if src])

    async def _actor_call(self, shard: int, method: str, *args: Any) -> Any:
        """``method(*args)`` on unit ``shard`` as a Ray actor call."""
        try:
            return await getattr(self.units[shard], method).remote(*args)
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as e:
            raise TransportError(f"storage unit {shard} is gone ({type(e).__name__})") from None
        except ray.exceptions.RayTaskError as e:
            raise unwrap(e, "storage unit") from None
