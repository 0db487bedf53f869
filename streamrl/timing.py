"""Where a training step's time goes: how long each role waits on the queue against how
long it computes.

``with q.timed("actor_update"):`` (or ``async with``) around a role's work; every queue
call made inside it (``put``, ``get``, the next batch of a ``stream``, ``materialize``,
``write``, ``ack``, ``release``, ``drop``), in this task and in tasks it starts, adds its
duration to the role's queue time. ``q.timings()`` then gives, per role, the seconds
spent in its blocks, the part spent in queue calls, and the rest (compute)::

    with q.timed("actor_update"):
        async for mb in q.stream("actor_update", fields, 32):  # the wait: queue time
            td = await mb.materialize()     # queue time
            loss = train_step(td)           # compute time

Open the block around the ``async for``: the wait for the next batch happens in the
``async for`` statement, before the body runs, so a block opened inside the loop misses
it (usually the largest part of a consumer's queue time).

Outside any ``timed`` block the bookkeeping costs one context-variable lookup per call.
A queue call that makes other queue calls (``write`` puts) is counted once.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["RoleTiming", "Timer", "timed_call", "counted"]

T = TypeVar("T")


@dataclass
class RoleTiming:
    """Time of one role, summed over its ``timed`` blocks.

    Attributes:
        seconds: time inside the blocks (wall clock; overlapping blocks add up).
        queue_seconds: the part spent in queue calls.
        compute_seconds: the rest (``seconds - queue_seconds``).
        queue_share: ``queue_seconds / seconds`` (0 when nothing was timed).
        blocks: how many blocks were timed.
        calls: how many queue calls were made in them.
    """

    seconds: float = 0.0
    queue_seconds: float = 0.0
    blocks: int = 0
    calls: int = 0

    @property
    def compute_seconds(self) -> float:
        return max(0.0, self.seconds - self.queue_seconds)

    @property
    def queue_share(self) -> float:
        return self.queue_seconds / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, float]:
        return {"seconds": self.seconds, "queue_seconds": self.queue_seconds,
                "compute_seconds": self.compute_seconds, "queue_share": self.queue_share,
                "blocks": self.blocks, "calls": self.calls}


_current: contextvars.ContextVar[RoleTiming | None] = contextvars.ContextVar(
    "streamrl_role", default=None)
_inside: contextvars.ContextVar[bool] = contextvars.ContextVar("streamrl_in_call", default=False)


class Timer:
    """The context manager ``StreamQueue.timed(role)`` returns (sync and async)."""

    __slots__ = ("_rec", "_t0", "_token")

    def __init__(self, rec: RoleTiming):
        self._rec = rec
        self._t0 = 0.0
        self._token: contextvars.Token | None = None

    def __enter__(self) -> RoleTiming:
        self._token = _current.set(self._rec)
        self._t0 = time.perf_counter()
        return self._rec

    def __exit__(self, *exc: Any) -> None:
        self._rec.seconds += time.perf_counter() - self._t0
        self._rec.blocks += 1
        if self._token is not None:
            _current.reset(self._token)
            self._token = None

    async def __aenter__(self) -> RoleTiming:
        return self.__enter__()

    async def __aexit__(self, *exc: Any) -> None:
        self.__exit__(*exc)


async def timed_call(aw: Awaitable[T]) -> T:
    """Await ``aw``, adding its duration to the current role's queue time (if any; an
    outer queue call already counting is not counted twice)."""
    rec = _current.get()
    if rec is None or _inside.get():
        return await aw
    token = _inside.set(True)
    t0 = time.perf_counter()
    try:
        return await aw
    finally:
        rec.queue_seconds += time.perf_counter() - t0
        rec.calls += 1
        _inside.reset(token)


def is_open() -> bool:
    """Whether a ``timed`` block is open here (its role counts the queue's calls)."""
    return _current.get() is not None


def counted(aw: Awaitable[T]) -> Awaitable[T]:
    """``aw``, counted in the current role's queue time when a ``timed`` block is open
    (else ``aw`` itself: no extra frame on the hot paths)."""
    return aw if _current.get() is None else timed_call(aw)
