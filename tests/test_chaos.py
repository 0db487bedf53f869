"""A seeded chaos run on every transport: random producers, writers and consumers on
several tasks, with cancellations at random points (puts, writes, gets, materialize),
exceptions inside ``async for``, ``break``, lease expiries, sync and async filters, drops,
seals and version bumps. It checks the promises of docs/reliability.md:

* every sample put is delivered to every task that asks for it, or accounted as dropped;
* no sample goes twice to a consumer that acknowledged it normally;
* the controller and the storage units agree on every field of every row;
* nothing is left after the drain (zero rows and bytes, nothing leaked, no lease);
* the row capacity is never exceeded;
* every wait is bounded (the run has a deadline).

CI runs a short seed set; ``STREAMRL_CHAOS_SECONDS=1800`` runs seeds until that many
seconds have passed. A failure prints its seed: ``STREAMRL_CHAOS_SEED=<seed>`` replays it
(timing differs between runs, so a replay is likely, not certain, to fail the same way).
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest
import torch

from streamrl.errors import (EndOfStream, LeaseExpired, QueueClosed, RowsDropped)

SOAK = float(os.environ.get("STREAMRL_CHAOS_SECONDS", "0"))
SEED = os.environ.get("STREAMRL_CHAOS_SEED")

pytestmark = pytest.mark.timeout(max(300, int(SOAK * 1.5)))

TASKS = {"ref": ["sid", "x"], "train": ["sid", "x", "reward"]}
CAPACITY = 48
LEASE = 1.0  # short, so that held leases expire during the run


class Ledger:
    """What the run did, as the clients saw it."""

    def __init__(self):
        self.put: set[int] = set()  # samples whose put returned
        self.dropped: set[int] = set()  # samples a client dropped
        self.acked: dict[str, list[int]] = {t: [] for t in TASKS}  # normal acks
        self.max_rows = 0
        self.errors: list[str] = []


async def _maybe_cancel(rng: random.Random, coro, p: float):
    """Run ``coro``; with probability ``p`` cancel it at a random point. Returns
    (completed, result)."""
    task = asyncio.ensure_future(coro)
    if rng.random() < p:
        await asyncio.sleep(rng.choice([0, 0, 0.0002, 0.001, 0.003]))
        task.cancel()
    try:
        return True, await task
    except asyncio.CancelledError:
        if task.cancelled():
            return False, None
        raise


async def _producer(q, rng, ledger: Ledger, sids: list[int], version: list[int]):
    for sid in sids:
        data = {"sid": torch.tensor([sid]), "x": torch.full((1, 16), float(sid))}
        while True:  # retry until the put lands (a cancelled put leaves nothing behind)
            done, rows = await _maybe_cancel(
                rng, q.put(data, partition="p", version=version[0], timeout=30), 0.25)
            if done:
                break
        ledger.put.add(sid)
        if rng.random() < 0.04:  # the producer changes its mind
            await rows.drop()
            ledger.dropped.add(sid)
            continue
        reward = {"reward": torch.tensor([float(sid % 5)])}
        while True:  # the judge's write, with cancellations and retries
            try:
                done, _ = await _maybe_cancel(rng, q.put(reward, rows=rows), 0.25)
            except RowsDropped:  # a filter or staleness dropped the row meanwhile
                break
            if done:
                break
        if rng.random() < 0.3:
            await asyncio.sleep(rng.random() * 0.003)


async def _consumer(q, rng, ledger: Ledger, task: str, stop: asyncio.Event):
    fields = TASKS[task]
    while True:
        ended = True  # the stream ran out (sealed and drained), unless we left it
        pending: list[int] = []  # samples the stream acks when the block exits
        pending_rows: list[int] = []
        try:
            behaviour = rng.random()
            async with q.stream(task, fields, rng.choice([1, 3, 4]), partition="p",
                                timeout=30) as batches:
                async for mb in batches:
                    r = rng.random()
                    if r < 0.06:
                        raise _Boom()  # an exception in the body: the batch is released
                    if r < 0.14:  # cancelled while materializing: released
                        done, _ = await _maybe_cancel(rng, mb.materialize(), 1.0)
                        if not done:
                            await mb.release()
                            continue
                    if r < 0.17:  # holds the lease past its timeout: it expires
                        await asyncio.sleep(LEASE * 1.6)
                        try:
                            await mb.ack()
                        except LeaseExpired:
                            pass
                        else:
                            ledger.errors.append(f"{task}: ack of an expired lease succeeded")
                        continue
                    try:
                        td = await mb.materialize()
                    except RowsDropped:  # a drop, filter or undone write took rows of it
                        try:
                            await mb.ack()
                        except LeaseExpired:
                            pass
                        continue
                    sids = td["sid"].tolist()
                    if not torch.equal(td["x"][:, 0], td["sid"].float()):
                        ledger.errors.append(f"{task}: wrong data for samples {sids}")
                    if task == "train" and not torch.equal(td["reward"], td["sid"].float() % 5):
                        ledger.errors.append(f"{task}: wrong reward for samples {sids}")
                    if r < 0.22:  # leave the block without an ack: the exit acks it
                        pending, pending_rows = sids, mb.rows
                        ended = False
                        break
                    try:
                        await mb.ack()
                    except LeaseExpired as e:  # expired, or some rows were taken back
                        if e.rows is not None:  # the others were acknowledged
                            back = set(e.rows)
                            ledger.acked[task].extend(
                                s for s, r in zip(sids, mb.rows) if r not in back)
                        continue
                    ledger.acked[task].extend(sids)
                    if behaviour < 0.2:
                        ended = False
                        break  # after an ack: a new stream
            ledger.acked[task].extend(pending)
        except _Boom:
            continue
        except LeaseExpired as e:  # the exit's ack came too late, or rows were taken back
            if e.rows is not None and pending_rows:
                back = set(e.rows)
                ledger.acked[task].extend(s for s, r in zip(pending, pending_rows)
                                          if r not in back)
            continue
        except (EndOfStream, QueueClosed):
            return
        if ended or stop.is_set():
            return


class _Boom(Exception):
    pass


async def _watch(q, ledger: Ledger, stop: asyncio.Event):
    while not stop.is_set():
        st = await q.stats()
        ledger.max_rows = max(ledger.max_rows, st.rows)
        await asyncio.sleep(0.05)


async def _keep_odd(td):  # an async filter
    await asyncio.sleep(0.001)
    return (td["sid"] % 13) != 0


def _no_sevens(td):  # a sync filter
    return (td["sid"] % 7) != 0


async def run_chaos(make_queue, seed: int, n_samples: int = 160) -> None:
    rng = random.Random(seed)
    q = make_queue(capacity=CAPACITY, num_shards=3, lease_timeout=LEASE,
                   consumers=list(TASKS), max_staleness=None)
    await q.add_filter(_keep_odd, fields=["sid", "x"], name="keep_odd")
    await q.add_filter(_no_sevens, fields=["sid", "reward"], name="no_sevens")
    ledger = Ledger()
    version = [0]
    stop = asyncio.Event()
    sids = list(range(n_samples))
    rng.shuffle(sids)
    shares = [sids[i::3] for i in range(3)]
    watcher = asyncio.ensure_future(_watch(q, ledger, stop))
    consumers = [asyncio.ensure_future(_consumer(q, random.Random(rng.random()), ledger, t, stop))
                 for t in TASKS for _ in range(2)]

    async def produce():
        await asyncio.gather(*[_producer(q, random.Random(rng.random()), ledger, share, version)
                               for share in shares])
        await q.seal("p")

    async def trainer():
        while not stop.is_set():
            await asyncio.sleep(0.2)
            version[0] += 1
            await q.set_version(version[0])

    bumper = asyncio.ensure_future(trainer())
    deadline = 240 if q.transport == "embedded" else 600
    try:
        await asyncio.wait_for(produce(), deadline)
        await asyncio.wait_for(asyncio.gather(*consumers), deadline)
    finally:
        stop.set()
        for t in (watcher, bumper, *consumers):
            t.cancel()
        await asyncio.gather(watcher, bumper, *consumers, return_exceptions=True)

    assert not ledger.errors, ledger.errors
    for task, acked in ledger.acked.items():
        dup = {s for s in acked if acked.count(s) > 1}
        assert not dup, f"{task}: samples acked twice {sorted(dup)[:10]}"
    st = await q.stats()
    # puts that landed and were then cancelled were taken back (dropped as "cancelled");
    # a put cancelled after a filter rejected its rows had nothing left to take back, and
    # its retry was put (and judged) again: such extra rows can only have been filtered
    landed = st.put - st.dropped_by.get("cancelled", 0)
    assert 0 <= landed - len(ledger.put) <= st.filtered, (st.put, st.dropped_by, len(ledger.put))
    for task in TASKS:
        missing = ledger.put - set(ledger.acked[task]) - ledger.dropped
        # both filters read "sid", which both tasks ask for: both gate both tasks
        expected_filtered = {s for s in missing if s % 13 == 0 or s % 7 == 0}
        unexplained = missing - expected_filtered
        assert not unexplained, f"{task}: samples neither delivered nor dropped {sorted(unexplained)[:10]}"
    assert st.filtered == sum(st.filtered_by.values())
    assert ledger.max_rows <= CAPACITY
    assert st.rows == 0 and st.bytes == 0 and st.leases == 0, st
    assert await q.leaked() == 0
    assert await q.audit() == []


def _seeds(transport: str) -> list[int]:
    if SEED is not None:
        return [int(SEED)]
    return [11, 12] if transport == "embedded" else [21]


@pytest.mark.slow
async def test_chaos(make_queue, transport):
    started = time.monotonic()
    seeds = _seeds(transport)
    i = 0
    while True:
        seed = seeds[i] if i < len(seeds) else random.randrange(1 << 30)
        try:
            await run_chaos(make_queue, seed)
        except BaseException as e:
            raise AssertionError(f"chaos seed {seed} on {transport} failed "
                                 f"(replay: STREAMRL_CHAOS_SEED={seed}): {e!r}") from e
        i += 1
        if i >= len(seeds) and time.monotonic() - started >= SOAK:
            break
