"""GRPO puts cancelled at every await, and storage reads seen (or raced) from the test:
shared by the cancellation, lifecycle and combine tests of filter jobs."""

from __future__ import annotations

import asyncio

import torch

from streamrl.errors import RowsDropped


class CountingReads:
    """Wraps an embedded queue's storage reads: counts them, takes ``turns`` turns of
    the event loop before each, and raises ``RowsDropped`` in place of the next ``fail``
    of them."""

    def __init__(self, q, fail=0, turns=0):
        self.data = q.session.transport.control.data
        self.inner = self.data.get
        self.calls: list[int] = []  # parts (unit reads) of each call
        self.fail = fail
        self.turns = turns
        self.data.get = self

    async def __call__(self, parts):
        self.calls.append(len(parts))
        for _ in range(self.turns):
            await asyncio.sleep(0)
        if self.fail:
            self.fail -= 1
            raise RowsDropped("(a test: rows dropped as they were read)")
        return await self.inner(parts)


async def cancel_after_turns(coro, turns: int, pause: float = 0.0) -> bool:
    """Run ``coro``, cancelling it after ``turns`` sleeps of ``pause`` seconds (0: turns
    of the event loop). Returns whether it completed."""
    task = asyncio.ensure_future(coro)
    for _ in range(turns):
        await asyncio.sleep(pause)
    task.cancel()
    try:
        await task
        return True
    except asyncio.CancelledError:
        return False


async def cancelled_grpo_puts(q, steps: int, groups: int, size: int, pause: float = 0.0
                              ) -> int:
    """``steps`` puts of ``groups`` GRPO groups of ``size`` rows each into partition "p"
    (each put's first group has no signal), the k-th cancelled after k sleeps of
    ``pause`` and put again when it did not complete; then the partition is sealed and
    task "t" drains it by whole groups. Returns the rows it got."""
    for k in range(steps):
        uid = torch.arange(k * groups, (k + 1) * groups).repeat_interleave(size)
        reward = torch.tensor([0., 1.]).repeat(groups * size // 2)
        reward[:size] = 1.0  # the first group carries no signal
        data = {"uid": uid, "reward": reward}
        if not await cancel_after_turns(q.put(data, partition="p"), k, pause):
            await q.put(data, partition="p")
    await q.seal("p")
    n = 0
    async for mb in q.stream("t", ["uid", "reward"], 8, partition="p", group_by="uid",
                             group_size=size, timeout=30):
        n += len(mb)
        await mb.ack()
    return n


def drop_as_read(svc) -> list[int]:
    """Make the next storage read of controller service ``svc`` (embedded) race a drop:
    the controller drops the read's first row as the read runs, and the read raises
    ``RowsDropped`` naming it (a ``drop``, staleness or ``clear`` racing a filter job's
    read). Returns the list that receives the row so dropped."""
    inner = svc.data.get
    raced: list[int] = []

    async def racing_get(parts):
        if not raced:
            (_, rows, _), = parts
            raced.append(rows[0])
            svc.ctl.drop([rows[0]])  # (the controller drops it as the read runs)
            raise RowsDropped("(a test: dropped as it was read)", [rows[0]])
        return await inner(parts)

    svc.data.get = racing_get
    return raced
