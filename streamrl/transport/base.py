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
from collections.abc import Mapping, Sequence
from typing import Any

Column = Any  # a tensor (rows first) or a list of per-row values; see streamrl.columns

__all__ = ["DataPlane", "Transport"]


class DataPlane(abc.ABC):
    """Access to the storage units of one queue. All methods take batched requests so a
    micro-batch spread over shards costs one call per shard, issued concurrently."""

    num_shards: int

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

    def released(self) -> None:
        """Tell the storage units now which read data this process no longer views
        (where they keep it for readers, as the Ray transport's arenas do); otherwise it
        is told with the next call. Does not wait."""


class Transport(abc.ABC):
    """A deployment: how to reach the control and data planes, and how to shut down."""

    name: str

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
    def control(self):
        """The control-plane object (service or proxy)."""

    @property
    @abc.abstractmethod
    def data(self) -> DataPlane:
        """The data plane."""

    @abc.abstractmethod
    def release_nowait(self, lease_ids: Sequence[int]) -> None:
        """Give leases back without awaiting (from finalizers); best effort."""

    async def shutdown(self) -> None:
        """Free the deployment's resources (actors, memory)."""
