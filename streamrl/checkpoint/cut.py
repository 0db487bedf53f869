"""The controller's side of a checkpoint: the cut, the deletes it holds back, its
state file, and loading it into a new queue (with another number of storage units).

Torch-free: the controller actor on Ray runs it.

**The cut.** :meth:`ControllerService.checkpoint_begin` takes the controller's state at
one instant (:meth:`Controller.state_cut`, about a microsecond per row held, during which
no other control call runs) and returns which rows and fields each storage unit must
write: the rows of the cut and their committed fields. Writes committed after the cut
are not in the checkpoint; their rows or fields are simply not asked for.

**Held deletes.** Rows of the cut can be dropped while the units write (consumed,
filtered, cleared...): the controller forgets them at once as usual, but their deletion
from the storage units (and the undo of a retracted write to them) waits until
:meth:`ControllerService.checkpoint_end`, so that every row of the cut can still be read.
Producers are admitted as usual meanwhile: units may hold more than ``capacity`` for the
length of the checkpoint, by the bytes dropped during it. A hold that is not ended (the
client died) ends by itself after its timeout.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError
from .files import read_msgpack, write_msgpack

__all__ = ["CheckpointCut", "Hold", "write_state", "read_state", "remap_shards",
           "STATE_FILE"]

#: the controller's state file in a checkpoint directory
STATE_FILE = "controller.msgpack"


@dataclass
class CheckpointCut:
    """What :meth:`~streamrl.control.ControlPlane.checkpoint_begin` answers.

    Attributes:
        token: names the hold for ``checkpoint_end``.
        plans: per storage unit, per field: the rows of the cut with that field
            committed, and their bytes (in row order).
        rows: per storage unit, every row of the cut with a committed field.
        state: the state file's entry (``name``, ``bytes``, ``crc32``).
        filters: each registered filter's saved reference (see :mod:`.refs`).
        summary: rows, bytes, partitions and policy version at the cut.
        pause: seconds the controller spent taking the cut (no other call ran).
    """

    token: int
    plans: dict[int, dict[str, tuple[list[int], list[int]]]]
    rows: dict[int, list[int]]
    state: dict[str, Any]
    filters: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    pause: float = 0.0


class Hold:
    """Storage deletes of rows of a cut, held until the units wrote them."""

    def __init__(self, token: int, rows: set[int], deadline: float | None):
        self.token = token
        self.rows = rows
        self.deadline = deadline
        self.deletes: dict[int, list[int]] = {}
        self.undos: list[Any] = []

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def split(self, deletes: dict[int, list[int]]) -> dict[int, list[int]]:
        """Keep the deletes of rows of the cut; the rest, to be done now."""
        now: dict[int, list[int]] = {}
        cut = self.rows
        for shard, rows in deletes.items():
            for r in rows:
                (self.deletes.setdefault(shard, []) if r in cut
                 else now.setdefault(shard, [])).append(r)
        return now

    def keeps(self, undo: Any) -> bool:
        """Keep the undo of a write if it touches rows of the cut."""
        cut = self.rows
        if any(r in cut for _, parts in undo.parts for rows in parts.values() for r in rows):
            self.undos.append(undo)
            return True
        return False


def write_state(directory: str, cut: Any, num_shards: int) -> tuple[dict, dict, dict, dict]:
    """Turn a :class:`~streamrl.controller.snapshot.StateCut` into the controller's
    state file under ``directory`` and the units' plans (runs in a worker thread).
    Returns ``(state file entry, plans, rows per unit, summary)``."""
    # (from the cut's row tuples: the rows' dicts are made one at a time as the state
    # file is packed; see StateCut.stream_dict)
    plans: dict[int, dict[str, tuple[list[int], list[int]]]] = {s: {} for s in range(num_shards)}
    rows: dict[int, list[int]] = {s: [] for s in range(num_shards)}
    nbytes = 0
    for rid, _part, shard, _version, fields, *_ in cut.rows:
        if not fields:  # new rows of a write in flight: aborted on restore
            continue
        rows[shard].append(rid)
        plan = plans[shard]
        for f, n in fields.items():
            got = plan.get(f)
            if got is None:
                got = plan[f] = ([], [])
            got[0].append(rid)
            got[1].append(n)
            nbytes += n
    for plan in plans.values():  # row order: the order the unit stored most of them in
        for f, (rs, ns) in list(plan.items()):
            if any(rs[i] > rs[i + 1] for i in range(len(rs) - 1)):
                order = sorted(range(len(rs)), key=rs.__getitem__)
                plan[f] = ([rs[i] for i in order], [ns[i] for i in order])
    for rs in rows.values():
        rs.sort()
    state = cut.stream_dict()
    entry = write_msgpack(os.path.join(directory, STATE_FILE), state)
    summary = {"rows": sum(len(r) for r in rows.values()), "bytes": nbytes,
               "partitions": len(state["partitions"]), "policy_version": state["policy_version"],
               "tag_fields": state["tag_fields"], "time": time.time()}
    return entry, plans, rows, summary


def read_state(directory: str, entry: dict[str, Any]) -> dict[str, Any]:
    """The controller's state from a checkpoint, checked against its entry.

    Raises:
        CheckpointError: the file is missing, torn or corrupt.
    """
    return read_msgpack(os.path.join(directory, STATE_FILE), entry, "the controller's state")


def remap_shards(state: dict[str, Any], shards: dict[int, int] | None) -> None:
    """Place the rows of a saved state on new storage units: a row of unit ``s`` goes to
    unit ``shards[s]`` (``None``: the same units). The new units are all alive and have
    leased no row ids yet, so dead units and id blocks are forgotten (ids stay unique:
    the row-id counter is past every block)."""
    if shards is not None:
        def m(s: int) -> int:
            try:
                return shards[int(s)]
            except KeyError:
                raise CheckpointError(
                    f"the saved state has rows on storage unit {s}, which the checkpoint's "
                    "manifest does not list; the checkpoint is damaged") from None

        for rd in state["rows"]:
            rd["shard"] = m(rd["shard"])
        for w in state["writes"]:
            w["shards"] = [m(s) for s in w["shards"]]
        for j in state["filter_jobs"]:
            j["shards"] = [m(s) for s in j["shards"]]
        state["next_shard"] = 0
    state["unit_ids"] = []
    state["dead_shards"] = []
