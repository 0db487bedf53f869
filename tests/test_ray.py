"""Ray-only behaviour: actors as producers and consumers, handles, named queues, several
nodes, and failures (a storage unit or the controller dying, a consumer dying)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import anyio
import pytest
import torch

import streamrl
from streamrl.errors import RowsLost, TransportError

ray = pytest.importorskip("ray")
# the shared make_queue fixture, on the Ray transport only
pytestmark = [pytest.mark.ray, pytest.mark.timeout(120),
              pytest.mark.parametrize("transport", ["ray"], indirect=True)]


@pytest.fixture
def rq(make_queue):
    return make_queue


@ray.remote(num_cpus=0)
class AsyncProducer:
    async def run(self, q, n, start):
        for i in range(start, start + n, 8):
            await q.put({"idx": torch.arange(i, i + 8),
                         "x": torch.arange(i, i + 8, dtype=torch.float64).unsqueeze(1) * torch.ones(1, 1000),
                         "bf": torch.full((8, 3), i, dtype=torch.bfloat16),
                         "chat": [{"turn": j, "text": "é" * (j % 5)} for j in range(i, i + 8)]},
                        partition="p")
        return n


@ray.remote(num_cpus=0)
class SyncConsumer:
    """A plain (synchronous) actor using the blocking twin."""

    def run(self, q):
        from streamrl.sync import StreamQueue

        sq = StreamQueue.wrap(q)
        seen = []
        try:
            for mb in sq.stream("train", ["idx", "x", "bf", "chat"], 16, partition="p", timeout=60):
                td = mb.materialize()
                idx = td["idx"]
                assert torch.equal(td["x"], idx.double().unsqueeze(1) * torch.ones(1, 1000))
                assert td["bf"].dtype == torch.bfloat16
                assert [c["turn"] for c in td["chat"]] == idx.tolist()
                seen.extend(idx.tolist())
        finally:
            sq.shutdown()
        return seen


@pytest.mark.parametrize("direct_calls", [True, False], ids=["socket-calls", "ray-calls"])
async def test_actors_produce_and_consume_byte_for_byte(rq, direct_calls):
    q = rq(num_shards=3, direct_calls=direct_calls)
    assert (q._transport.control.rpc is not None) == direct_calls
    producers = [AsyncProducer.remote() for _ in range(2)]
    consumer = SyncConsumer.remote()
    got = consumer.run.remote(q)
    await producers[0].run.remote(q, 64, 0)
    await producers[1].run.remote(q, 64, 1000)
    await q.seal("p")
    seen = await got
    assert sorted(seen) == list(range(64)) + list(range(1000, 1064))
    st = await q.stats()
    assert st.tasks["train"].acked == 128 and sum(st.unit_rows) == 128


@ray.remote(num_cpus=0)
def consume_in_task(q, n):
    import asyncio

    async def main():
        out = []
        async for mb in q.stream("task", ["idx"], 4, partition="p"):
            out.extend((await mb.materialize())["idx"].tolist())
            if len(out) >= n:
                break
        return out

    return asyncio.run(main())


async def test_queue_handle_works_in_a_task_and_by_name(rq):
    q = rq(name="named-q")
    await q.put({"idx": torch.arange(8)}, partition="p")
    await q.seal("p")
    assert sorted(await consume_in_task.remote(q, 8)) == list(range(8))
    other = streamrl.StreamQueue.connect("named-q")
    st = await other.stats()
    assert st.put == 8
    await other.shutdown()  # not the owner: the queue lives on
    assert (await q.stats()).put == 8
    with pytest.raises(TransportError):
        streamrl.StreamQueue.connect("no-such-queue")


async def _kill(actor) -> None:
    """Kill an actor and wait until its process is gone: ``ray.kill`` is asynchronous,
    and the process outlives Ray's word that the actor died by a little; the socket
    channels keep talking to it until it exits."""
    pid = await actor.__ray_call__.remote(lambda self: os.getpid())
    ray.kill(actor)
    with anyio.fail_after(30):
        while os.path.exists(f"/proc/{pid}"):
            await anyio.sleep(0.02)


async def test_storage_unit_death_loses_only_its_rows(rq):
    q = rq(num_shards=2)
    a = await q.put({"idx": torch.arange(4)}, partition="p")
    b = await q.put({"idx": torch.arange(4, 8)}, partition="p")
    shards = set(a.shards) | set(b.shards)
    assert shards == {0, 1}
    victim = q._transport._units[0]
    await _kill(victim)
    mb = await q.get("t", ["idx"], 8, partition="p")
    with anyio.fail_after(30):
        with pytest.raises(RowsLost) as e:
            await mb.materialize()
    assert e.value.unit == 0 and set(e.value.rows) == {r for r, s in zip(mb.rows, mb.shards) if s == 0}
    survivors = mb[[i for i, s in enumerate(mb.shards) if s == 1]]
    td = await survivors.materialize()
    assert len(td) == 4
    with anyio.fail_after(30):
        while (await q.stats()).dropped_by.get("lost", 0) != 4:
            await anyio.sleep(0.05)
    c = await q.put({"idx": torch.arange(100, 104)}, partition="p")  # new rows avoid the dead unit
    assert set(c.shards) == {1}


async def test_controller_death_fails_fast(rq):
    q = rq()
    await q.put({"x": torch.ones(2)})
    await _kill(q._transport._controller)
    with anyio.fail_after(30):
        with pytest.raises(TransportError):
            await q.put({"x": torch.ones(2)})
        with pytest.raises(TransportError):
            await q.get("t", ["x"], 2)


@ray.remote(num_cpus=0)
class LeaseHolder:
    async def hold(self, q):
        mb = await q.get("t", ["x"], 4, partition="p")
        return mb.rows


async def test_dead_consumer_lease_returns_after_timeout(rq):
    q = rq(lease_timeout=1.0)
    await q.put({"x": torch.arange(4)}, partition="p")
    holder = LeaseHolder.remote()
    rows = await holder.hold.remote(q)
    ray.kill(holder)
    with anyio.fail_after(30):
        mb = await q.get("t", ["x"], 4, partition="p", timeout=20)
    assert sorted(mb.rows) == sorted(rows)
    assert (await q.stats()).tasks["t"].expired == 4


@ray.remote(num_cpus=0)
class Waiter:
    async def wait(self, q):
        mb = await q.get("t", ["x"], 4, partition="p")
        return mb.rows


async def test_consumer_that_dies_while_waiting_takes_no_rows(rq):
    # its take is still waiting in the controller when it dies: the closed connection
    # cancels it, so the rows put later go to the living consumer at once, not after the
    # (long) lease timeout
    q = rq(lease_timeout=600.0)
    waiter = Waiter.remote()
    call = waiter.wait.remote(q)
    ctl = q._transport._controller
    with anyio.fail_after(60):  # until its take waits in the controller
        while not await ctl.__ray_call__.remote(lambda self: len(self._inflight)):
            await anyio.sleep(0.05)
    await _kill(waiter)
    await q.put({"x": torch.arange(4)}, partition="p")
    mb = await q.get("t", ["x"], 4, partition="p", timeout=10)
    assert len(mb) == 4
    with pytest.raises(ray.exceptions.RayActorError):
        await call


MULTINODE = textwrap.dedent("""
    import asyncio, torch, ray, streamrl
    from ray.cluster_utils import Cluster

    @ray.remote(num_cpus=0, resources={"nodeC": 0.01})
    def consume(q):
        async def main():
            mb = await q.get("t", ["x", "idx"], 96, partition="p", timeout=60)
            td = await mb.materialize()
            assert torch.equal(td["x"], td["idx"].float().unsqueeze(1).repeat(1, 4096))
            return sorted(td["idx"].tolist())
        return asyncio.run(main())

    async def main():
        q = streamrl.StreamQueue(transport="ray", num_shards=3, unit_options=[
            {"resources": {"nodeA": 0.01}}, {"resources": {"nodeB": 0.01}},
            {"resources": {"nodeC": 0.01}}])
        nodes = q._transport.node_ids()
        assert len(set(nodes)) == 3, nodes
        for i in range(0, 96, 32):
            idx = torch.arange(i, i + 32)
            await q.put({"idx": idx, "x": idx.float().unsqueeze(1).repeat(1, 4096)}, partition="p")
        got = ray.get(consume.remote(q))
        assert got == list(range(96)), got
        await q.close()
        await q.shutdown()
        print("MULTINODE-OK", len(set(nodes)))

    lo = "127.0.0.1"  # keep all traffic on loopback
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"nodeA": 1}, "node_ip_address": lo,
        "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, resources={"nodeB": 1}, node_ip_address=lo)
        cluster.add_node(num_cpus=1, resources={"nodeC": 1}, node_ip_address=lo)
        ray.init(address=cluster.address, log_to_driver=False, _node_ip_address=lo)
        cluster.wait_for_nodes()
        asyncio.run(main())
    finally:
        ray.shutdown()
        cluster.shutdown()
""")


@pytest.mark.slow
def test_multinode_cluster_moves_data_between_nodes(tmp_path, transport):
    """Three Ray nodes on this machine (ray.cluster_utils): units on different nodes, a
    consumer on a third reads rows from all of them. Runs in its own process because a
    process can join only one Ray cluster."""
    script = tmp_path / "multinode.py"
    script.write_text(MULTINODE)
    # loopback only: Ray resolves 127.0.0.1 to the host's IP unless told not to
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=240, env=env)
    assert "MULTINODE-OK 3" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


@ray.remote(num_cpus=0)
class BigProducer:
    async def put(self, q, part):
        rows = await q.put({"x": torch.arange(64 * 1024, dtype=torch.float32).view(4, -1)},
                           partition=part)
        return rows.rows


async def test_ownership_unit_outlives_producer_and_producer_mode_does_not(rq):
    for ownership, survives in (("unit", True), ("producer", False)):
        q = rq(ownership=ownership)
        p = BigProducer.remote()
        await p.put.remote(q, "p")  # 256 KiB: held by reference in the object store
        ray.kill(p)
        with anyio.fail_after(30):  # wait until the producer is really gone
            while True:
                try:
                    await p.put.remote(q, "other")
                except ray.exceptions.RayActorError:
                    break
                await anyio.sleep(0.1)
        mb = await q.get("t", ["x"], 4, partition="p", timeout=30)
        with anyio.fail_after(60):
            if survives:
                td = await mb.materialize()
                assert td["x"][3, -1].item() == 64 * 1024 - 1
            else:  # Ray learns of the owner's death asynchronously: poll (fresh views)
                with pytest.raises(RowsLost):
                    while True:
                        await pickle.loads(pickle.dumps(mb)).materialize()
                        await anyio.sleep(0.2)
                st = await q.stats()
                while st.dropped_by.get("lost") != 4:
                    await anyio.sleep(0.05)
                    st = await q.stats()
    with pytest.raises(streamrl.errors.InvalidArgument):
        rq(ownership="nobody")


async def test_reads_fall_back_to_the_bytes_the_unit_kept(rq, monkeypatch):
    """When the object behind a row cannot be fetched (its owner died and no copy is
    mapped on this node), a reader gets the bytes the unit kept with
    ownership="unit", and RowsLost (rows dropped as lost) with ownership="producer"."""
    from streamrl.transport import ray as ray_transport

    async def owner_gone(self, refs):
        return None  # what _fetch answers when ray.get raises OwnerDiedError

    monkeypatch.setattr(ray_transport.RayDataPlane, "_fetch", owner_gone)
    x = torch.randn(8, 4096)  # 16 KiB rows, 128 KiB put: by reference
    for ownership in ("unit", "producer"):
        q = rq(ownership=ownership)
        await q.put({"x": x, "i": torch.arange(8)}, partition="p")
        mb = await q.get("t", ["x", "i"], 8, partition="p", timeout=30)
        view = pickle.loads(pickle.dumps(mb))  # nothing cached: reads the queue
        if ownership == "unit":
            td = await view.materialize()
            assert torch.equal(td["x"], x) and td["i"].tolist() == list(range(8))
            continue
        with pytest.raises(RowsLost) as e:
            await view.materialize()
        assert sorted(e.value.rows) == sorted(mb.rows)
        with anyio.fail_after(30):
            while (await q.stats()).dropped_by.get("lost") != 8:
                await anyio.sleep(0.05)


async def test_controller_actor_runs_on_uvloop(rq):
    pytest.importorskip("uvloop")
    q = rq()
    assert (await q._transport._controller.event_loop.remote()).startswith("uvloop")


async def test_put_cancelled_while_its_data_is_being_copied_admits_nothing(rq, monkeypatch):
    """A big put copies its data while its rows are being admitted; cancelled after the
    admission, it takes the admission back."""
    import time

    q = rq()
    await q.put({"x": torch.zeros(4, 16384)}, partition="p")  # room afterwards: next copies early
    data = q._transport._data
    orig = data.prepare

    def slow_prepare(cols):
        time.sleep(1.0)
        return orig(cols)

    monkeypatch.setattr(data, "prepare", slow_prepare)
    with anyio.move_on_after(0.5):
        await q.put({"x": torch.zeros(4, 16384)}, partition="p")
    st = await q.stats()
    assert st.rows == 4 and st.bytes_in_flight == 0 and st.put == 4
