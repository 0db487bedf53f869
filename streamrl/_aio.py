"""Small asyncio helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")

__all__ = ["shielded", "to_thread_whole", "wait_whole"]


async def shielded(aw: Awaitable[T]) -> T:
    """Run ``aw`` to the end even if the awaiting task is cancelled meanwhile; the
    cancellation goes on once it is done.

    ``anyio.CancelScope(shield=True)`` alone only holds off anyio's own cancel scopes,
    not a native ``task.cancel()`` (``asyncio.wait_for``, ``Task.cancel``): the work runs
    as a task of its own, which the caller waits for before letting a cancellation go on.
    """
    task = asyncio.ensure_future(aw)
    with anyio.CancelScope(shield=True):
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                try:
                    await asyncio.wait([task])
                except asyncio.CancelledError:  # cancelled again: give up waiting
                    pass
            raise
    # (a shielded scope swallows only its own cancel(), which nothing calls)
    raise AssertionError("unreachable: the shielded scope swallowed an exception")


async def wait_whole(aw: Awaitable[T]) -> T:
    """Await ``aw`` (run as a task of its own) to its end whatever happens to the
    awaiting task: cancellations, however many, are held until it is done, then the
    first goes on. For work whose abandonment would break an invariant (a thread that
    writes files which the caller's cleanup removes), where :func:`shielded`, which
    stops waiting at a second cancellation, is not enough."""
    task = asyncio.ensure_future(aw)
    cancelled: BaseException | None = None
    while True:
        try:
            with anyio.CancelScope(shield=True):
                await asyncio.wait([task])
            break
        except asyncio.CancelledError as e:  # (a native task.cancel())
            if cancelled is None:
                cancelled = e
    if cancelled is not None:
        if not task.cancelled():
            task.exception()  # (retrieved: the cancellation is what goes on)
        raise cancelled
    return task.result()


async def to_thread_whole(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread, waited for to its end even if the awaiting task
    is cancelled meanwhile (see :func:`wait_whole`). ``anyio.to_thread.run_sync`` holds
    off anyio's own cancel scopes but not a native ``task.cancel()``: the thread would go
    on, abandoned, while the caller's cleanup runs beside it."""
    return await wait_whole(anyio.to_thread.run_sync(fn, *args))
