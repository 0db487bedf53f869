"""The RDT transport on gloo (CPU): held tensor fields moved between actors of one group.

One group of actors serves the module (a process joins one RDT group for its life, and
making one costs seconds here): four async producers, an async consumer, a synchronous
consumer (the blocking twin) and a producer that is killed. The test of the naive design
(transfers bypassing the serialising thread) makes its own group: it may kill its actors.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import os
import time

import pytest
import torch

import streamrl
from streamrl.errors import RowsLost

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

W = 4096  # same-size rows: 16 KiB of float32
PUTS = int(os.environ.get("STREAMRL_RDT_PUTS", "8"))  # concurrent puts per producer, stress
CHURN = int(os.environ.get("STREAMRL_RDT_CHURN", "24"))  # puts per producer, leak check
BURST = int(os.environ.get("STREAMRL_RDT_BURST", "16"))  # concurrent pulls, bypass test


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Producer:
    """Async producer: ``puts`` concurrent puts, each of rows with a same-size field ``x``,
    a mixed-size (ragged) field ``v`` and ids; returns each row's digests."""

    async def run(self, q, who: int, puts: int, part: str, ragged: bool = True,
                  rows_per_put: int = 3, width: int = W):
        gen = torch.Generator().manual_seed(who)
        sums: dict[int, tuple] = {}

        async def one(i):
            n = rows_per_put
            uid = torch.arange(n) + (who * 1000 + i * 10)
            x = torch.randn(n, width, generator=gen)
            cols = {"x": x, "uid": uid}
            if ragged:
                # mostly small rows (packed into one message), a few of over 1 MiB
                # (messages of their own)
                v = [torch.randn(300_000 if (i % 4 == 0 and r == 0) else
                                 int(torch.randint(1, 20000, (1,), generator=gen)),
                                 generator=gen)
                     for r in range(n)]
                cols["v"] = v
            for r in range(n):
                sums[int(uid[r])] = (digest(x[r]), digest(cols["v"][r]) if ragged else None)
            await q.put(cols, partition=part)

        await asyncio.gather(*[one(i) for i in range(puts)])
        return sums

    async def churn(self, q, rounds: int, part: str, seed: int):
        """Puts of 2 rows (64 KiB field ``x``), every other one cancelled at a random
        point; the digests of the rows whose put completed."""
        import random

        rnd = random.Random(seed)
        sums = {}
        for i in range(rounds):
            x = torch.randn(2, 1 << 14)
            uid = torch.tensor([seed * 10000 + 2 * i, seed * 10000 + 2 * i + 1])
            task = asyncio.ensure_future(q.put({"x": x, "uid": uid}, partition=part))
            if i % 2:
                await asyncio.sleep(rnd.random() * 0.01)
                task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                continue
            sums.update({int(u): digest(r) for u, r in zip(uid, x)})
        return sums

    def hold(self, n: int, nbytes: int, seed: int):
        """Hold ``n`` tensors of ``nbytes`` (distinct contents) in this process's holder;
        their references and digests."""
        from streamrl.transport.rdt import runtime

        gen = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n):
            t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
            ref, _ = runtime().hold(t)
            out.append((ref, digest(t)))
        return out

    def free(self, refs):
        from streamrl.transport.rdt import runtime

        runtime().free([r.key for r in refs])

    def held(self):
        from streamrl.transport.rdt import holder_stats

        return holder_stats()

    def pid(self):
        return os.getpid()


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Consumer:
    """Async consumer: ``workers`` concurrent readers, each materializing batches."""

    async def run(self, q, part: str, workers: int, batch_size: int, fields, timeout=60):
        got: dict[int, tuple] = {}
        errors: list[str] = []

        async def worker():
            while True:
                try:
                    mb = await q.get("t", fields, batch_size=batch_size, partition=part,
                                     timeout=timeout)
                except (streamrl.errors.EndOfStream, streamrl.errors.QueueClosed):
                    return
                except streamrl.errors.StreamRLError as e:
                    errors.append(repr(e))
                    return
                try:
                    td = await mb.materialize()
                except Exception as e:  # noqa: BLE001 - reported
                    errors.append(f"{type(e).__name__}: {e}")
                    await mb.drop()
                    continue
                vs = td["v"].unbind() if "v" in fields else [None] * len(td)
                for uid, x, v in zip(td["uid"].tolist(), td["x"], vs):
                    got[uid] = (digest(x), digest(v) if v is not None else None)
                await mb.ack()

        await asyncio.gather(*[worker() for _ in range(workers)])
        return got, errors


    async def read_cancelling(self, q, part: str, seed: int):
        """Read every row in batches of 4; each materialize is first cancelled at a random
        point, then done again. The digests read."""
        import random

        rnd = random.Random(seed)
        got = {}
        while True:
            try:
                mb = await q.get("t", ["x", "uid"], batch_size=4, partition=part, timeout=30)
            except streamrl.errors.EndOfStream:
                return got
            task = asyncio.ensure_future(mb.materialize())
            await asyncio.sleep(rnd.random() * 0.01)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            td = await mb.materialize()
            got.update({u: digest(x) for u, x in zip(td["uid"].tolist(), td["x"])})
            await mb.ack()

    async def burst(self, held, nbytes: int, bypass: bool):
        """Pull every held tensor at once (one concurrent pull each); their digests."""
        rt_mod = importlib.import_module("streamrl.transport.rdt.runtime")
        from streamrl.transport.rpc import RpcClient

        rt_mod._BYPASS_TRANSFER_THREAD = bypass
        rt = rt_mod.runtime()
        client = RpcClient(held[0][0].endpoint)
        await client.connection()
        try:
            bufs = await asyncio.wait_for(asyncio.gather(*[
                rt.pull(ref.rank, [(ref.key, 0, nbytes)], client if bypass else None)
                for ref, _ in held]), 30)
        except Exception as e:  # noqa: BLE001 - reported
            return f"{type(e).__name__}: {e}"
        finally:
            rt_mod._BYPASS_TRANSFER_THREAD = False
        return [digest(b[0]) for b in bufs]


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class SyncConsumer:
    """A synchronous actor reading through the blocking twin."""

    def run(self, q, part: str):
        from streamrl.sync import StreamQueue as SyncQueue

        sq = SyncQueue.wrap(q)
        got = {}
        try:
            for mb in sq.stream("s", ["x", "uid"], batch_size=4, partition=part, timeout=60):
                td = mb.materialize()
                for uid, x in zip(td["uid"].tolist(), td["x"]):
                    got[uid] = digest(x)
        finally:
            sq.shutdown()
        return got


def test_reads_plan_few_messages_and_no_copies_of_big_ranges():
    """One read of a holder: touching ranges of a tensor merge; ranges of 1 MiB or more
    are messages of their own, the small ones share one packed message."""
    from streamrl.transport.rdt.data import coalesce
    from streamrl.transport.rdt.runtime import ALIGN, BIG, layout, plan

    merged, where = coalesce([(1, 100, 50), (1, 0, 100), (2, 0, 10), (1, 200, 5)])
    assert merged == [(1, 0, 150), (1, 200, 5), (2, 0, 10)]
    assert where == [(0, 100), (0, 0), (2, 0), (1, 0)]
    sizes = [10, BIG, 3, 2 * BIG, 0]
    assert plan(sizes) == [[1], [3], [0, 2, 4]]
    offs, total = layout([10, 3, 0])
    assert offs == [0, ALIGN, 2 * ALIGN] and total == 2 * ALIGN
    assert layout([BIG + 1]) == ([0], BIG + 1)  # alone: not padded, not copied


def test_rdt_options_are_checked_up_front():
    from streamrl.errors import InvalidArgument
    from streamrl.transport.rdt.transport import rdt_options

    spec, rest = rdt_options({"rdt_fields": ["logits"], "namespace": "n"}, all_fields=False)
    assert spec.fields == ("logits",) and not spec.hold_anywhere and rest == {"namespace": "n"}
    assert rdt_options({}, all_fields=True)[0].fields is None
    for bad in ({"rdt_fields": "logits"}, {"rdt_fields": [1]}, {"rdt_hold_anywhere": 1},
                {"rdt_fields": ["x"], "direct_calls": False}):
        with pytest.raises(InvalidArgument):
            rdt_options(bad, all_fields=False)


@pytest.fixture(scope="module")
def group(ray_session):
    """One RDT group: 4 producers, an async consumer, a sync consumer, a victim producer."""
    from streamrl.transport.rdt import create_group

    producers = [Producer.remote() for _ in range(4)]
    consumer, sync_consumer, victim = Consumer.remote(), SyncConsumer.remote(), Producer.remote()
    actors = [*producers, consumer, sync_consumer, victim]
    g = create_group(actors, "gloo")
    yield {"group": g, "producers": producers, "consumer": consumer, "sync": sync_consumer,
           "victim": victim}
    g.destroy()
    for a in actors:
        ray.kill(a)


async def wait_for(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        v = await pred()
        if v or time.monotonic() > deadline:
            return v
        await asyncio.sleep(0.2)


async def test_concurrent_puts_and_reads_between_async_actors_arrive_intact(group):
    """4 async producers x 8 concurrent puts (``STREAMRL_RDT_PUTS`` for more) (same-size and mixed-size tensors), an async
    consumer with 8 concurrent readers: every tensor matches the digest taken where it
    was made; every byte moved by RDT; the holders hold nothing once the rows are gone."""
    async with streamrl.StreamQueue(transport="rdt", num_shards=2, consumers=["t"]) as q:
        sums = {}
        for s in await asyncio.gather(*[p.run.remote(q, i + 1, PUTS, "p")
                                        for i, p in enumerate(group["producers"])]):
            sums.update(s)
        assert len(sums) == 4 * PUTS * 3
        await q.seal("p")
        got, errors = await group["consumer"].run.remote(q, "p", 8, 4, ["x", "v", "uid"])
        assert errors == []
        assert got == sums  # every row, every tensor intact
        st = await wait_for(lambda: _settled(q))
        assert st.rows == 0 and st.bytes == 0
        assert st.bytes_by_path.get("rdt", 0) > 0
        assert st.bytes_by_path.get("shm", 0) == 0  # no tensor bytes through the units
        held = await wait_for(lambda: _all_free(group["producers"]))
        assert held, [ray.get(p.held.remote()) for p in group["producers"]]


async def _settled(q):
    st = await q.stats()
    return st if st.rows == 0 and st.bytes_by_path.get("rdt") else None


async def _all_free(producers):
    held = await asyncio.gather(*[p.held.remote() for p in producers])
    return all(h == {"tensors": 0, "bytes": 0} for h in held)


async def test_the_blocking_twin_reads_held_fields_in_a_sync_actor(group):
    async with streamrl.StreamQueue(transport="rdt", num_shards=2, consumers=["s"]) as q:
        sums = await group["producers"][0].run.remote(q, 7, 4, "p", ragged=False)
        await q.seal("p")
        got = await group["sync"].run.remote(q, "p")
        assert got == {u: s[0] for u, s in sums.items()}
        assert await wait_for(lambda: _all_free(group["producers"][:1]))


async def test_readers_outside_the_group_fall_back_to_the_holders_socket(group):
    """The driver is in no group: it reads held fields over the holder's socket."""
    async with streamrl.StreamQueue(transport="rdt", num_shards=2) as q:
        sums = await group["producers"][1].run.remote(q, 9, 2, "p", ragged=False)
        await q.seal("p")
        got = {}
        async for mb in q.stream("d", ["x", "uid"], batch_size=6, partition="p"):
            td = await mb.materialize()
            got.update({u: digest(x) for u, x in zip(td["uid"].tolist(), td["x"])})
        assert got == {u: s[0] for u, s in sums.items()}
        st = await wait_for(lambda: _has(q, "socket"))
        assert st.bytes_by_path["socket"] >= 6 * W * 4
        await q.clear("p")
        assert await wait_for(lambda: _all_free(group["producers"][1:2]))


async def _has(q, path, n=None):
    st = await q.stats()
    got = st.bytes_by_path.get(path)
    return st if got and (n is None or got == n) else None


async def test_rdt_fields_on_the_ray_transport_hold_only_those_fields(group):
    async with streamrl.StreamQueue(transport="ray", rdt_fields=["x"], num_shards=2,
                                    consumers=["t"]) as q:
        assert q.transport == "rdt"
        sums = await group["producers"][2].run.remote(q, 11, 4, "p", ragged=True)
        await q.seal("p")
        got, errors = await group["consumer"].run.remote(q, "p", 2, 4, ["x", "v", "uid"])
        assert errors == [] and got == sums
        # x by RDT (4 puts x 3 rows x 16 KiB), v and uid through the storage units
        st = await wait_for(lambda: _has(q, "rdt", 12 * W * 4))
        assert st.bytes_by_path["rdt"] == 12 * W * 4
        assert st.bytes_by_path.get("shm", 0) + st.bytes_by_path.get("inline", 0) > 0


async def test_a_holder_that_dies_loses_its_rows_by_name(group):
    """Rows whose fields a dead producer held: reads raise RowsLost naming those rows
    and the holder, outside the group (socket) and in it (the coordinator knows); rows
    held by others read fine."""
    async with streamrl.StreamQueue(transport="rdt", num_shards=2) as q:
        await group["victim"].run.remote(q, 21, 4, "dead", ragged=False)
        alive = await group["producers"][3].run.remote(q, 22, 2, "alive", ragged=False)
        pid = await group["victim"].pid.remote()
        ray.kill(group["victim"])
        await asyncio.sleep(1.0)
        mb = await q.get("d", ["x", "uid"], batch_size=6, partition="dead", timeout=10)
        with pytest.raises(RowsLost) as e:  # the driver: over the socket
            await mb.materialize()
        assert sorted(e.value.rows) == sorted(mb.rows) and e.value.holder.endswith(f":{pid}")
        await mb.drop()
        await q.seal("dead")
        got, errors = await group["consumer"].run.remote(q, "dead", 1, 6, ["x", "uid"],
                                                         timeout=10)
        assert got == {} and len(errors) == 1 and "RowsLost" in errors[0], errors
        await q.seal("alive")
        got, errors = await group["consumer"].run.remote(q, "alive", 2, 3, ["x", "uid"])
        assert errors == [] and got == alive


async def test_cancelled_puts_and_reads_leave_holders_empty(group):
    """Holder memory leak check: puts cancelled at random points, reads cancelled at
    random points (then done again, intact); once every row is consumed, every holder
    holds nothing and the queue holds no rows and no bytes."""
    async with streamrl.StreamQueue(transport="rdt", num_shards=2, consumers=["t"]) as q:
        sums = {}
        for s in await asyncio.gather(*[p.churn.remote(q, CHURN, "c", i + 1)
                                        for i, p in enumerate(group["producers"][:2])]):
            sums.update(s)
        await q.seal("c")
        got = await group["consumer"].read_cancelling.remote(q, "c", 5)
        assert got == sums
        assert await wait_for(lambda: _all_free(group["producers"][:2]))
        st = await q.stats()
        assert st.rows == 0 and st.bytes == 0


def test_transfers_that_bypass_the_serialising_thread_corrupt_data(ray_session):
    """The transfer thread is what keeps concurrent transfers apart. An async consumer
    pulls 16 held tensors of 1 MiB from one producer at once (16 concurrent pulls):
    through the transfer thread every tensor arrives intact; in the naive design (each
    send and receive on a thread of its own as soon as it is asked for, the switch
    ``_BYPASS_TRANSFER_THREAD``) tensors arrive swapped, or the transfers fail or hang."""
    from streamrl.transport.rdt import create_group

    producer, consumer = Producer.remote(), Consumer.remote()
    g = create_group([producer, consumer], "gloo")
    try:
        n, nbytes = BURST, 1 << 20
        held = ray.get(producer.hold.remote(n, nbytes, 1))
        want = [d for _, d in held]
        assert ray.get(consumer.burst.remote(held, nbytes, False)) == want
        try:
            naive = ray.get(consumer.burst.remote(held, nbytes, True), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            naive = f"{type(e).__name__}"
        if isinstance(naive, list):
            bad = sum(a != b for a, b in zip(naive, want))
            naive = f"{bad} of {n} tensors wrong"
        print("naive design:", naive)
        assert naive != f"0 of {n} tensors wrong", naive
    finally:
        g.destroy()
        for a in (producer, consumer):
            ray.kill(a)
