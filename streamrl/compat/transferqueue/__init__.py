"""TransferQueue 0.1.11's public client API over a :class:`streamrl.StreamQueue`.

Code written for TransferQueue runs unchanged on streamrl, embedded in one process or on
Ray::

    import streamrl.compat.transferqueue as tq      # or: tq.install(); import transfer_queue
    tq.init({"controller": {"polling_mode": True}})
    client = tq.get_client()
    meta = client.put(data=td, partition_id="train_0")
    batch = client.get_meta(data_fields=["prompt"], batch_size=8, partition_id="train_0",
                            task_name="rollout")
    td = client.get_data(batch)

What is here: ``init``/``close``/``get_client``, the client's data calls (``put``,
``get_meta`` in fetch, force-fetch and insert modes, polling or waiting, ``get_data``,
``clear_partition``, ``clear_samples``), its status calls, the key-value calls
(``kv_put``, ``kv_batch_put``, ``kv_batch_get``, ``kv_batch_get_by_meta``, ``kv_list``,
``kv_clear``), the async twins of all of them, ``BatchMeta``/``KVBatchMeta`` and the
samplers, and ``save_checkpoint``/``load_checkpoint`` on streamrl's queue checkpoints
(:meth:`streamrl.StreamQueue.checkpoint`); ``StreamingDataset``/``StreamingDataLoader``
are not provided.

Where TransferQueue's behaviour is a defect its users work around, the API is kept and
the behaviour fixed (see :mod:`.interface`, :mod:`.controller`, :mod:`.sampler`): a
waiting ``get_meta`` holds up no other client, the actors need no CPU, the data is bounded
(``put`` waits for room), and GRPO groups are not mixed up by late or reused samples.

:func:`install` makes ``import transfer_queue`` resolve to this package in the current
process; on Ray, also in every worker with
``ray.init(runtime_env={"worker_process_setup_hook": "streamrl.compat.transferqueue.install"})``
(or put :func:`alias_path` on ``PYTHONPATH``).
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile

from .client import AsyncTransferQueueClient, TransferQueueClient
from .config import CompatWarning
from .interface import (StorageKeyNotFoundError, async_kv_batch_get, async_kv_batch_get_by_meta,
                        async_kv_batch_put, async_kv_clear, async_kv_list, async_kv_put, close,
                        get_client, get_metrics_endpoint, init, kv_batch_get,
                        kv_batch_get_by_meta, kv_batch_put, kv_clear, kv_list, kv_put,
                        load_checkpoint, save_checkpoint)
from .metadata import BatchMeta, KVBatchMeta
from .sampler import (BaseSampler, GRPOGroupNSampler, RankAwareSampler, SeqlenBalancedSampler,
                      SequentialSampler)

__version__ = "0.1.11"

__all__ = [
    "init", "close", "get_metrics_endpoint", "kv_put", "kv_batch_put", "kv_batch_get",
    "kv_batch_get_by_meta", "kv_list", "kv_clear", "async_kv_put", "async_kv_batch_put",
    "async_kv_batch_get", "async_kv_batch_get_by_meta", "async_kv_list", "async_kv_clear",
    "KVBatchMeta", "save_checkpoint", "load_checkpoint", "StreamingDataset",
    "StreamingDataLoader", "get_client", "BatchMeta", "TransferQueueClient",
    "AsyncTransferQueueClient", "StorageKeyNotFoundError", "BaseSampler", "GRPOGroupNSampler",
    "SequentialSampler", "RankAwareSampler", "SeqlenBalancedSampler", "CompatWarning",
    "install", "alias_path",
]


class _NotProvided:
    """A TransferQueue class this layer does not provide."""

    _what = ""

    def __init__(self, *args, **kwargs):
        from streamrl.errors import NotSupported

        raise NotSupported(
            f"{type(self).__name__} is not provided by streamrl.compat.transferqueue: "
            f"{self._what}")


class StreamingDataset(_NotProvided):
    _what = ("fetch batches with get_meta/get_data (sampling_config={'dp_rank': r, "
             "'batch_index': i} with RankAwareSampler), or use streamrl natively: "
             "StreamQueue.stream(task, fields, batch_size, dp_rank=r, dp_size=R)")


class StreamingDataLoader(_NotProvided):
    _what = StreamingDataset._what


#: submodule names of TransferQueue that resolve here once installed
_SUBMODULES = {
    "interface": "interface", "client": "client", "metadata": "metadata",
    "controller": "controller", "config": "config", "sampler": "sampler",
    "sampler.base": "sampler", "sampler.sequential_sampler": "sampler",
    "sampler.grpo_group_n_sampler": "sampler", "sampler.rank_aware_sampler": "sampler",
    "sampler.seqlen_balanced_sampler": "sampler", "storage": "interface",
}


def install() -> None:
    """Make ``import transfer_queue`` (and the submodules above) give this package, in
    this process. Idempotent."""
    me = sys.modules[__name__]
    sys.modules["transfer_queue"] = me
    for tq_name, ours in _SUBMODULES.items():
        sys.modules[f"transfer_queue.{tq_name}"] = importlib.import_module(f"{__name__}.{ours}")


def alias_path() -> str:
    """A directory holding a ``transfer_queue`` package that installs this one when
    imported: put it first on ``PYTHONPATH`` of processes (Ray workers, subprocesses)
    that ``import transfer_queue``."""
    root = os.path.join(tempfile.gettempdir(), f"streamrl-tq-alias-{os.getuid()}")
    pkg = os.path.join(root, "transfer_queue")
    os.makedirs(pkg, exist_ok=True)
    text = ("# made by streamrl.compat.transferqueue.alias_path(): "
            "`import transfer_queue` gives the compatibility layer\n"
            "from streamrl.compat.transferqueue import install\ninstall()\n")
    path = os.path.join(pkg, "__init__.py")
    try:
        with open(path) as f:
            same = f.read() == text
    except OSError:
        same = False
    if not same:
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return root
