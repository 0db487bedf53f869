"""RDT groups: who creates them, how actors join, and the coordinator that orders every
transfer inside one.

:func:`create_group` is called by the process that has the actors' handles (usually the
driver), once the actors exist and before they start streaming. It

1. creates Ray's collective group over them (``gloo``: ``torch_gloo``; ``nccl``) with
   :func:`ray.experimental.collective.create_collective_group` (``nixl`` needs none: it is
   one-sided), so each actor's ``torch.distributed`` world is this group;
2. starts the group's **coordinator**, a small async actor (``num_cpus=0``);
3. has each actor join (:meth:`.runtime.Runtime.join`): it starts its holder's server and
   its transfer thread, and tells the coordinator where they are.

Ray's rules shape this: an actor takes part in at most one collective group per backend
(and Ray's gloo sends through the process's default ``torch.distributed`` group), so a
process is in at most one RDT group, and a group's members are fixed when it is created:
create it over every actor that produces or consumes held fields. Several queues can use
one group. Processes outside it (the driver, tasks, actors of another group) still read
held fields, over the holder's socket (the fallback path).

Every transfer inside the group is made by the coordinator: a reader asks it to move
ranges of tensors from a holder; it numbers the two operations (a send at the holder, a
receive at the reader) in one global order and sends each to its process, whose transfer
thread runs its operations in that order (see :class:`.runtime.TransferThread`).

When a group cannot be made (a member lacks nixl or a GPU, an actor is in another
collective group, Ray's collective group fails), :func:`create_group` raises
:class:`~streamrl.errors.TransportError` naming what failed, and leaves nothing behind:
members that had joined leave, the collective group and the coordinator are destroyed, so
the actors work on as processes of no group (puts through the storage units, reads over
the holders' sockets) or can be put in another group. There is no silent fallback to
another backend: a group asked for is made as asked, or not at all. Once a group is
destroyed (:meth:`RdtGroup.destroy`), or its coordinator dies, its members' reads take
the fallback path (the holders' sockets) and their held tensors stay readable.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray

from ...config import check_timeout
from ...errors import TransportError
from ..rpc import Endpoint, RpcClient, RpcServer
from .runtime import BACKENDS, STALL_CHECK, GroupInfo, HolderGone, cannot_join, runtime

__all__ = ["RdtGroup", "create_group", "CoordinatorImpl", "Coordinator"]

log = logging.getLogger("streamrl")


class _Member:
    __slots__ = ("rank", "id", "endpoint", "actor", "client", "alive")

    def __init__(self, rank: int, mid: str, endpoint: Endpoint, actor: Any, on_broken):
        self.rank, self.id, self.endpoint, self.actor = rank, mid, endpoint, actor
        self.client = RpcClient(endpoint, on_broken=on_broken)
        self.alive = True


class CoordinatorImpl:
    """Orders the transfers of one RDT group (see the module docstring)."""

    def __init__(self, name: str, backend: str):
        self.name, self.backend = name, backend
        self.members: dict[int, _Member] = {}
        self.seq: dict[int, int] = {}
        self.transfers = 0
        self.stopped = False  # (stop(): no transfer is made any more)
        self._rpc = RpcServer(self, ray.util.get_node_ip_address())
        self._endpoint: Endpoint | None = None

    async def endpoint(self) -> Endpoint:
        if self._endpoint is None:
            self._endpoint = await self._rpc.start()
        return self._endpoint

    def add_members(self, members: list[tuple[int, str, Endpoint, Any]]) -> None:
        for rank, mid, endpoint, actor in members:
            self.members[rank] = _Member(rank, mid, endpoint, actor,
                                         on_broken=lambda r=rank: self._gone(r))
            self.seq.setdefault(rank, 0)

    def _gone(self, rank: int) -> None:
        m = self.members.get(rank)
        if m is not None and m.alive:
            m.alive = False
            log.warning("streamrl: RDT group %s: member %d (%s) is gone", self.name, rank, m.id)

    async def transfer(self, src: int, dst: int, ticket: int, ranges: list, sizes: list) -> int:
        """Move ``ranges`` (``(key, offset, nbytes)``) of what rank ``src`` holds to rank
        ``dst``, as ticket ``ticket`` of ``dst``. Returns once both operations are sent
        (not done): the receiver's transfer thread reports the result.

        Raises:
            HolderGone: rank ``src`` is gone.
        """
        s, d = self.members.get(src), self.members.get(dst)
        if s is None or d is None:
            raise ValueError(f"RDT group {self.name} has no rank {src if s is None else dst}")
        for m in (s, d):
            if not m.alive:
                raise HolderGone(f"RDT group member {m.rank} ({m.id}) is gone")
            try:
                await m.client.connection()
            except ConnectionError:
                self._gone(m.rank)
                raise HolderGone(f"RDT group member {m.rank} ({m.id}) is gone") from None
        if self.stopped:  # (stopped while this call waited for a connection)
            raise ConnectionAbortedError(f"RDT group {self.name} was destroyed")
        # number both operations and send them with no await in between: every member
        # gets its operations in the one global order they are made in
        self.seq[src] += 1
        self.seq[dst] += 1
        if not s.client.notify("op", self.seq[src], "send", dst, ranges):
            self.seq[src] -= 1
            self.seq[dst] -= 1
            self._gone(src)
            raise HolderGone(f"RDT group member {src} ({s.id}) is gone")
        if not d.client.notify("op", self.seq[dst], "recv", src, ticket, sizes):
            self.seq[dst] -= 1  # the holder's send fails once the reader's process is gone
            self._gone(dst)
            raise HolderGone(f"RDT group member {dst} ({d.id}) is gone")
        self.transfers += 1
        return self.transfers

    async def holder_stats(self) -> dict[int, dict[str, int] | None]:
        """What each member holds now (``None``: gone)."""

        async def one(m: _Member):
            if not m.alive:
                return None
            try:
                return await m.client.call("stats")
            except ConnectionError:
                self._gone(m.rank)
                return None

        ranks = sorted(self.members)
        res = await asyncio.gather(*[one(self.members[r]) for r in ranks])
        return dict(zip(ranks, res))

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "backend": self.backend, "transfers": self.transfers,
                "members": {r: {"id": m.id, "alive": m.alive} for r, m in self.members.items()}}

    def member_actor(self, rank: int) -> Any:
        return self.members[rank].actor

    async def alive(self, rank: int) -> bool | None:
        """Whether member ``rank`` is alive, for a transfer thread's watchdog: ``False``
        once its connection closed or Ray says its actor is dead (a lost node
        included), ``True`` when its actor answers, ``None`` when it does not answer in
        time (busy, or on a node Ray has not declared lost yet)."""
        m = self.members.get(rank)
        if m is None or not m.alive:
            return None if m is None else False
        try:
            await asyncio.wait_for(
                m.actor.__ray_call__.options(concurrency_group="_ray_system").remote(_ping),
                STALL_CHECK)
        except ray.exceptions.RayActorError:
            self._gone(rank)
            return False
        except Exception:  # noqa: BLE001 - a timeout, or Ray could not say
            return None
        return True

    def ping(self) -> bool:
        return True

    def stop(self) -> bool:
        """Make no transfer any more: stop listening and drop every member's connection
        (their transfer calls fail, and their reads take the fallback path)."""
        self.stopped = True
        self._rpc.close()
        return True


#: the coordinator as a Ray actor (async, no CPU reserved)
Coordinator = ray.remote(num_cpus=0)(CoordinatorImpl)


def _join(_self: Any, info: GroupInfo) -> tuple[str, Endpoint]:
    """Run in each member actor (``__ray_call__``): join the group."""
    return runtime().join(info)


def _leave(_self: Any, name: str) -> None:
    """Run in each member actor (``__ray_call__``): leave group ``name`` (its making
    failed)."""
    runtime().leave(name)


def _cannot_join(_self: Any, backend: str) -> str | None:
    """Run in each member actor (``__ray_call__``): why it cannot join (``None``: it can)."""
    rt = runtime()
    if rt.group is not None:
        return (f"it is in RDT group {rt.group.name!r} already (a process takes part in one "
                "RDT group for its life)")
    return cannot_join(backend)


def _ping(_self: Any) -> bool:
    return True


class RdtGroup:
    """An RDT group made by :func:`create_group`: its name, backend, members and
    coordinator actor."""

    def __init__(self, name: str, backend: str, actors: list, coordinator: Any):
        self.name, self.backend, self.actors, self.coordinator = name, backend, actors, coordinator

    def holder_stats(self) -> dict[int, dict[str, int] | None]:
        """Tensors and bytes each member holds now, by rank (blocking)."""
        return ray.get(self.coordinator.holder_stats.remote())

    def info(self) -> dict[str, Any]:
        """Name, backend, transfers made, and each member's id and liveness (blocking)."""
        return ray.get(self.coordinator.info.remote())

    def destroy(self, timeout: float | None = 30.0) -> None:
        """Stop the coordinator, and return once it is gone (blocking, up to twice
        ``timeout`` seconds). Members keep what they hold; transfers inside the group
        stop, and members read held tensors over the fallback path (the holders'
        sockets) from then on: no transfer starts after this returns. (The coordinator
        is told to stop before it is killed: a killed actor's process may serve its
        socket a little longer than Ray takes to report the actor dead.) When that
        cannot be made sure, a warning says so: the coordinator did not answer ``stop``
        within ``timeout`` (hung: it is killed without it), or Ray does not report it
        dead ``timeout`` seconds after it was killed. ``timeout=None`` waits for ever.

        Raises:
            InvalidArgument: ``timeout`` is not ``None`` or a finite number >= 0.
        """
        timeout = check_timeout("timeout", timeout)
        limit = math.inf if timeout is None else timeout
        try:
            ray.get(self.coordinator.stop.remote(), timeout=timeout)
        except ray.exceptions.RayActorError:
            pass  # gone already
        except Exception as e:  # noqa: BLE001 - not answering: killed below
            log.warning(
                "streamrl: RDT group %s: its coordinator did not answer stop within %ss "
                "(%s); killing it without it: a member may start a transfer until its "
                "process is gone", self.name, timeout, type(e).__name__)
        try:
            ray.kill(self.coordinator)
        except Exception:  # noqa: BLE001 - already gone
            return
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            try:
                ray.get(self.coordinator.ping.remote(),
                        timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except ray.exceptions.RayActorError:
                return
            except ray.exceptions.GetTimeoutError:  # (not an answer, nor proof it is gone)
                continue
            time.sleep(0.1)
        log.warning("streamrl: RDT group %s: its coordinator is still there %ss after it "
                    "was killed (it answers, or hangs): a member may start a transfer "
                    "until its process is gone", self.name, timeout)


def create_group(actors: Sequence[Any], backend: str = "gloo", *, name: str | None = None,
                 coordinator_options: dict | None = None) -> RdtGroup:
    """Make an RDT group of ``actors``, so that tensor fields they put stay with them and
    move between them point to point. Blocking (call it from the driver, after creating
    the actors and before they stream; from async code, in a thread).

    Args:
        actors: the actors that produce or consume held fields, each created with
            ``enable_tensor_transport=True`` (Ray's requirement for RDT), none in
            another collective group of this backend.
        backend: ``"gloo"`` (CPU tensors), ``"nccl"`` (CUDA tensors, one GPU per member)
            or ``"nixl"`` (one-sided reads; needs the ``nixl`` package).

    Keyword Args:
        name: the group's name (default: a fresh one).
        coordinator_options: ``.options()`` for the coordinator actor (placement).

    Returns:
        The :class:`RdtGroup`.

    Raises:
        ValueError: an unknown backend, no actors, or an actor twice.
        TransportError: the group cannot be made: a member cannot take part (nccl
            without a GPU, nixl without its package), Ray refused the collective group
            (an actor in another group), or a member failed to join. Nothing is left
            made (see the module docstring).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown RDT backend {backend!r}; use one of {', '.join(BACKENDS)}")
    actors = list(actors)
    if not actors:
        raise ValueError("an RDT group needs at least one actor")
    if len({a._actor_id for a in actors}) != len(actors):
        raise ValueError("an actor is given twice")
    name = name or f"streamrl-rdt-{uuid.uuid4().hex[:12]}"
    why = ray.get([a.__ray_call__.remote(_cannot_join, backend) for a in actors])
    lacking = [(r, w) for r, w in enumerate(why) if w]
    if lacking:
        raise TransportError(
            f"RDT group {name!r} ({backend}) cannot be made: "
            + "; ".join(f"member {r}: {w}" for r, w in lacking)
            + ". Nothing was made; the actors work on outside any group (the fallback path)")
    collective = backend in ("gloo", "nccl") and len(actors) > 1
    coordinator: Any = None
    try:
        if collective:
            from ray.experimental.collective import create_collective_group

            create_collective_group(actors, backend="torch_gloo" if backend == "gloo"
                                    else "nccl", name=name)
        # (Any: Ray's annotations type a handle's methods as the class's, without .remote)
        coordinator = Coordinator.options(**(coordinator_options or {})).remote(name, backend)
        cep = ray.get(coordinator.endpoint.remote())
        joined = ray.get([a.__ray_call__.remote(_join, GroupInfo(name, r, len(actors), backend,
                                                                 cep))
                          for r, a in enumerate(actors)])
        ray.get(coordinator.add_members.remote(
            [(r, mid, ep, a) for r, ((mid, ep), a) in enumerate(zip(joined, actors))]))
    except Exception as e:
        _undo(name, actors, coordinator, collective)
        cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause else e
        raise TransportError(
            f"RDT group {name!r} ({backend}) could not be made ({type(cause).__name__}: "
            f"{cause}). Nothing was left made; the actors work on outside any group (the "
            "fallback path)") from e
    return RdtGroup(name, backend, actors, coordinator)


def _undo(name: str, actors: list, coordinator: Any, collective: bool) -> None:
    """Take back what a failed :func:`create_group` made (each step as far as it goes)."""
    try:
        ray.get([a.__ray_call__.remote(_leave, name) for a in actors], timeout=30)
    except Exception as e:  # noqa: BLE001 - a member that died has nothing to leave
        log.warning("streamrl: members of the failed RDT group %s could not leave (%r)", name, e)
    if coordinator is not None:
        try:
            ray.kill(coordinator)
        except Exception:  # noqa: BLE001 - already gone
            pass
    if collective:
        try:
            from ray.experimental.collective import destroy_collective_group

            destroy_collective_group(name)
        except Exception:  # noqa: BLE001 - it was not made (Ray refused it)
            pass
