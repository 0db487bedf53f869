"""``streamrl.columns.one_row_dense``: the one-pass read of a one-row put of plain dense
tensors, which must agree with what ``to_columns`` and the sizes after it make of the
same data, and refuse (``None``) everything else so that the usual path raises its own
errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrl.columns import dtype_name, one_row_dense, to_columns


@pytest.mark.parametrize("data", [
    {"tokens": torch.arange(256).view(1, 256), "reward": torch.tensor([0.5])},
    {"x": torch.zeros(1, 2, 3, dtype=torch.bfloat16)},
    {"m": torch.ones(1, 4, dtype=torch.bool), "v": torch.zeros(1, 1, dtype=torch.complex64)},
    {"t": torch.arange(12).view(3, 4).t()[:1]},  # a non-contiguous view of one row
])
def test_one_row_dense_agrees_with_to_columns(data):
    nbytes, dtypes, shapes = one_row_dense(data)
    cols, n = to_columns(data)
    assert n == 1 and list(cols) == list(nbytes) == list(dtypes)
    for f, c in cols.items():
        assert c is data[f]  # (kept as given, as the usual path keeps it)
        assert nbytes[f] == [c.element_size() * c.numel()]
        assert dtypes[f] == dtype_name(c.dtype)
    assert shapes == tuple((f, c.dtype, tuple(c.shape[1:])) for f, c in cols.items())


@pytest.mark.parametrize("data", [
    {},
    {"x": torch.zeros(2, 3)},  # two rows
    {"x": torch.zeros(1), "y": torch.zeros(2)},  # lengths that differ
    {"x": torch.tensor(1.0)},  # no row dimension
    {"x": torch.zeros(1, 3, requires_grad=True)},
    {"x": torch.zeros(1, 3, device="meta")},
    {"x": torch.zeros(1, 3).to_sparse()},
    {"x": torch.nested.nested_tensor([torch.zeros(3)])},
    {"x": torch.nested.nested_tensor([torch.zeros(3)], layout=torch.jagged)},
    {"x": torch.zeros(1, 3, dtype=torch.uint16)},  # not one of the plain dtypes
    {"x": np.zeros((1, 3))},
    {"x": [1]},
    {"": torch.zeros(1)},
    {3: torch.zeros(1)},
    {"x": torch.zeros(1), "chat": ["hi"]},
])
def test_one_row_dense_refuses_anything_else(data):
    assert one_row_dense(data) is None


# A producer that only puts plain tensors never needs tensordict, whose import pulls in
# torch._dynamo and sympy (seconds and ~90 MB a process): it is imported where a
# TensorDict is made or read, and by a consumer's get/stream before its first lease.
_PUT_ONLY = r"""
import asyncio, sys
import torch
import streamrl, streamrl.sync
try:
    import streamrl.transport.ray  # (what a Ray producer's handle loads)
except ImportError:
    pass

async def main():
    async with streamrl.StreamQueue(capacity=64) as q:
        await q.put({"x": torch.zeros(1, 4), "note": ["a"]}, partition="p")
        await q.put({"x": torch.zeros(3, 4), "note": ["b", "c", "d"]}, partition="p")
        print("after puts", "tensordict" in sys.modules)
        mb = await q.get("t", ["x", "note"], 4, partition="p", timeout=5)
        print("after get", "tensordict" in sys.modules)
        td = await mb.materialize()
        print("materialized", type(td).__name__, list(td["note"]), td["x"].shape[0])

asyncio.run(main())
"""


def test_a_producer_never_imports_tensordict_and_a_consumer_before_its_first_lease():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PUT_ONLY], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "after puts False"
    # a consumer imports it before it holds a lease (the import takes seconds, which a
    # short lease_timeout would not survive inside the first materialize)
    assert lines[1] == "after get True"
    assert lines[2] == "materialized TensorDict ['a', 'b', 'c', 'd'] 4"


def test_tensordict_inputs_are_still_recognised():
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    td = TensorDict({"x": torch.arange(6).view(3, 2)}, batch_size=[3])
    td.set("note", NonTensorStack(*[NonTensorData(s, batch_size=[]) for s in "abc"],
                                  stack_dim=0))
    cols, n = to_columns(td)
    assert n == 3 and cols["note"] == ["a", "b", "c"] and cols["x"] is td["x"]
    # a non-tensor stack given as a dict's value is its list of rows
    cols, n = to_columns({"note": td.get("note")})
    assert n == 3 and cols["note"] == ["a", "b", "c"]
    with pytest.raises(Exception, match="batch dimension"):
        to_columns(TensorDict({"x": torch.zeros(2)}, batch_size=[]))
