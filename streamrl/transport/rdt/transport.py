"""The RDT transport: :class:`~streamrl.transport.ray.RayTransport` with the RDT data
plane (:class:`.data.RdtDataPlane`) and storage units that free held tensors
(:class:`.unit.RdtStorageActorImpl`). The controller actor is the Ray transport's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ...config import QueueConfig
from ...errors import InvalidArgument
from ..ray.transport import RayTransport
from .data import RdtPlaneSpec

__all__ = ["RdtTransport", "create", "rdt_options"]

log = logging.getLogger("streamrl")

#: the options of the RDT data path (the rest go to the Ray transport)
OPTIONS = ("rdt_fields", "rdt_hold_anywhere")


class RdtTransport(RayTransport):
    """The Ray transport whose tensor fields stay with their producers (see
    :mod:`streamrl.transport.rdt`)."""

    name = "rdt"
    storage_actor: Any = "streamrl.transport.rdt.unit:RdtStorageActor"

    async def shutdown(self) -> None:
        """As the Ray transport's, after the storage units had the holders free what their
        rows refer to (held tensors do not outlive their queue)."""
        if self._owner:
            try:
                await asyncio.wait_for(asyncio.gather(
                    *[u.release_held.remote() for u in self._units], return_exceptions=True),
                    15)
            except Exception as e:
                log.warning("streamrl: storage units could not free held tensors (%r)", e)
        await super().shutdown()


def rdt_options(options: dict, *, all_fields: bool) -> tuple[RdtPlaneSpec, dict]:
    """Split a queue's transport options into the RDT data plane's spec and the rest.

    Raises:
        InvalidArgument: a bad ``rdt_fields`` or ``rdt_hold_anywhere``, or
            ``direct_calls=False`` (holders are reached over sockets).
    """
    rest = {k: v for k, v in options.items() if k not in OPTIONS}
    fields = options.get("rdt_fields")
    if fields is not None:
        if isinstance(fields, str) or not all(isinstance(f, str) for f in fields):
            raise InvalidArgument(f"rdt_fields must be a list of field names, got {fields!r}")
        fields = tuple(fields)
    elif not all_fields:
        raise InvalidArgument("rdt_fields names the fields that stay with their producer")
    anywhere = options.get("rdt_hold_anywhere", False)
    if not isinstance(anywhere, bool):
        raise InvalidArgument(f"rdt_hold_anywhere must be True or False, got {anywhere!r}")
    if rest.get("direct_calls") is False:
        raise InvalidArgument("the RDT data path needs direct_calls=True: storage units and "
                              "readers reach holders over sockets")
    return RdtPlaneSpec(fields, anywhere), rest


def create(config: QueueConfig) -> RdtTransport:
    """The registered factory of ``transport="rdt"`` (every tensor field stays with its
    producer, or those of ``rdt_fields``), and of ``transport="ray"`` with
    ``rdt_fields``."""
    spec, rest = rdt_options(dict(config.options), all_fields=True)
    return RdtTransport.create(config.replace(options=rest), data_plane=spec)
