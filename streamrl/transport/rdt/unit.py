"""The storage unit of the RDT transport: the Ray transport's unit, which also tells
holders when no row refers to a tensor they hold any more.

It stores a held field as its reference entry (a :class:`~streamrl.wire.WireTensor` whose
``ref`` is a :class:`~.runtime.HeldRef`; no bytes). When the unit releases such an entry
(its rows were dropped, the field was overwritten, the write that stored it was aborted)
or drops it unstored (its write was aborted while it was on its way), it sends the
holder a ``free`` from its socket channel's event loop, without waiting: the holder's
memory returns to zero once every row is gone.

A checkpoint saves held fields like any others: while the unit writes its part, it
reads the bytes of the held entries of each batch from their holders (one ``read`` per
holder per batch, over the holders' sockets: the fallback path) and writes them as it
writes its own. A holder that is gone fails the checkpoint with
:class:`~streamrl.errors.CheckpointError` naming it (the previous checkpoint stays). The
checkpoint holds plain tensors: it restores on any transport, into the storage units.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, cast

import ray

from ...errors import CheckpointError
from ...wire import WireTensor
from ..ray.calls import spawn
from ..ray.unit import StorageActorImpl
from ..ray.wire import tensors_in
from ..rpc import Endpoint, RpcClient
from .runtime import HeldRef

__all__ = ["RdtStorageActorImpl", "RdtStorageActor"]

log = logging.getLogger("streamrl")

#: seconds a checkpoint waits for the held bytes of one batch of rows from their holders
HELD_READ_TIMEOUT = 300.0


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

    # -- checkpoints

    def _checkpoint_fetch(self, fetch: Any) -> Any:
        """Reads of a checkpoint's rows with the bytes of held entries brought in from
        their holders (see the module docstring)."""

        def fetch_held(batch: list[int], field: str) -> tuple[list, Any]:
            pieces, release = fetch(batch, field)
            try:
                return self._bring_held(pieces), release
            except BaseException:
                if release is not None:
                    release()
                raise

        return fetch_held

    def _bring_held(self, pieces: list) -> list:
        """``pieces`` with each held entry replaced by its bytes (inline), read from its
        holder: one call per holder. Runs on an actor thread, waiting for the unit's
        socket channel loop.

        Raises:
            CheckpointError: a holder is gone, or no longer holds a tensor.
        """
        held: dict[Endpoint, list[int]] = {}
        for i, p in enumerate(pieces):
            if isinstance(p, WireTensor) and isinstance(p.ref, HeldRef):
                held.setdefault(cast(Endpoint, tuple(p.ref.endpoint)), []).append(i)
        if not held:
            return pieces
        loop = self._rpc_loop
        if loop is None:  # no socket channel (direct_calls=False): RDT needs one
            raise CheckpointError(f"storage unit {self.index} cannot read held tensor fields "
                                  "from their holders without its socket channel")

        async def read_all() -> list:
            return list(await asyncio.gather(*[
                self._read_held(ep, [pieces[i] for i in idx]) for ep, idx in held.items()]))

        fut = asyncio.run_coroutine_threadsafe(read_all(), loop)
        try:
            got = fut.result(HELD_READ_TIMEOUT)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            names = sorted({pieces[idx[0]].ref.holder for idx in held.values()})
            raise CheckpointError(
                f"storage unit {self.index}: the holders of held tensor fields "
                f"({', '.join(names)}) did not send them within {HELD_READ_TIMEOUT:.0f} s; "
                "the checkpoint is not written") from None
        out = list(pieces)
        for idx, arrays in zip(held.values(), got):
            for i, a in zip(idx, arrays):
                p = pieces[i]
                out[i] = WireTensor(p.dtype, p.itemsize, p.shape, a)
        return out

    async def _read_held(self, endpoint: Endpoint, pieces: list) -> list:
        """The bytes of held ``pieces`` of the holder at ``endpoint`` (one ``read``)."""
        holder = pieces[0].ref.holder
        client = self._holders.get(endpoint)
        if client is None:
            client = self._holders[endpoint] = RpcClient(endpoint)
        try:
            arrays = await client.call("read", [(p.ref.key, p.offset, p.nbytes) for p in pieces])
        except ConnectionError as e:
            self._holders.pop(endpoint, None)
            raise CheckpointError(
                f"storage unit {self.index} cannot save held tensor fields of the checkpoint: "
                f"their holder {holder} is gone ({e}). Read those rows (they raise RowsLost and "
                "are dropped as lost) or drop them, then checkpoint again") from None
        if arrays is None:
            raise CheckpointError(
                f"storage unit {self.index} cannot save held tensor fields of the checkpoint: "
                f"their holder {holder} no longer holds some of them")
        return arrays

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
