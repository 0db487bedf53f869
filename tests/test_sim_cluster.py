"""A simulated 4-node Ray cluster (tests/sim_cluster.py, in a process of its own: it
cannot share this session's Ray): env workers on every node put rollouts, a trainer on
the head node consumes them all. The rows' bytes go from each worker to the storage unit
on its own node and from there to the trainer; the controller reads metadata only.

The cluster takes about two minutes on 2 cores (four raylets start), so it runs only
with STREAMRL_SIM_CLUSTER=1; the placement choice itself is also checked without one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent


async def test_a_small_put_goes_to_a_unit_on_the_producers_node(monkeypatch):
    """The data-plane client's choice, without a cluster: the units on this process's
    node when there are any (each asked for its node once), else every unit."""
    from streamrl.transport.ray import RayDataPlane

    nodes = {0: "B", 1: "A", 2: "B", 3: "A"}
    asked: list[int] = []

    async def call(self, shard, method, *args, rows=()):
        assert method == "shm_info"
        asked.append(shard)
        return nodes[shard], 1

    monkeypatch.setattr(RayDataPlane, "_call", call)
    dp = RayDataPlane([None] * 4)
    dp._node = "A"
    assert await dp._on_this_node([0, 1, 2, 3]) == [1, 3]
    assert await dp._on_this_node([0, 2, 3]) == [3]  # unit 1 is gone or unreachable
    assert sorted(asked) == [0, 1, 2, 3]  # once per unit
    dp._node = "C"
    assert await dp._on_this_node([0, 1, 2, 3]) == []  # none here: put_rows takes any


def test_the_units_a_small_put_may_go_to_follow_the_channels_and_the_unreachable():
    """Worked out once and kept (every small put asks), but again as soon as the socket
    channels change or a unit turns out unreachable; the node's pool with them."""
    from streamrl.transport.ray import RayDataPlane

    dp = RayDataPlane([None] * 3)
    assert dp._live() == []  # no channel: small puts go the usual way
    dp.rpcs = [object(), None, object()]  # type: ignore[list-item]
    assert dp._live() == [0, 2]
    dp._pool_units = [2]
    assert dp._live() == [0, 2] and dp._pool_units == [2]  # (kept)
    dp._unreachable.add(2)
    assert dp._live() == [0] and dp._pool_units is None


@pytest.mark.skipif(os.environ.get("STREAMRL_SIM_CLUSTER") != "1",
                    reason="starts a 4-node Ray cluster (over a minute on 2 cores): set "
                           "STREAMRL_SIM_CLUSTER=1")
@pytest.mark.timeout(600)
def test_four_nodes_each_worker_fills_its_own_nodes_unit_and_no_bytes_cross_the_controller():
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_ADDRESS": "",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(HERE / "sim_cluster.py")], check=False,
                       capture_output=True, text=True, env=env, timeout=560)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert p.returncode == 0 and lines, (p.stderr or p.stdout)[-3000:]
    r = json.loads(lines[-1])

    # one storage unit on each node
    assert sorted(r["unit_nodes"]) == [0, 1, 2, 3]
    # every worker's rows are in the unit of its own node, and only there
    assert sorted(w["node"] for w in r["workers"]) == [0, 1, 2, 3]
    for w in r["workers"]:
        assert w["shards"] == [r["unit_nodes"].index(w["node"])], w
    # the trainer got every row, intact, and nothing is left
    assert r["consumed"] == {"rows": r["rows"], "bad": 0}
    assert r["left_rows"] == 0
    # bytes: each unit read at least its node's share of the payload (the puts); the
    # controller read metadata only: under a tenth of the payload, a few KiB a row
    # (rows are 60 KiB; its reads include Ray's own traffic)
    share = r["payload_bytes"] // 4
    assert all(b >= share for b in r["unit_read_bytes"]), r
    assert r["controller_read_bytes"] < r["payload_bytes"] / 10, r
    assert r["controller_read_bytes"] / r["rows"] < 4096, r
