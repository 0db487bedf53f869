"""Checkpoints of a whole queue: :meth:`streamrl.StreamQueue.checkpoint` and
:meth:`streamrl.StreamQueue.restore` (the format is documented in docs/checkpoint.md).

Modules, each usable on its own:

* :mod:`.files` -- checksummed files: safetensors for tensors, msgpack for metadata
  (torch-free);
* :mod:`.units` -- a storage unit's part: written and read by the unit itself
  (torch-free: Ray storage-unit actors run it);
* :mod:`.cut` -- the controller's part: the cut, the deletes it holds back, its state
  file, loading it onto another number of units (torch-free);
* :mod:`.refs` -- filters saved as importable names;
* :mod:`.local` -- the embedded transport's units;
* :mod:`.client` -- the orchestration: ``checkpoint``, ``restore``, periodic checkpoints.

The names below are loaded on first use (storage-unit actors import this package
without torch).
"""

from __future__ import annotations

from .. import _lazy

_EXPORTS = {"CheckpointInfo": "client", "open_checkpoint": "client", "FORMAT": "client",
            "FORMAT_VERSION": "client"}
__all__ = list(_EXPORTS)


__getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, globals())
