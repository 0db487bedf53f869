"""Storage units: where the rows' column data is held.

A queue spreads its rows over ``num_shards`` storage units; ``StreamQueue(storage=...)``
picks their backend:

* ``"memory"`` (default): :class:`StorageUnit`, everything in memory, no copy on put or
  read;
* ``"spill"``: :class:`SpillUnit`, in memory up to a byte budget per unit, older tensor
  data beyond it in a local file, read back on ``materialize``
  (``{"backend": "spill", "memory_bytes": ..., "dir": ...}``);
* any backend registered with :func:`register` (or the ``streamrl.storage`` entry
  points).

:class:`StorageBackend` is the interface a backend implements (see ``docs/storage.md``
for a recipe). This package does not import torch: Ray storage-unit actors use it.
"""

from .base import STATE_FORMAT, StateChunk, StorageBackend, StorageCaps
from .memory import StorageUnit, approx_size
from .registry import (ENTRY_POINT_GROUP, available, check_spec, create_unit, register,
                       resolve, unregister)
from .spill import SpillUnit

__all__ = ["StorageBackend", "StorageCaps", "StateChunk", "STATE_FORMAT", "StorageUnit",
           "SpillUnit", "approx_size", "create_unit", "register", "unregister", "available",
           "resolve", "check_spec", "ENTRY_POINT_GROUP"]
