"""Ray Direct Transport (RDT): tensor fields stay on the actor that made them and move
point to point, driven from async code through one transfer thread per process.

``StreamQueue(transport="rdt", ...)`` is the Ray transport (controller actor, storage
units, sockets) with another data path for tensor fields; ``StreamQueue(transport="ray",
rdt_fields=[...])`` does the same for the named fields only (small token ids through the
storage units, big logits or pixels held).

* **Holders.** A process that is in an RDT group (:func:`create_group`) keeps the tensor
  fields it puts, in its holder (:mod:`.runtime`): no copy, no bytes sent. The storage
  unit stores a small "held by" entry instead; metadata and every other field take the
  Ray transport's path. Other processes (the driver, tasks, actors of no group) put
  through the storage units, unless the queue says ``rdt_hold_anywhere=True``.
* **Reads** (:mod:`.data`) fetch held fields from their holders, one transfer per holder
  per micro-batch: inside a group by a collective send/receive ordered by the group's
  coordinator and run on both processes' transfer threads (``"rdt"`` in
  ``stats().bytes_by_path``); from outside the group over the holder's socket
  (``"socket"``, the fallback); in the holder itself as views (``"local"``).
* **Lifetime.** Storage units tell holders when no row refers to a held tensor (drop,
  clear, consumption, overwrite, aborted write): holder memory returns to zero after a
  run. A held tensor is the producer's own tensor (RDT objects are mutable): do not
  change it in place after the put; put a copy if you must reuse the memory.
* **Groups** (:mod:`.group`): made by :func:`create_group` from the driver over the
  actors that produce or consume held fields (``gloo``, ``nccl``, ``nixl``).
* A holder that dies: reads of the rows whose fields it held raise
  :class:`~streamrl.errors.RowsLost` naming the rows and the holder (``.holder``).

See ``docs/rdt.md``.
"""

from __future__ import annotations

from .data import RdtDataPlane, RdtPlaneSpec
from .group import RdtGroup, create_group
from .runtime import HeldRef, TransferThread, current, runtime
from .transport import RdtTransport, create

__all__ = ["RdtTransport", "RdtDataPlane", "RdtPlaneSpec", "RdtGroup", "create_group",
           "create", "HeldRef", "TransferThread", "holder_stats", "runtime", "current"]


def holder_stats() -> dict[str, int]:
    """What this process holds now: ``tensors`` and ``bytes`` (zeros when it holds
    nothing)."""
    rt = current()
    return rt.stats() if rt is not None else {"tensors": 0, "bytes": 0}
