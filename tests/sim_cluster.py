"""A simulated 4-node Ray cluster on this machine (``ray.cluster_utils.Cluster``, every
node on 127.0.0.1), run by ``tests/test_sim_cluster.py`` in a process of its own (it
cannot share the test session's Ray).

One storage unit is pinned to each node and one env-worker actor runs on each node; each
worker puts ``ROLLOUTS`` one-row rollouts (int64 tokens[TOKENS] + reward + its node's
index), and a trainer actor on the head node streams and materializes them all, checking
every value. Prints one JSON line with what the test checks:

* ``unit_nodes``: the node index of each storage unit;
* ``workers``: per worker, its node index and the storage units its rows went to;
* ``controller_read_bytes`` / ``unit_read_bytes``: bytes each process read from its
  sockets and files (``rchar`` of ``/proc/<pid>/io``) while the rows were put and
  consumed: the rows' bytes go to the units, only metadata to the controller;
* ``payload_bytes``, ``rows``, ``seconds``.

Run alone: python tests/sim_cluster.py
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

NODES = 4
ROLLOUTS = 64  # per worker
TOKENS = 7680  # int64: 60 KiB a row, still a small put (below the arena's 64 KiB)
LO = "127.0.0.1"


def _rchar(self=None) -> int:
    """Bytes this process has read (``rchar``: sockets, pipes and files)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def main() -> dict:
    import ray
    from ray.cluster_utils import Cluster

    import streamrl

    def res(i: int) -> dict:  # pin to node i
        return {f"streamrl_sim_node{i}": 0.001}

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"streamrl_sim_node0": 1}, "node_ip_address": LO,
        "include_dashboard": False, "object_store_memory": 256 << 20})
    try:
        for i in range(1, NODES):
            cluster.add_node(num_cpus=0, resources={f"streamrl_sim_node{i}": 1},
                             node_ip_address=LO, object_store_memory=256 << 20)
        ray.init(address=cluster.address, log_to_driver=False, _node_ip_address=LO)
        cluster.wait_for_nodes()

        @ray.remote(num_cpus=0)
        class EnvWorker:
            async def run(self, q, index: int, n: int) -> dict:
                import torch

                shards = []
                for j in range(n):
                    v = index * 1_000_000 + j
                    rows = await q.put({"tokens": torch.full((1, TOKENS), v, dtype=torch.int64),
                                        "reward": torch.tensor([float(v)]),
                                        "node": torch.tensor([index])}, partition="p")
                    shards += rows.shards
                return {"node_id": ray.get_runtime_context().get_node_id(), "shards": shards}

        @ray.remote(num_cpus=0)
        class Trainer:
            async def run(self, q) -> dict:
                import torch

                got, bad = 0, 0
                async for mb in q.stream("train", ["tokens", "reward", "node"], 16,
                                         partition="p", timeout=300):
                    td = await mb.materialize()
                    v = td["reward"].to(torch.int64)
                    bad += int((td["tokens"] != v[:, None]).any(1).sum())
                    bad += int((v // 1_000_000 != td["node"]).sum())
                    got += len(mb)
                return {"rows": got, "bad": bad}

        return asyncio.run(_drive(ray, streamrl, EnvWorker, Trainer, res))
    finally:
        ray.shutdown()
        cluster.shutdown()


async def _drive(ray, streamrl, EnvWorker, Trainer, res) -> dict:
    q = streamrl.StreamQueue(transport="ray", num_shards=NODES, capacity=4096,
                             consumers=["train"],
                             unit_options=[{"resources": res(i)} for i in range(NODES)],
                             controller_options={"resources": res(0)})
    async with q:
        t = q._transport
        node_of = {n["NodeID"]: i for n in ray.nodes() for i in range(NODES)
                   if n["Resources"].get(f"streamrl_sim_node{i}")}
        unit_nodes = [node_of[n] for n in t.node_ids()]
        workers = [EnvWorker.options(resources=res(i)).remote() for i in range(NODES)]
        trainer = Trainer.options(resources=res(0)).remote()
        procs = [t._controller, *t._units]
        before = await asyncio.gather(*[a.__ray_call__.remote(_rchar) for a in procs])
        t0 = time.perf_counter()
        consumed = trainer.run.remote(q)
        puts = await asyncio.gather(*[w.run.remote(q, i, ROLLOUTS) for i, w in enumerate(workers)])
        await q.seal("p")
        got = await consumed
        dt = time.perf_counter() - t0
        after = await asyncio.gather(*[a.__ray_call__.remote(_rchar) for a in procs])
        read = [b - a for a, b in zip(before, after)]
        left = (await q.stats()).rows
    return {
        "unit_nodes": unit_nodes,
        "workers": [{"node": node_of[p["node_id"]], "shards": sorted(set(p["shards"])),
                     "rows": len(p["shards"])} for p in puts],
        "consumed": got, "left_rows": left,
        "controller_read_bytes": read[0], "unit_read_bytes": read[1:],
        "payload_bytes": NODES * ROLLOUTS * (TOKENS * 8 + 4 + 8),
        "rows": NODES * ROLLOUTS, "seconds": dt,
    }


if __name__ == "__main__":
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    t0 = time.time()
    out = main()
    out["wall_s"] = time.time() - t0
    print(json.dumps(out))
    sys.stdout.flush()
