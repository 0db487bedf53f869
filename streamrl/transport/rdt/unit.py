"""The storage unit of the RDT transport: the Ray transport's unit, which also tells
holders when no row refers to a tensor they hold any more.

It stores a held field as its reference entry (a :class:`~streamrl.wire.WireTensor` whose
``ref`` is a :class:`~.runtime.HeldRef`; no bytes). When the unit releases such an entry
(its rows were dropped, the field was overwritten, the write that stored it was aborted)
or drops it unstored (its write was aborted while it was on its way), it sends the
holder a ``free`` from its socket channel's event loop, without waiting: the holder's
memory returns to zero once every row is gone.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, cast

import ray

from ...wire import WireTensor
from ..ray.calls import spawn
from ..ray.unit import StorageActorImpl
from ..ray.wire import tensors_in
from ..rpc import Endpoint, RpcClient
from .runtime import HeldRef

__all__ = ["RdtStorageActorImpl", "RdtStorageActor"]

log = logging.getLogger("streamrl")


class RdtStorageActorImpl(StorageActorImpl):
    """A storage unit that frees held tensors in their holders (see the module docstring)."""

    def __init__(self, index: int, storage: Any = "memory", arena: dict | None = None):
        super().__init__(index, storage, arena)
        self._frees: dict[Endpoint, list[int]] = {}
        self._frees_lock = threading.Lock()
        self._flushing = False
        self._holders: dict[Endpoint, RpcClient] = {}
        #: the held tensors rows of this unit refer to (under ``self.lock``)
        self._held: set[tuple[Endpoint, int]] = set()

    def _stored(self, parts: list) -> None:
        for _, cols in parts:
            for t in tensors_in(cols):
                if isinstance(t.ref, HeldRef):
                    self._held.add((t.ref.endpoint, t.ref.key))

    def unreserve_held(self, endpoint: Endpoint, keys: list[int]) -> None:
        """A put of held tensors ``keys`` (of the holder at ``endpoint``) failed or was
        cancelled, after its call to this unit (same channel, so that call was served
        first): the holder frees those that no row of this unit refers to. (A cancelled
        overwrite may have landed: its tensors stay, referred to by the rows.)"""
        endpoint = cast(Endpoint, tuple(endpoint))  # it may arrive as a list (over the wire)
        with self.lock:
            gone = [k for k in keys if (endpoint, k) not in self._held]
        for k in gone:
            self._queue_free(endpoint, k)

    def _released(self, t: Any) -> None:
        super()._released(t)
        self._held_gone(t)

    def _unstored(self, t: Any) -> None:
        super()._unstored(t)
        self._held_gone(t)

    def release_held(self) -> int:
        """The queue shuts down: every holder frees what rows of this unit refer to.
        Waits (up to 10 s) for the holders' answers; the number of tensors freed."""
        with self.lock:
            held, self._held = self._held, set()
        by_endpoint: dict[Endpoint, list[int]] = {}
        for endpoint, key in held:
            by_endpoint.setdefault(endpoint, []).append(key)
        loop = self._rpc_loop
        if loop is None or not by_endpoint:
            return 0
        async def free_all() -> None:
            await asyncio.gather(*[self._free(ep, keys) for ep, keys in by_endpoint.items()],
                                 return_exceptions=True)

        fut = asyncio.run_coroutine_threadsafe(free_all(), loop)
        fut.result(10)
        return len(held)

    def _held_gone(self, t: Any) -> None:
        if not (isinstance(t, WireTensor) and isinstance(t.ref, HeldRef)):
            return
        self._held.discard((t.ref.endpoint, t.ref.key))
        self._queue_free(t.ref.endpoint, t.ref.key)

    def _queue_free(self, endpoint: Endpoint, key: int) -> None:
        with self._frees_lock:
            self._frees.setdefault(endpoint, []).append(key)
            if self._flushing:
                return
            self._flushing = True
        loop = self._rpc_loop
        if loop is None:  # no socket channel (direct_calls=False): RDT needs one
            log.warning("streamrl: storage unit %d cannot free held tensors without its socket "
                        "channel", self.index)
            return
        loop.call_soon_threadsafe(lambda: spawn(self._flush(), "freeing held tensors"))

    async def _flush(self) -> None:
        while True:
            with self._frees_lock:
                frees, self._frees = self._frees, {}
                if not frees:
                    self._flushing = False
                    return
            await asyncio.gather(*[self._free(ep, keys) for ep, keys in frees.items()])

    async def _free(self, endpoint: Endpoint, keys: list[int]) -> None:
        client = self._holders.get(endpoint)
        if client is None:
            client = self._holders[endpoint] = RpcClient(endpoint)
        try:
            await client.call("free", keys)
        except ConnectionError:  # the holder is gone, and what it held with it
            self._holders.pop(endpoint, None)


#: the RDT storage unit as a Ray actor class (threaded; its socket channel has its own loop)
# (Ray's annotations of ray.remote list task options only: max_concurrency is an actor's)
RdtStorageActor = ray.remote(  # type: ignore[call-overload]
    num_cpus=0, max_concurrency=4)(RdtStorageActorImpl)
