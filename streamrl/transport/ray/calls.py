"""How the pieces of the Ray transport call each other: Ray's errors as streamrl's,
calls that do not wait, the wait for the undo of a cancelled call, and background work
that is neither lost nor silent.

Every actor serves its methods both as Ray actor methods and over a socket channel
(:mod:`streamrl.transport.rpc`, about 30x cheaper); callers use the socket when they
have one and Ray otherwise.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
from collections.abc import Coroutine
from typing import Any

import ray

from ...errors import TransportError
from ..rpc import ConnectFailed, Endpoint, RpcClient

__all__ = ["Endpoints", "UNDO_TIMEOUT", "unwrap", "send", "post", "undone", "spawn",
           "new_loop", "request_id"]

log = logging.getLogger("streamrl")

#: the controller's socket endpoint and the storage units' (see :mod:`streamrl.transport.rpc`)
Endpoints = tuple[Endpoint, list[Endpoint]]

#: seconds a cancelled call waits for its effect to be taken back before it gives up
UNDO_TIMEOUT = 10.0

_rid_count = itertools.count()
_rid_prefix: str | None = None  # this process's part of its request ids


def _new_rid_prefix() -> None:
    global _rid_prefix
    _rid_prefix = None


os.register_at_fork(after_in_child=_new_rid_prefix)  # a forked child draws its own


def request_id() -> str:
    """An id for a call that may have to be taken back, unique across processes: this
    process's id and a random part (drawn once per process, and again in a forked
    child), then a counter. A ``uuid4`` per call cost a system call for its random
    bytes on every small put."""
    global _rid_prefix
    if _rid_prefix is None:
        _rid_prefix = f"{os.getpid():x}-{secrets.token_hex(8)}-"
    return f"{_rid_prefix}{next(_rid_count):x}"


def unwrap(e: BaseException, what: str) -> BaseException:
    """Turn Ray's wrappers into streamrl errors (``what``: the actor, for the message)."""
    if isinstance(e, ray.exceptions.RayTaskError):
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            return cause
    if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)):
        return TransportError(
            f"the queue's {what} is gone ({type(e).__name__}); the queue cannot be used any "
            "more: create a new one (or reconnect if it was restarted)")
    return e


def send(rpc: RpcClient | None, actor: Any, method: str, *args: Any) -> None:
    """Call ``method`` without waiting for it: on the socket channel when this event loop
    has a connection to the actor (after the calls already sent on it), else through Ray."""
    if rpc is None or not rpc.notify(method, *args):
        getattr(actor, method).remote(*args)


def post(rpc: RpcClient | None, actor: Any, method: str, *args: Any) -> None:
    """Like :func:`send`, for a message that may arrive a little later (a report of
    statistics): when this event loop has no connection to the actor yet, one is opened
    in the background and the message goes on it (through Ray if it cannot be opened),
    so that the next ones need no Ray call; with no event loop here, through Ray."""
    if rpc is not None:
        if rpc.notify(method, *args):
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            spawn(_post_on_connection(rpc, actor, method, args), f"sending {method}")
            return
    getattr(actor, method).remote(*args)


async def _post_on_connection(rpc: RpcClient, actor: Any, method: str, args: tuple) -> None:
    try:
        await rpc.call(method, *args)
    except ConnectFailed:  # (nothing was sent)
        getattr(actor, method).remote(*args)
    except ConnectionError as e:  # sent, then the actor went (a queue shut down): a late
        # report to an actor that is gone has no one to tell
        log.debug("streamrl: %s was sent, then its connection was lost: %r", method, e)


async def undone(aw: Coroutine, what: str) -> None:
    """Wait (shielded from further cancellation, up to :data:`UNDO_TIMEOUT`) for the undo
    of a cancelled call; a failure is logged (the lease or write timeout cleans up)."""
    task = spawn(aw, f"taking back a cancelled {what} (its lease or write times out instead)")
    try:
        await asyncio.wait_for(asyncio.shield(task), UNDO_TIMEOUT)
    except asyncio.CancelledError:
        raise
    except asyncio.TimeoutError:
        log.warning("streamrl: taking back a cancelled %s takes over %ss; the cancellation "
                    "goes on (its lease or write times out if the undo never lands)", what,
                    UNDO_TIMEOUT)
    except Exception:  # noqa: BLE001 - logged by spawn; the cancellation goes on regardless
        pass


#: tasks started by :func:`spawn` and not finished (the event loop keeps weak references)
_running: set[asyncio.Task] = set()


def spawn(coro: Coroutine, what: str) -> asyncio.Task:
    """Run ``coro`` as a task of this event loop that is referenced until it ends and
    whose failure is logged (whether or not anyone awaits it)."""
    task = asyncio.ensure_future(coro)
    _running.add(task)

    def done(t: asyncio.Task) -> None:
        _running.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.warning("streamrl: %s failed: %r", what, t.exception())

    task.add_done_callback(done)
    return task


def new_loop() -> asyncio.AbstractEventLoop:
    """A new event loop (uvloop's when installed)."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()
