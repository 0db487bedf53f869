"""The embedded transport: controller and storage units in the caller's process.

Nothing is encoded or copied: storage units keep references to the tensors that were put,
and reads return views of them. All calls run in the caller's event loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..errors import InvalidArgument

from ..config import QueueConfig
from ..controller import Controller
from ..combine import LINGER, CombiningService
from ..service import ControllerService
from ..storage import StorageBackend, StorageUnit, create_unit
from .base import Column, DataCaps, DataPlane, Transport

if TYPE_CHECKING:
    import asyncio

__all__ = ["EmbeddedTransport", "LocalDataPlane", "create", "EMBEDDED_OPTIONS"]


#: the embedded transport's options (``QueueConfig.options``; see :func:`create`)
EMBEDDED_OPTIONS = ("combine_puts", "put_linger")


def create(config: QueueConfig) -> "EmbeddedTransport":
    """The registered factory of ``transport="embedded"``. Its options
    (:data:`EMBEDDED_OPTIONS`), which apply where one-row puts are combined (the
    in-memory storage units, the default; see :mod:`streamrl.combine`):

    * ``combine_puts`` (default ``True``): combine one-row puts into one admission;
      ``False`` admits each put on its own (a put then returns once its row is admitted:
      several times the CPU of a combined one-row put);
    * ``put_linger`` (seconds, default 0.005): how long a stage of combined puts waits
      for more while no consumer waiting could use its rows yet (a consumer whose batch
      the staged rows complete never waits for it); ``0`` flushes each stage at the end
      of the event-loop iteration that opened it. Longer combines more of the puts of a
      producer that awaits between them; rows wait in the stage that long at most."""
    opts = dict(config.options)
    unknown = sorted(set(opts) - set(EMBEDDED_OPTIONS))
    if unknown:
        raise InvalidArgument(
            f"unknown options for the embedded transport: {unknown}; it takes "
            f"{', '.join(EMBEDDED_OPTIONS)} (other transport options are for transports "
            "such as 'ray')")
    combine = opts.get("combine_puts", True)
    if not isinstance(combine, bool):
        raise InvalidArgument(f"combine_puts must be True or False, got {combine!r}")
    linger = opts.get("put_linger", LINGER)
    if (isinstance(linger, bool) or not isinstance(linger, (int, float))
            or not 0 <= linger < math.inf):
        raise InvalidArgument(
            f"put_linger must be a number of seconds >= 0 (0: no lingering), got {linger!r}")
    units = [create_unit(config.storage, i) for i in range(config.num_shards)]
    return EmbeddedTransport(Controller.from_config(config), units, combine=combine,
                             linger=float(linger))


class LocalDataPlane(DataPlane):
    """In-process storage units, called directly."""

    caps = DataCaps(zero_copy_reads=True)

    def __init__(self, units: Sequence[StorageBackend]):
        self.units = list(units)
        self.num_shards = len(self.units)
        #: called before every read of the units, when set (the embedded transport
        #: flushes its stage of combined one-row puts: see :mod:`streamrl.combine`)
        self.before_read: Callable[[], None] | None = None
        if not all(u.caps.zero_copy_reads for u in self.units):  # e.g. rows read from disk
            self.caps = DataCaps(zero_copy_reads=False)

    async def put(self, parts: Sequence[tuple[int, Sequence[int], Mapping[str, Column]]],
                  write: int = 0) -> None:
        """Store columns on their units (no copy)."""
        for shard, rows, cols in parts:
            self.units[shard].put(rows, cols, write)

    async def get(self, parts: Sequence[tuple[int, Sequence[int], Sequence[str]]]
                  ) -> list[dict[str, list[Column]]]:
        """Read pieces (views) from the units."""
        if self.before_read is not None:
            self.before_read()
        return [self.units[s].get(rows, fields) for s, rows, fields in parts]

    async def delete(self, parts: Mapping[int, Sequence[int]]) -> None:
        """Forget rows on their units."""
        for shard, rows in parts.items():
            self.units[shard].delete(rows)

    async def delete_fields(self, parts: Mapping[int, Sequence[int]], fields: Sequence[str],
                            write: int = 0) -> None:
        """Forget fields of rows on their units."""
        for shard, rows in parts.items():
            self.units[shard].delete_fields(rows, fields, write)

    async def inventory(self) -> list[dict[int, list[str]]]:
        """Rows and fields held by each unit."""
        if self.before_read is not None:
            self.before_read()
        return [u.inventory() for u in self.units]

    async def unit_stats(self) -> list[tuple[int, int]]:
        """(rows, bytes) held by each unit."""
        if self.before_read is not None:
            self.before_read()
        return [u.stats() for u in self.units]

    async def unit_usage(self) -> list[dict[str, int]]:
        """Each unit's :meth:`~streamrl.storage.StorageBackend.usage`."""
        if self.before_read is not None:
            self.before_read()
        return [u.usage() for u in self.units]

    async def checkpoint_write(self, directory: str, plans: Mapping[int, Mapping],
                               rows: Mapping[int, Sequence[int]]) -> list[dict]:
        """Each unit's rows of a cut, written by a worker thread per unit (see
        :mod:`streamrl.checkpoint.local`)."""
        from ..checkpoint.local import write_units

        return await write_units(self.units, directory, plans, rows)

    async def checkpoint_load(self, directory: str,
                              sources: Mapping[int, Sequence[dict]]) -> None:
        """Fill the units from a checkpoint, a worker thread per unit."""
        from ..checkpoint.local import load_units

        await load_units(self.units, directory, sources)


class EmbeddedTransport(Transport):
    """Everything in this process (the default).

    Keyword Args:
        combine: combine one-row puts (in-memory units only; see :func:`create`).
        linger: a stage's linger, seconds (see :func:`create`).
    """

    name = "embedded"

    def __init__(self, controller: Controller, units: Sequence[StorageBackend] | None = None,
                 *, combine: bool = True, linger: float = LINGER):
        if units is None:
            units = [StorageUnit(i) for i in range(controller.num_shards)]
        self._data = LocalDataPlane(units)
        self._service: ControllerService
        if combine and all(type(u) is StorageUnit for u in self._data.units):
            # one-row puts are combined (streamrl/combine.py) only into the in-memory
            # units: a put there cannot fail at the flush (an I/O error of a backend
            # that writes files could, after the put it belongs to had returned)
            stage = CombiningService(controller, self._data, linger=linger)
            self._data.before_read = stage.flush  # every put that returned is read
            self._service = stage
        else:
            self._service = ControllerService(controller, self._data)

    @property
    def control(self) -> ControllerService:
        """The controller service itself (a :class:`~streamrl.combine.CombiningService`,
        combining one-row puts, over the in-memory storage units)."""
        return self._service

    @property
    def data(self) -> LocalDataPlane:
        """The in-process storage units."""
        return self._data

    @property
    def owner_loop(self) -> "asyncio.AbstractEventLoop | None":
        """The event loop the controller service runs in (once used)."""
        return self._service.loop

    def release_nowait(self, lease_ids: Sequence[int]) -> None:
        """Release leases from a finalizer. Finalizers can run in the middle of a
        controller call (the cyclic GC runs at any allocation) or in another thread, so
        the release is queued and applied by the event loop as a callback of its own."""
        self._service.defer_release(lease_ids)

    async def shutdown(self) -> None:
        """Close the storage units (a spilling unit frees its file)."""
        if isinstance(self._service, CombiningService):
            self._service.flush()
        for u in self._data.units:
            u.close()
