"""The narrow interfaces a deployment implements.

A queue client talks to two things:

* the **control plane** -- the :class:`~streamrl.service.ControllerService` API (allocate,
  commit, take, ack, ...), metadata only;
* the **data plane** -- :class:`DataPlane`: put / get / delete of columns on storage units.

The embedded transport hands the client the service object and in-process storage units;
the Ray transport hands it proxies that call actors. The client never knows which.
"""

from __future__ import annotations

import abc
import contextvars
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import asyncio

    from ..control import ControlPlane

from .._types import Column

__all__ = ["DataCaps", "DataPlane", "NewRows", "Transport", "note_moved"]

#: the bytes per path of the read in progress in this task (see :func:`note_moved`)
_moving: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar(
    "streamrl_read_paths", default=None)


def note_moved(by_path: Mapping[str, int]) -> None:
    """A data plane moved these bytes, per path (``"shm"``, ``"inline"``, ``"rdt"``,
    ``"socket"``, ``"local"``): counted in the read in progress in this task, if any (so
    :meth:`streamrl.session.Session.fetch` knows which paths its read took)."""
    acc = _moving.get()
    if acc is not None:
        for path, n in by_path.items():
            acc[path] = acc.get(path, 0) + n


class NewRows(Protocol):
    """The queue's usual way to put new rows (ask the controller for room, waiting as long
    as it takes; store; commit), lent to :meth:`DataPlane.put_rows` with a put that may
    wait for room that long, so that a data plane that combines puts can put a combined
    group that way when its units have no room (see
    :mod:`streamrl.transport.ray.coalesce`)."""

    async def room(self, partition: str, cols: Mapping[str, Column], n: int, nbytes: dict,
                   version: int | None, dtypes: dict) -> Any:
        """Room for ``n`` new rows of ``cols`` (a write token), waiting as long as it
        takes; ``None`` when the controller refused them and kept nothing (the queue is
        closed, they can never fit...): each put then goes alone. Cancelled, it keeps
        nothing."""

    async def store(self, token: Any, cols: Mapping[str, Column], nbytes: dict, tags: dict
                    ) -> tuple[list[int], list[int], Any]:
        """Store the rows of ``token`` and commit them: ``(rows, shards, commit
        result)``. Failed or cancelled, nothing of it stays."""

    async def abort(self, token: Any) -> None:
        """Give back room that was not used."""

    async def retract(self, rows: Sequence[int]) -> None:
        """Drop ``rows`` put this way (``"cancelled"``): a put cancelled meanwhile."""


@dataclass(frozen=True)
class DataCaps:
    """What a data plane can do beyond the required calls (declared, never probed).

    Attributes:
        unit_admitted_puts: :meth:`DataPlane.put_rows` and :meth:`DataPlane.write_rows`
            are implemented: a small put of new rows, or a small write of new fields to
            rows of one storage unit, is one call to that unit, which has the controller
            admit it.
        zero_copy_reads: reads return views of the stored bytes (treat them read-only).
        shared_memory: bytes move through shared memory between processes of a node.
        cross_process: the queue can be used from other processes (it pickles into a
            handle that works there).
        owned_reads: :meth:`DataPlane.get_owned` gives data the caller owns without
            copying it (copy-on-write mappings of the stored bytes, or bytes received for
            this read alone); without, ``materialize(copy=True)`` copies what it read.
    """

    unit_admitted_puts: bool = False
    zero_copy_reads: bool = False
    shared_memory: bool = False
    cross_process: bool = False
    owned_reads: bool = False


class DataPlane(abc.ABC):
    """Access to the storage units of one queue. All methods take batched requests so a
    micro-batch spread over shards costs one call per shard, issued concurrently."""

    num_shards: int
    #: what this data plane can do beyond the required calls
    caps: DataCaps = DataCaps()

    async def put_rows(self, partition: str, cols: Mapping[str, Column], n: int,
                       nbytes: dict, tags: dict, version: int | None,
                       dtypes: dict | None = None, *, usual: NewRows | None = None,
                       shapes: tuple | None = None
                       ) -> tuple[list[int], list[int], Any] | None:
        """A small put of ``n`` new rows admitted by one storage unit (only when
        ``caps.unit_admitted_puts``): ``(rows, shards, commit result)``, or ``None`` when
        it does not apply now (the caller puts the usual way). ``usual``: given when the
        put may wait for room as long as it takes; the data plane may then put these
        rows that way itself, with others (see :class:`NewRows`). ``shapes``: each
        column's ``(field, dtype, row shape)``, given when the caller read them already
        (every column a dense tensor; see :func:`streamrl.columns.one_row_dense`)."""
        raise NotImplementedError(f"{type(self).__name__} does not admit puts in its units")

    async def write_rows(self, rows: Sequence[int], shards: Sequence[int],
                         cols: Mapping[str, Column], nbytes: dict, tags: dict,
                         dtypes: dict | None) -> Any:
        """A small write of new fields (no overwrite) to existing ``rows`` (held by
        ``shards``), admitted by the storage unit that holds them (only when
        ``caps.unit_admitted_puts``): the commit result, or ``None`` when it does not
        apply (the caller writes the usual way: :meth:`ControlPlane.begin_write`, store,
        commit). Raises what the write would raise."""
        raise NotImplementedError(f"{type(self).__name__} does not admit writes in its units")

    @abc.abstractmethod
    async def put(self, parts: Sequence[tuple[int, Sequence[int], Mapping[str, Column]]],
                  write: int = 0) -> None:
        """Store columns: ``parts`` is a list of ``(shard, rows, columns)``; ``write`` is
        the id of the controller's write token they belong to (see
        :meth:`streamrl.storage.StorageUnit.put`)."""

    @abc.abstractmethod
    async def get(self, parts: Sequence[tuple[int, Sequence[int], Sequence[str]]]
                  ) -> list[dict[str, list[Column]]]:
        """Read: ``parts`` is a list of ``(shard, rows, fields)``; for each, the pieces of
        each field in row order (see :meth:`streamrl.storage.StorageUnit.get`)."""

    async def get_owned(self, parts: Sequence[tuple[int, Sequence[int], Sequence[str]]]
                        ) -> list[dict[str, list[Column]]]:
        """As :meth:`get`, but the caller owns what comes back: writing into it never
        changes the stored data, and nothing the queue does changes it. Default: a copy
        of every tensor :meth:`get` returns; a data plane with ``caps.owned_reads`` does
        it without copying."""
        got = await self.get(parts)
        return [{f: [_owned(p) for p in plist] for f, plist in d.items()} for d in got]

    @abc.abstractmethod
    async def delete(self, parts: Mapping[int, Sequence[int]]) -> None:
        """Forget rows: ``{shard: rows}``."""

    @abc.abstractmethod
    async def delete_fields(self, parts: Mapping[int, Sequence[int]], fields: Sequence[str],
                            write: int = 0) -> None:
        """Forget ``fields`` of rows (``{shard: rows}``), keeping the rows' other fields;
        with ``write``, only what that write stored, and drop its data should it still
        arrive (see :meth:`streamrl.storage.StorageUnit.delete_fields`)."""

    @abc.abstractmethod
    async def inventory(self) -> list[dict[int, list[str]]]:
        """Per storage unit, every row it holds and the fields it holds for it."""

    @abc.abstractmethod
    async def unit_stats(self) -> list[tuple[int, int]]:
        """(rows, bytes) held by each storage unit, read from the units themselves."""

    async def unit_usage(self) -> list[dict[str, int]]:
        """Where each storage unit keeps its bytes (its backend's
        :meth:`~streamrl.storage.StorageBackend.usage`: at least ``memory`` and ``disk``).
        The default, for data planes that cannot ask: every byte in memory."""
        return [{"memory": b, "disk": 0} for _, b in await self.unit_stats()]

    async def checkpoint_write(self, directory: str, plans: Mapping[int, Mapping[str, Any]],
                               rows: Mapping[int, Sequence[int]]) -> list[dict]:
        """Have every storage unit write its rows of a checkpoint's cut to files of its
        own under ``directory/unit-XXXXX``, all at once, with no data through this
        process unless the units live here (see :func:`streamrl.checkpoint.units.write_unit`:
        ``plans[shard]`` is the unit's plan, ``rows[shard]`` its rows). Returns the units'
        manifest entries, by shard. Rows of the cut stay readable meanwhile (the
        controller holds their deletes)."""
        raise NotImplementedError(f"{type(self).__name__} cannot write checkpoints")

    async def checkpoint_load(self, directory: str,
                              sources: Mapping[int, Sequence[dict]]) -> None:
        """Fill every new, empty storage unit ``shard`` from the parts ``sources[shard]``
        (manifest entries of the checkpoint's units) under ``directory``, each unit
        reading and checking its own files (see
        :func:`streamrl.checkpoint.units.read_unit`).

        Raises:
            CheckpointError: a file is missing, torn or corrupt.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot restore checkpoints")

    def released(self) -> None:
        """Tell the storage units now which read data this process no longer views
        (where they keep it for readers, as the Ray transport's arenas do); otherwise it
        is told with the next call. Does not wait."""


class Transport(abc.ABC):
    """A deployment: how to reach the control and data planes, and how to shut down.

    Built by the factory registered under its name (:func:`streamrl.transport.register`)
    from a :class:`~streamrl.config.QueueConfig`."""

    name: str

    #: where this deployment serves the queue's Prometheus metrics itself (``metrics=``),
    #: when its controller lives in another process; ``None``: the queue serves them from
    #: this process (or not at all)
    metrics_url: str | None = None

    @property
    def owner_loop(self) -> "asyncio.AbstractEventLoop | None":
        """The event loop an in-process deployment is bound to (its waiters live there),
        once it was used; ``None`` for a deployment callable from any event loop (one
        with a :attr:`handle`) or not used yet."""
        return None

    @property
    def queue_id(self) -> str:
        """The queue's identity, equal in every handle of it (in any process)."""
        qid = getattr(self, "_queue_id", None)
        if qid is None:
            import uuid

            qid = self._queue_id = uuid.uuid4().hex
        return qid

    @property
    @abc.abstractmethod
    def control(self) -> "ControlPlane":
        """The control plane (the service itself, or a proxy of it)."""

    @property
    @abc.abstractmethod
    def data(self) -> DataPlane:
        """The data plane."""

    @abc.abstractmethod
    def release_nowait(self, lease_ids: Sequence[int]) -> None:
        """Give leases back without awaiting (from finalizers); best effort."""

    @property
    def handle(self) -> Any:
        """What a pickled queue carries to rebuild this transport in another process
        (with :meth:`attach`), or ``None`` when the queue lives in this process only."""
        return None

    @classmethod
    def attach(cls, handle: Any) -> "Transport":
        """This transport in another process, from :attr:`handle` (it does not own the
        deployment: its ``shutdown`` leaves it running)."""
        raise NotImplementedError(f"{cls.__name__} queues live in one process")

    async def shutdown(self) -> None:
        """Free the deployment's resources (actors, memory)."""


def _owned(piece: Column) -> Column:
    """A read piece the caller owns: its tensors copied (a list's Python objects are
    the ones read)."""
    import torch  # (not at import: storage-unit actors import this module without torch)

    if isinstance(piece, torch.Tensor):
        return piece.clone()
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in piece]
