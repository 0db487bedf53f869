"""streamrl: the data plane of LLM reinforcement-learning post-training.

Producers ``put`` partial samples into a sharded, bounded :class:`StreamQueue`; consumers
``stream`` readiness-gated micro-batches as lazy :class:`RowRemoteBatch` views and
``materialize`` only the fields they need. See the documentation for the concepts.
"""

from . import errors
from .batch import BatchProxy, ColumnRemoteBatch, RemoteBatch, RowRemoteBatch
from .queue import DEFAULT_PARTITION, Stream, StreamQueue
from .stats import Stats, TaskStats

__version__ = "0.1.0"

__all__ = [
    "StreamQueue",
    "Stream",
    "RemoteBatch",
    "RowRemoteBatch",
    "ColumnRemoteBatch",
    "BatchProxy",
    "Stats",
    "TaskStats",
    "DEFAULT_PARTITION",
    "errors",
    "__version__",
]
