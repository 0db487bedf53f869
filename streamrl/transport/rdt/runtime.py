"""This process's side of RDT: the holder of the tensor fields it produced, the server that
lets other processes reach them, and the one transfer thread that every RDT send and
receive of the process runs on.

There is one :class:`Runtime` per process (:func:`runtime`), shared by every queue the
process uses. It is started when the process joins an RDT group
(:func:`streamrl.transport.rdt.create_group`), or when it first holds a tensor of a queue
that lets any process hold (``rdt_hold_anywhere``).

Threads of a process that takes part:

* ``streamrl-rdt-server``: an event loop serving the holder over a socket
  (:class:`~streamrl.transport.rpc.RpcServer`): the group's coordinator sends it the sends
  and receives this process is to make, storage units tell it which held tensors no row
  refers to any more (``free``), and readers outside the group read held bytes from it
  (``read``: the fallback path);
* ``streamrl-rdt-transfer``: the transfer thread (:class:`TransferThread`). Every
  collective send and receive of the process runs there, one at a time, in the order the
  coordinator made them. Ray 2.60's gloo transfers between two processes are matched in
  the order they are posted (every send/recv goes through the process's one default
  ``torch.distributed`` group, tag 0): two transfers posted concurrently, or in different
  orders on the two sides, swap or corrupt their tensors. Async callers await the
  thread's results without blocking their event loop; synchronous callers wait on them;
* ``streamrl-rdt-watch``: the transfer thread's watchdog. A transfer whose peer dies
  usually fails at once (gloo sees the peer's sockets close: "Connection closed by
  peer"); one that has run for :data:`STALL_CHECK` seconds makes the watchdog ask the
  group's coordinator whether the peer is alive (by a Ray call to its actor, which fails
  once Ray declares the actor dead, a lost node included). A peer that is gone has its
  transfer abandoned: the reader's wait fails, and a new transfer thread carries on with
  the next operations (the abandoned one stays blocked where it was, on a peer that will
  never answer, and leaves once it returns). A peer that is alive but slow is waited for:
  a transfer is never given up on a timer alone, since the two sides would then be out
  of step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ...errors import TransportError
from ..ray.calls import new_loop
from ..rpc import Endpoint, RpcServer

__all__ = ["HeldRef", "GroupInfo", "Runtime", "TransferThread", "runtime", "current",
           "layout", "plan", "HolderGone", "CoordinatorGone", "BACKENDS", "STALL_CHECK",
           "set_bypass", "cannot_join"]

log = logging.getLogger("streamrl")

#: the RDT backends: two-sided collectives (``gloo`` on CPU, ``nccl`` on GPU) driven in the
#: coordinator's order, and ``nixl`` (one-sided reads of the holder's memory)
BACKENDS = ("gloo", "nccl", "nixl")

#: alignment of each tensor inside a packed transfer buffer (bytes)
ALIGN = 64

#: ranges of at least this many bytes move as messages of their own (no packing copy);
#: smaller ones are packed into one message (per-message overhead dominates them)
BIG = 1 << 20

#: seconds a transfer runs before the watchdog asks whether its peer is alive (and then
#: again every as many seconds); see the module docstring
STALL_CHECK = 10.0

#: Private switch for tests only: the naive design. A reader asks the holder for its bytes
#: directly (no coordinator numbering) and each send and receive runs at once on a new
#: thread of its own, concurrently and in no particular order, as async callers that
#: each hand their transfer to a worker thread would. Ray's gloo then swaps, corrupts or
#: crashes transfers (see ``docs/rdt.md``). Set it in every process of a group
#: (:func:`set_bypass`), readers and holders alike.
_BYPASS_TRANSFER_THREAD = False


def _bypassed() -> bool:
    """Whether the tests' naive design is on (see :data:`_BYPASS_TRANSFER_THREAD`)."""
    return _BYPASS_TRANSFER_THREAD


def set_bypass(on: bool) -> bool:
    """Tests only: switch this process to the naive design (see
    :data:`_BYPASS_TRANSFER_THREAD`) or back; the previous setting."""
    global _BYPASS_TRANSFER_THREAD
    was, _BYPASS_TRANSFER_THREAD = _BYPASS_TRANSFER_THREAD, bool(on)
    return was


class HeldRef(NamedTuple):
    """Where a held tensor lives: the storage unit keeps this (with dtype and shape, in a
    :class:`~streamrl.wire.WireTensor`) instead of the bytes."""

    holder: str  #: the holding process, ``"<node ip>:<pid>"``
    key: int  #: the tensor's key in that holder
    endpoint: Endpoint  #: the holder's server
    group: str | None = None  #: the RDT group the holder is in (``None``: none)
    rank: int = -1  #: its rank in that group


class GroupInfo(NamedTuple):
    """This process's place in an RDT group."""

    name: str
    rank: int
    world: int
    backend: str
    coordinator: Endpoint


class HolderGone(Exception):
    """The coordinator knows the holder is gone (its connection closed), or the watchdog
    gave up a transfer whose peer is gone."""


class CoordinatorGone(Exception):
    """The group's coordinator cannot be reached (the group was destroyed, or its actor
    died): transfers inside the group cannot be ordered any more, and reads take the
    fallback path."""


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of tensors of ``sizes`` bytes packed into one transfer buffer (each aligned
    to :data:`ALIGN`), and the buffer's size. One tensor: no packing (offset 0)."""
    if len(sizes) == 1:
        return [0], int(sizes[0])
    offs, at = [], 0
    for n in sizes:
        offs.append(at)
        at += -(-int(n) // ALIGN) * ALIGN
    return offs, at


def plan(sizes: Sequence[int]) -> list[list[int]]:
    """The messages one transfer of ranges of ``sizes`` bytes is made of, as lists of
    range indices: each range of :data:`BIG` bytes or more alone, the others packed into
    one message (laid out by :func:`layout`). Both sides compute the same plan."""
    groups = [[i] for i, n in enumerate(sizes) if n >= BIG]
    small = [i for i, n in enumerate(sizes) if n < BIG]
    return groups + [small] if small else groups


class _Op:
    """One operation of a transfer thread: what to run, the group rank of its peer (for
    the watchdog; ``None``: none) and what gives it up (fails whoever waits for it)."""

    __slots__ = ("seq", "fn", "peer", "abandon")

    def __init__(self, seq: int, fn: Callable[[], None], peer: int | None,
                 abandon: Callable[[BaseException], None] | None):
        self.seq, self.fn, self.peer, self.abandon = seq, fn, peer, abandon


class TransferThread:
    """The thread every RDT send and receive of this process runs on, one at a time.

    Operations carry the sequence number the group's coordinator gave them for this
    process; they run in that order (an operation that arrives early waits for those
    before it). Since the coordinator numbers the two sides of every transfer together,
    in one global order, both processes of a transfer reach it after the same earlier
    transfers: no transfer is matched with another one, and none waits for a peer that
    waits for something else. Operations numbered ``0`` (one-sided reads) run as soon as
    the thread is free.

    Args:
        peer_gone: asked by the watchdog about the peer of an operation that has run
            for ``check`` seconds: ``True`` (it is gone: the operation is abandoned and a
            new thread runs the next ones), ``False`` or ``None`` (alive, or unknown:
            wait on). Without it, there is no watchdog.
        check: seconds between the watchdog's looks (see :data:`STALL_CHECK`).
    """

    def __init__(self, peer_gone: Callable[[int], bool | None] | None = None,
                 check: float = STALL_CHECK) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, _Op]] = []
        self._next = 1
        self._n = itertools.count()
        self._current: tuple[_Op, float] | None = None  # the running operation, since
        self._peer_gone = peer_gone
        self._check = check
        #: operations given up because their peer was gone (with their thread)
        self.abandoned = 0
        self._runner = self._start()
        if peer_gone is not None:
            threading.Thread(target=self._watch, name="streamrl-rdt-watch",
                             daemon=True).start()

    def _start(self) -> threading.Thread:
        t = threading.Thread(target=lambda: self._run(t), name="streamrl-rdt-transfer",
                             daemon=True)
        self._runner = t
        t.start()
        return t

    def submit(self, seq: int, fn: Callable[[], None], *, peer: int | None = None,
               abandon: Callable[[BaseException], None] | None = None) -> None:
        """Run ``fn`` on the thread as operation ``seq`` of this process (``peer``: the
        rank it sends to or receives from; ``abandon``: what fails its waiter if the
        watchdog gives it up)."""
        if _BYPASS_TRANSFER_THREAD:
            threading.Thread(target=fn, name="streamrl-rdt-bypass", daemon=True).start()
            return
        with self._cond:
            heapq.heappush(self._heap, (seq, next(self._n), _Op(seq, fn, peer, abandon)))
            self._cond.notify_all()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the thread as soon as it is free (an unordered operation);
        its result as a future (sync callers wait on it, async ones await
        ``asyncio.wrap_future`` of it)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

        self.submit(0, run)
        return fut

    def _run(self, me: threading.Thread) -> None:
        while True:
            with self._cond:
                while not (self._runner is not me or
                           (self._heap and self._heap[0][0] <= self._next)):
                    self._cond.wait()
                if self._runner is not me:
                    return
                seq, _, op = heapq.heappop(self._heap)
                if seq:
                    self._next = seq + 1
                self._current = (op, time.monotonic())
            try:
                op.fn()
            except BaseException:  # noqa: BLE001 - an operation reports its own failure
                log.exception("streamrl: an RDT transfer operation failed")
            with self._cond:
                if self._runner is not me:  # given up meanwhile: another thread goes on
                    return
                self._current = None

    def _watch(self) -> None:
        assert self._peer_gone is not None
        while True:
            time.sleep(self._check)
            with self._cond:
                cur = self._current
            if cur is None or time.monotonic() - cur[1] < self._check:
                continue
            op, peer = cur[0], cur[0].peer
            if peer is None:
                continue
            try:
                gone = self._peer_gone(peer)
            except Exception:  # noqa: BLE001 - unknown: wait on
                log.exception("streamrl: the RDT watchdog could not ask about rank %s", peer)
                gone = None
            if not gone:
                continue
            with self._cond:
                if self._current is not cur:  # it ended meanwhile
                    continue
                self._current = None
                self.abandoned += 1
                self._start()  # the next operations run there; the old thread leaves
                self._cond.notify_all()
            log.warning("streamrl: RDT operation %d with rank %s given up: that peer is gone",
                        op.seq, op.peer)
            if op.abandon is not None:
                op.abandon(HolderGone(f"RDT group member {op.peer} is gone "
                                      "(its transfer was given up)"))


def cannot_join(backend: str) -> str | None:
    """Why this process cannot take part in an RDT group of ``backend`` (``None``: it
    can): nccl needs a GPU, nixl its package."""
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            return "an nccl RDT group needs a GPU in every member (torch sees none here)"
    if backend == "nixl":
        import importlib.util

        if importlib.util.find_spec("nixl") is None:
            return ("a nixl RDT group needs the nixl package in every member (pip install "
                    "nixl); use gloo or nccl otherwise")
    return None


class Runtime:
    """This process's holder, server and transfer thread (see the module docstring)."""

    def __init__(self) -> None:
        import ray

        self.ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self.id = f"{self.ip}:{os.getpid()}"
        self._lock = threading.Lock()
        self._held: dict[int, Any] = {}  # key -> flat uint8 torch tensor (a view, no copy)
        self.held_bytes = 0
        self._keys = itertools.count(1)
        self.endpoint: Endpoint | None = None
        self._server: RpcServer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.group: GroupInfo | None = None
        self.thread: TransferThread | None = None
        self._tickets: dict[int, concurrent.futures.Future] = {}
        self._ticket_ids = itertools.count(1)
        self._coordinator: Any = None  # RpcClient of the group's coordinator
        #: why transfers inside the group stopped (the coordinator is gone): reads take
        #: the fallback path from then on (``None``: they do not)
        self.coordinator_gone: str | None = None

    # -- lifecycle

    def start(self) -> Endpoint:
        """Start serving (once); this holder's endpoint."""
        with self._lock:
            if self.endpoint is None:
                loop = new_loop()
                threading.Thread(target=loop.run_forever, name="streamrl-rdt-server",
                                 daemon=True).start()
                server = RpcServer(_Api(self), self.ip)
                self.endpoint = asyncio.run_coroutine_threadsafe(server.start(), loop).result()
                self._server, self.loop = server, loop
            return self.endpoint

    def join(self, info: GroupInfo) -> tuple[str, Endpoint]:
        """Take part in RDT group ``info`` (once per process); ``(id, endpoint)``."""
        from ..rpc import RpcClient

        if self.group is not None and self.group.name != info.name:
            raise RuntimeError(
                f"this process is in RDT group {self.group.name!r} already; a process takes "
                "part in one RDT group (Ray puts an actor in at most one group per backend)")
        why = cannot_join(info.backend)
        if why is not None:
            raise RuntimeError(why)
        endpoint = self.start()
        if self.thread is None:
            self.thread = TransferThread(self._peer_gone)
        self.group = info
        self.coordinator_gone = None
        self._coordinator = RpcClient(info.coordinator)
        return self.id, endpoint

    async def member_actor(self, rank: int) -> Any:
        """The Ray actor handle of member ``rank`` of this process's group, asked of the
        group's coordinator once and kept (members do not change)."""
        actors: dict[int, Any] = self.__dict__.setdefault("_actors", {})
        if rank not in actors:
            if self._coordinator is None:
                raise TransportError("this process is in no RDT group: it has no members to name")
            actors[rank] = await self._coordinator.call("member_actor", rank)
        return actors[rank]

    def leave(self, name: str) -> None:
        """Leave RDT group ``name`` (its making failed): this process holds and reads as
        one of no group again (its transfer thread stays, idle)."""
        if self.group is not None and self.group.name == name:
            self.group = None
            self._coordinator = None

    def _peer_gone(self, rank: int) -> bool | None:
        """The watchdog's question: is member ``rank`` gone? (the coordinator asks Ray;
        ``None``: unknown, the coordinator did not answer)"""
        coordinator, loop = self._coordinator, self.loop
        if coordinator is None or loop is None:
            return None
        try:
            alive = asyncio.run_coroutine_threadsafe(coordinator.call("alive", rank),
                                                     loop).result(STALL_CHECK * 3)
        except Exception:  # noqa: BLE001 - the coordinator is gone or slow: unknown
            return None
        return None if alive is None else not alive

    # -- the holder

    def hold(self, t: Any) -> tuple[HeldRef, str]:
        """Keep tensor ``t`` (no copy when it is contiguous; the producer must not change
        it in place afterwards) and return its reference and device type."""
        import torch

        if t.requires_grad:
            t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        t = t.resolve_conj().resolve_neg()
        flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(
            0, dtype=torch.uint8, device=t.device)
        endpoint = self.start()
        with self._lock:
            key = next(self._keys)
            self._held[key] = flat
            self.held_bytes += flat.numel()
        g = self.group
        return (HeldRef(self.id, key, endpoint, g.name if g else None, g.rank if g else -1),
                t.device.type)

    def free(self, keys: Sequence[int]) -> None:
        """Forget held tensors (no row refers to them any more)."""
        with self._lock:
            for k in keys:
                t = self._held.pop(k, None)
                if t is not None:
                    self.held_bytes -= t.numel()

    def views(self, ranges: Sequence[tuple[int, int, int]]) -> list[Any] | None:
        """Views of ``(key, offset, nbytes)`` ranges of held tensors; ``None`` when one is
        no longer held (its rows were dropped)."""
        with self._lock:
            out = []
            for key, off, n in ranges:
                t = self._held.get(key)
                if t is None:
                    return None
                out.append(t[off:off + n])
            return out

    def stats(self) -> dict[str, int]:
        """``tensors`` and ``bytes`` held now."""
        with self._lock:
            return {"tensors": len(self._held), "bytes": self.held_bytes}

    # -- transfers (the coordinator's operations, run on the transfer thread)

    def _member(self) -> GroupInfo:
        """This process's RDT group. Transfers inside a group (the coordinator's
        operations, :meth:`pull`) only come once the process joined one.

        Raises:
            TransportError: the process is not in an RDT group.
        """
        if self.group is None:
            raise TransportError(
                f"process {self.id} is not in an RDT group, so it cannot move held tensors "
                "inside one; make the group over its actors with "
                "streamrl.transport.rdt.create_group first")
        return self.group

    def _transfers(self) -> TransferThread:
        """This process's transfer thread (started when the process joins an RDT group).

        Raises:
            TransportError: it is not started (the process never joined a group).
        """
        if self.thread is None:
            raise TransportError(
                f"the RDT transfer thread of process {self.id} is not started: it starts when "
                "the process joins an RDT group (streamrl.transport.rdt.create_group)")
        return self.thread

    def _device(self) -> Any:
        import torch

        if self.group is not None and self.group.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def send_op(self, seq: int, dst: int, ranges: list) -> None:
        """Operation ``seq``: send ``ranges`` of held tensors to rank ``dst`` (views taken
        now, so a free that arrives meanwhile does not take them away)."""
        views = self.views(ranges)
        self._transfers().submit(seq, lambda: self._send(dst, views), peer=dst)

    def _send(self, dst: int, views: list | None) -> None:
        import ray.util.collective as col
        import torch

        group = self._member().name
        dev = self._device()
        if views is None:  # a tensor is gone: say so instead of sending garbage
            col.send(torch.tensor([-1], dtype=torch.int64, device=dev), dst, group)
            return
        sizes = [v.numel() for v in views]
        col.send(torch.tensor([sum(sizes)], dtype=torch.int64, device=dev), dst, group)
        for idx in plan(sizes):
            offs, total = layout([sizes[i] for i in idx])
            if not total:
                continue
            if len(idx) == 1:  # a big range (or the only one): sent as it is
                payload = views[idx[0]].to(dev)
            else:  # small ranges: one message (per-message overhead dominates them)
                payload = torch.empty(total, dtype=torch.uint8, device=dev)
                for i, o in zip(idx, offs):
                    payload[o:o + sizes[i]].copy_(views[i])
            col.send(payload, dst, group)

    def recv_op(self, seq: int, src: int, ticket: int, sizes: list[int]) -> None:
        """Operation ``seq``: receive ranges of ``sizes`` bytes from rank ``src`` for
        ``ticket``."""
        fut = self._tickets.pop(ticket, None)
        self._transfers().submit(seq, lambda: self._recv(src, fut, sizes), peer=src,
                                 abandon=lambda e: _fail(fut, e))

    def _recv(self, src: int, fut: concurrent.futures.Future | None, sizes: list[int]) -> None:
        import ray.util.collective as col
        import torch

        try:
            group = self._member().name
            dev = self._device()
            head = torch.zeros(1, dtype=torch.int64, device=dev)
            col.recv(head, src, group)
            sent = int(head.item())
            if sent < 0:
                raise KeyError("the holder no longer holds some of these tensors")
            if sent != sum(sizes):
                raise RuntimeError(f"RDT transfer out of step: {sent} bytes sent, "
                                   f"{sum(sizes)} expected")
            out: list[Any] = [None] * len(sizes)
            groups = plan(sizes)
            # the big ranges land side by side in one buffer, in their order: rows of one
            # column read through several storage units are then adjacent views, which
            # materialize joins without copying
            bigs = [g[0] for g in groups if len(g) == 1 and sizes[g[0]] >= BIG]
            boffs, btotal = layout([sizes[i] for i in bigs]) if bigs else ([], 0)
            if len(bigs) > 1:
                big = torch.empty(btotal, dtype=torch.uint8, device=dev)
                for i, o in zip(bigs, boffs):
                    out[i] = big[o:o + sizes[i]]
            for idx in groups:
                if out[idx[0]] is not None:  # a big range, in the shared buffer
                    col.recv(out[idx[0]], src, group)
                    continue
                offs, total = layout([sizes[i] for i in idx])
                buf = torch.empty(total, dtype=torch.uint8, device=dev)
                if total:
                    col.recv(buf, src, group)
                for i, o in zip(idx, offs):
                    out[i] = buf[o:o + sizes[i]]
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            _fail(fut, e)
            return
        if fut is not None and not fut.done():
            try:
                fut.set_result(out)
            except concurrent.futures.InvalidStateError:  # the reader gave up meanwhile
                pass

    async def pull(self, rank: int, ranges: list, holder: Any = None) -> list[Any]:
        """Have the group's coordinator move ``ranges`` (``(key, offset, nbytes)``) of the
        tensors rank ``rank`` holds here, in the messages :func:`plan` says; a flat uint8
        tensor per range (views of the buffers received).
        Awaits the transfer thread without blocking the event loop. (``holder``: the
        holder's client, used only by the tests' naive design.)

        Raises:
            HolderGone: the coordinator knows the holder is gone, or the transfer was
                given up because it is (see the module docstring).
            CoordinatorGone: the group's coordinator cannot be reached (the group was
                destroyed): the transfer was not made (or, if it was, its bytes are
                dropped).
            KeyError: the holder no longer holds some of the tensors.
            TransportError: this process is not in an RDT group.
            Exception: the collective transfer failed (the peer died mid-way...).
        """
        me = self._member().rank
        if self.coordinator_gone is not None:
            raise CoordinatorGone(self.coordinator_gone)
        coordinator = self._coordinator
        sizes = [int(n) for _, _, n in ranges]
        ticket = next(self._ticket_ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._tickets[ticket] = fut
        if _BYPASS_TRANSFER_THREAD and holder is not None:  # the naive design (tests only)
            self._tickets.pop(ticket, None)
            self._transfers().submit(0, lambda: self._recv(rank, fut, sizes))
            await holder.call("op", 0, "send", me, list(ranges))
            return await asyncio.wrap_future(fut)
        try:
            await coordinator.call("transfer", rank, me, ticket, list(ranges), sizes)
        except ConnectionError as e:
            # the receive, if it was issued, still runs (the thread keeps its order) and
            # its bytes are dropped
            self._tickets.pop(ticket, None)
            if self._coordinator is coordinator and self.coordinator_gone is None:
                self.coordinator_gone = (f"the coordinator of RDT group {self._member().name} "
                                         f"cannot be reached ({e})")
                log.warning("streamrl: %s; reads of held tensors take the fallback path "
                            "(the holders' sockets) from now on", self.coordinator_gone)
            raise CoordinatorGone(self.coordinator_gone or str(e)) from None
        except BaseException:
            self._tickets.pop(ticket, None)  # (as above)
            raise
        return await asyncio.wrap_future(fut)


def _fail(fut: concurrent.futures.Future | None, e: BaseException) -> None:
    """Fail a reader's wait (unless it ended already)."""
    if fut is not None and not fut.done():
        try:
            fut.set_exception(e)
        except concurrent.futures.InvalidStateError:  # the reader gave up meanwhile
            pass


class _Api:
    """What the holder's server serves (its public methods)."""

    def __init__(self, rt: Runtime):
        self._rt = rt

    def op(self, seq: int, kind: str, *args: Any) -> None:
        """An operation from the group's coordinator (sent without waiting, in order)."""
        if kind == "send":
            self._rt.send_op(seq, *args)
        elif kind == "recv":
            self._rt.recv_op(seq, *args)
        else:
            log.warning("streamrl: unknown RDT operation %r", kind)

    def free(self, keys: list[int]) -> None:
        self._rt.free(keys)

    def read(self, ranges: list[tuple[int, int, int]]) -> list | None:
        """The bytes of ``ranges`` (the fallback path, for readers outside the group):
        numpy views, sent as they are; ``None`` when a tensor is no longer held."""
        views = self._rt.views(ranges)
        if views is None:
            return None
        return [v.cpu().numpy() for v in views]

    def stats(self) -> dict[str, int]:
        return self._rt.stats()

    def ping(self) -> bool:
        return True


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def runtime() -> Runtime:
    """This process's runtime (made on first use)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = Runtime()
        return _runtime


def current() -> Runtime | None:
    """This process's runtime if it has one."""
    return _runtime
