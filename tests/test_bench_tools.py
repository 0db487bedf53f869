"""The benchmark tools measure what they say they measure."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.asyncio
async def test_ab_inproc_runs_the_other_tree_as_it_runs_this_one():
    """benchmarks/ab_inproc.py imports another tree's package under another name next
    to this one: its embedded queue must combine one-row puts as this tree's does (a
    lookup of the package's own modules by the name "streamrl." once made the copy's
    queue find no stage, so the A/B timed the old tree on the slow path)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import ab_inproc

        old = ab_inproc.load_old(ROOT)
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    import streamrl

    assert old is not streamrl and old.__name__ == ab_inproc.OLD
    for mod in (streamrl, old):
        async with mod.StreamQueue(capacity=8) as q:
            assert q._stage is not None, mod.__name__
            assert type(q._stage).__module__.startswith(mod.__name__ + ".")


def test_rpc_floor_sends_what_a_producers_one_row_put_sends():
    """benchmarks/rpc_floor.py's ``rpc_put`` case times the call a producer makes for a
    one-row put: its arguments must still be the ones the storage unit's ``put_rows``
    takes (a changed signature would leave the case timing another call), and its
    answer the wire form of an admitted put."""
    import inspect

    from streamrl.messages import PutAnswer, PutStatus
    from streamrl.transport.ray.admit import UnitAdmission
    from streamrl.wire import WireTensor

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import rpc_floor
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    args = rpc_floor._put_args()
    bound = inspect.signature(UnitAdmission.put_rows).bind(None, *args)
    assert bound.arguments["n"] == 1
    cols = bound.arguments["cols"]
    assert set(cols) == set(bound.arguments["fields"]) == set(bound.arguments["nbytes"])
    assert all(type(c) is WireTensor and c.shape[0] == 1 for c in cols.values())
    assert {f: cols[f].nbytes for f in cols} == {f: v[0] for f, v in
                                                 bound.arguments["nbytes"].items()}
    ans = PutAnswer.from_wire(rpc_floor._PUT_ANSWER)
    assert ans.status is PutStatus.OK and ans.rows == [12345]
