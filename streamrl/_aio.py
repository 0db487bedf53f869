"""Small asyncio helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import anyio

T = TypeVar("T")

__all__ = ["shielded"]


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
