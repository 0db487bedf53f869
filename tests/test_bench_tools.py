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
