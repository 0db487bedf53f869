"""Checkpoints of in-process storage units (the embedded transport).

Each unit is written by a worker thread of its own, all at once; the thread reads the
unit through the event loop (``unit.get`` runs there, between the queue's other calls:
a read of views costs microseconds) and does the rest outside it: turning tensors into
bytes (no copy for contiguous CPU tensors), encoding Python objects with
:mod:`streamrl.codec`, writing and checksumming the files. Restoring reads and checks
each unit's files in a worker thread too, into fresh tensors that the units then keep
(one read per byte, no other copy).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import torch

from .. import codec
from ..storage import StorageBackend
from .units import Sink, read_unit, unit_state, write_unit

__all__ = ["write_units", "load_units", "TorchSink"]


def _raw(piece: Any) -> tuple:
    if isinstance(piece, torch.Tensor):
        dtype, shape, buf = codec.tensor_to_raw(piece)
        return ("t", dtype, piece.element_size(), shape, buf)
    return ("o", [codec.pack(codec.encode(x, name="a field value")) for x in piece])


async def write_units(units: Sequence[StorageBackend], directory: str,
                      plans: Mapping[int, Mapping], rows: Mapping[int, Sequence[int]]
                      ) -> list[dict]:
    """Write every unit's rows of a cut under ``directory/unit-XXXXX``, concurrently;
    the units' manifest entries, by shard."""
    out: list[Any] = [None] * len(units)
    stop = threading.Event()  # set when this is cancelled or a unit fails

    async def one(shard: int, unit: StorageBackend) -> None:
        def fetch(batch: list[int], field: str) -> tuple[list, None]:
            return anyio.from_thread.run_sync(lambda: unit.get(batch, [field])[field]), None

        try:
            # (a cancelled wait still waits for its thread: stop makes that short, and
            # no thread writes into the directory once this returns)
            out[shard] = await anyio.to_thread.run_sync(
                lambda: write_unit(os.path.join(directory, f"unit-{shard:05d}"), shard,
                                   plans.get(shard, {}), rows.get(shard, []), fetch, _raw,
                                   stopped=stop.is_set))
        except BaseException:
            stop.set()
            raise

    try:
        await _all([(one, shard, unit) for shard, unit in enumerate(units)])
    finally:
        stop.set()
    return out


async def _all(calls: list[tuple]) -> None:
    """Run ``fn(*args)`` of every call at once; the first error of one (a unit's
    :class:`~streamrl.errors.CheckpointError`, say) is raised as it is, not in a group."""
    try:
        async with anyio.create_task_group() as tg:
            for fn, *args in calls:
                tg.start_soon(fn, *args)
    except BaseExceptionGroup as eg:
        leaves = list(_leaves(eg))
        first = next((e for e in leaves if isinstance(e, Exception)), leaves[0])
        raise first from None


def _leaves(eg: BaseExceptionGroup):
    for e in eg.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from _leaves(e)
        else:
            yield e


class TorchSink(Sink):
    """Tensors in fresh CPU memory of their own; objects decoded."""

    def alloc(self, nbytes: int) -> tuple[Any, Any]:
        t = torch.empty(nbytes, dtype=torch.uint8)
        return t.numpy(), t

    def tensor(self, dtype: str, itemsize: int, shape: tuple, handle: Any) -> Any:
        return codec.tensor_from_raw(dtype, shape, handle.numpy())

    def objects(self, values: list) -> list:
        return [codec.decode(codec.unpack(v)) for v in values]


def load_unit(unit: StorageBackend, directory: str, sources: Sequence[dict]) -> None:
    """Fill ``unit`` with the parts of the old units ``sources`` (their manifest
    entries), once every file of theirs was read and checked."""
    rows: list[int] = []
    chunks: list = []
    sink = TorchSink()
    for entry in sources:
        r, c = read_unit(os.path.join(directory, entry["dir"]), entry, sink,
                         f"storage unit {entry['shard']}'s part")
        rows += r
        chunks += c
    unit.load_state_dict(unit_state(unit.index, rows, chunks))


async def load_units(units: Sequence[StorageBackend], directory: str,
                     sources: Mapping[int, Sequence[dict]]) -> None:
    """Fill each (new, empty) unit from the checkpoint's units ``sources[shard]``, all
    at once (nobody else uses the units yet)."""
    await _all([(anyio.to_thread.run_sync, load_unit, unit, directory, sources[shard])
                for shard, unit in enumerate(units) if sources.get(shard)])
