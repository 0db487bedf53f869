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
