"""streamrl: the data plane of LLM reinforcement-learning post-training.

Producers ``put`` partial samples into a sharded, bounded :class:`StreamQueue`; consumers
``stream`` readiness-gated micro-batches as lazy :class:`RowRemoteBatch` views and
``materialize`` only the fields they need. See the documentation for the concepts.

The public names are loaded on first use, so that processes which only host parts of a
queue (Ray storage-unit and controller actors) do not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _lazy, errors

__version__ = "0.1.0"

_EXPORTS = {
    "StreamQueue": "queue",
    "Stream": "queue",
    "DEFAULT_PARTITION": "queue",
    "RemoteBatch": "batch",
    "RowRemoteBatch": "batch",
    "ColumnRemoteBatch": "batch",
    "BatchProxy": "batch",
    "Stats": "stats",
    "TaskStats": "stats",
    "filters": None,
    "sampling": None,
    "sync": None,
    "codec": None,
    "storage": None,
}

__all__ = sorted(_EXPORTS) + ["errors", "__version__"]


__getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, globals())


if TYPE_CHECKING:  # for type checkers and IDEs
    from . import codec, filters, sampling, storage, sync
    from .batch import BatchProxy, ColumnRemoteBatch, RemoteBatch, RowRemoteBatch
    from .queue import DEFAULT_PARTITION, Stream, StreamQueue
    from .stats import Stats, TaskStats
