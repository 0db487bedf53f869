"""The compatibility layer's control plane: every call a client makes to its controller.

:class:`TQControlPlane` names each call with its arguments and result, as
:class:`streamrl.control.ControlPlane` does for streamrl's own controller.
:class:`~.controller.TQControllerService` implements it (in the client's process on the
embedded transport, as the named Ray actor otherwise); :class:`RayTQControl`, the client's
proxy of that actor, is generated from it (:func:`streamrl.control.forwarders`), so a
renamed or changed call changes both sides at once. ``tests/compat`` fails when either
side lacks a call or has another signature (:func:`streamrl.control.check_implements`).

Every call is a coroutine and moves metadata only: the samples' data goes between the
clients and the queue's storage units.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from streamrl.control import forwarders

if TYPE_CHECKING:
    import torch

    from .metadata import BatchMeta

__all__ = ["TQControlPlane", "RayTQControl"]

#: ``{partition: (rows, storage units, {field: stored name})}``, ``None`` for a sample
#: without data
Located = dict[str, tuple[list, list, dict[str, str]]]
#: ``(global indexes, status)`` tensors, ``(None, None)`` for an unknown partition
Status = tuple["torch.Tensor | None", "torch.Tensor | None"]


@runtime_checkable
class TQControlPlane(Protocol):
    """The TransferQueue controller as the compatibility layer's clients call it."""

    async def get_meta(self, data_fields: Sequence[str], batch_size: int, partition_id: str,
                       mode: str = "fetch", task_name: str | None = None,
                       sampling_config: Mapping[str, Any] | None = None) -> "BatchMeta":
        """A batch's metadata in ``mode`` ``"fetch"`` (waits for ready samples unless
        polling), ``"force_fetch"`` or ``"insert"``."""
        ...

    async def commit(self, partition_id: str, indexes: Sequence[int] | None,
                     rows: Sequence[int], shards: Sequence[int],
                     schema: Mapping[str, Mapping[str, Any]],
                     custom_meta: Sequence[Mapping[str, Any]] | None = None
                     ) -> tuple[list[int], list[tuple[int, int, int]]]:
        """A put stored ``schema``'s fields in ``rows``: ``(global indexes, conflicts)``."""
        ...

    async def locate(self, wanted: Mapping[str, Sequence[int]], fields: Sequence[str]
                     ) -> Located:
        """Where the samples' data is, per partition."""
        ...

    async def set_custom_meta(self, partition_custom_meta: Mapping[str, Mapping[int, Mapping]]
                              ) -> None:
        """Store per-sample ``custom_meta``."""
        ...

    async def clear_partition(self, partition_id: str) -> None:
        """Forget a partition and drop its samples' data."""
        ...

    async def clear_samples(self, partition_id: str, indexes: Sequence[int]) -> None:
        """Forget samples and drop their data."""
        ...

    async def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        """Make the partition's samples unconsumed again (for one task, or all)."""
        ...

    async def get_consumption_status(self, task_name: str, partition_id: str) -> Status:
        """Which samples ``task_name`` consumed."""
        ...

    async def get_production_status(self, data_fields: Sequence[str], partition_id: str
                                    ) -> Status:
        """Which samples have which of ``data_fields``."""
        ...

    async def kv_retrieve_meta(self, keys: Sequence[str], partition_id: str,
                               create: bool = False) -> "BatchMeta":
        """The samples of user keys (made when ``create``)."""
        ...

    async def kv_retrieve_keys(self, global_indexes: Sequence[int], partition_id: str
                               ) -> list[str | None]:
        """The user keys of samples."""
        ...

    async def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, dict]]:
        """``{partition: {key: tags}}``."""
        ...

    async def list_partitions(self) -> list[str]:
        """The partitions the controller knows."""
        ...

    async def checkpoint(self, queue_dir: str, state_file: str) -> int:
        """Write the metadata and the queue's checkpoint; the number of storage units."""
        ...

    async def clear_all(self) -> None:
        """Forget every partition and drop their data."""
        ...

    async def install(self, state: Mapping[str, Any],
                      moved: Mapping[tuple[str, int], tuple[int, int]]) -> None:
        """Replace the metadata by a saved state whose data now is in the rows ``moved``
        names."""
        ...

    async def shutdown(self) -> None:
        """Wake waiting ``get_meta`` calls with an error."""
        ...


async def _remote(self: "_RayTQControl", name: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``name`` on the controller actor; its exceptions come back as themselves."""
    import ray

    try:
        return await getattr(self.actor, name).remote(*args, **kwargs)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise


class _RayTQControl:
    """The controller actor as a :class:`TQControlPlane` (its methods are generated)."""

    def __init__(self, actor: Any):
        self.actor = actor

    def __repr__(self) -> str:
        return f"<RayTQControl of {self.actor!r}>"


#: the client's proxy of the controller actor: one generated method per call of
#: :class:`TQControlPlane`
RayTQControl = type("RayTQControl", (_RayTQControl,),
                    {**forwarders(_remote, TQControlPlane), "__module__": __name__,
                     "__doc__": _RayTQControl.__doc__})
