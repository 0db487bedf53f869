"""TransferQueue's module-level API: ``init``, ``close``, ``get_client``, the key-value
calls and their async twins, and the checkpoint calls.

``init`` starts (or, on Ray, attaches to) one system per process: a
:class:`streamrl.StreamQueue` holding the data and the controller keeping TransferQueue's
metadata. On Ray the controller is the named actor ``TransferQueueController`` (namespace
``transfer_queue``), so ``init()`` in any other process of the cluster attaches to it, as
with TransferQueue. Differences, each a TransferQueue defect users work around:

* the actors ask for no CPU (TransferQueue's controller and each storage unit take one,
  so its default configuration needs 3 free CPUs and waits for ever on a 2-CPU node);
* the queue is bounded (rows: ``total_storage_size``; bytes: ``streamrl.capacity_bytes``,
  half the machine's memory by default): a ``put`` waits for room instead of growing
  without bound (TransferQueue's default has no bound at all);
* a ``get_meta`` waiting for data waits in the controller's event loop, so every other
  client goes on (TransferQueue's controller sleeps 5 s in its only request thread);
* ``close()`` from a process that attached leaves the system running for the others
  (TransferQueue's kills the controller from any process).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

from streamrl.errors import InvalidArgument

from . import config as _config
from .client import System, TransferQueueClient, _Loop
from .control import RayTQControl
from .controller import ACTOR_NAME, ACTOR_NAMESPACE, TQControllerService
from .metadata import BatchMeta, KVBatchMeta

__all__ = ["init", "close", "get_client", "get_metrics_endpoint", "kv_put", "kv_batch_put",
           "kv_batch_get", "kv_batch_get_by_meta", "kv_list", "kv_clear", "async_kv_put",
           "async_kv_batch_put", "async_kv_batch_get", "async_kv_batch_get_by_meta",
           "async_kv_list", "async_kv_clear", "save_checkpoint", "load_checkpoint",
           "StorageKeyNotFoundError"]

# TransferQueue's module globals, under its names (code that inspects them keeps working)
_TQ_CLIENT: TransferQueueClient | None = None
_TQ_CONTROLLER: Any = None
_TQ_STORAGE: Any = None
_SYSTEM: System | None = None


class StorageKeyNotFoundError(KeyError):
    """A key a storage backend was asked for is not there (TransferQueue's name)."""


def _forget_after_fork() -> None:
    """A forked child has none of its parent's threads: it starts afresh (``init()``
    again attaches to a Ray system; an embedded one stays the parent's)."""
    global _SYSTEM, _TQ_CLIENT, _TQ_CONTROLLER, _TQ_STORAGE
    _SYSTEM = _TQ_CLIENT = _TQ_CONTROLLER = _TQ_STORAGE = None
    _Loop._current = None
    _Loop._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _system() -> System:
    if _SYSTEM is None and not _attach():
        raise RuntimeError("TransferQueue is not initialized: call transfer_queue.init() first")
    assert _SYSTEM is not None
    return _SYSTEM


def _set(system: System) -> None:
    global _SYSTEM, _TQ_CLIENT, _TQ_CONTROLLER, _TQ_STORAGE
    _SYSTEM = system
    _TQ_CONTROLLER = system.actor if system.actor is not None else system.service
    _TQ_STORAGE = system.queue
    _TQ_CLIENT = TransferQueueClient(f"TransferQueueClient_{id(system)}", system)


def _attach() -> bool:
    """Attach to the controller actor another process started (Ray only)."""
    try:
        import ray
    except ImportError:
        return False
    if not ray.is_initialized():
        return False
    try:
        actor = ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE)
    except ValueError:
        return False
    # Ray's stubs give an actor handle's methods no type (its __getattr__ returns Never)
    queue: Any
    conf: Any
    queue, conf = ray.get([actor.get_queue.remote(), actor.get_config.remote()])
    _set(System(queue, RayTQControl(actor), conf, owner=False, actor=actor))
    return True


_ACTOR_CLASS: list[type] = []


def _actor_class() -> type:
    """:class:`TQControllerService` as the class of the controller actor: a subclass
    holding copies of its methods, because ``ray.remote`` adds its tracing parameter
    (``_ray_trace_ctx``) to the signatures of the functions it is given, in place (and
    the service must keep :class:`~.control.TQControlPlane`'s)."""
    if not _ACTOR_CLASS:
        import types

        def copy(f: types.FunctionType) -> types.FunctionType:
            g = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__,
                                   f.__closure__)
            g.__kwdefaults__ = f.__kwdefaults__
            g.__qualname__, g.__doc__, g.__module__ = f.__qualname__, f.__doc__, f.__module__
            g.__annotations__ = dict(f.__annotations__)
            return g

        methods = {n: copy(f) for n, f in vars(TQControllerService).items()
                   if isinstance(f, types.FunctionType)}
        _ACTOR_CLASS.append(type("TQControllerActor", (TQControllerService,),
                                 {**methods, "__module__": __name__}))
    return _ACTOR_CLASS[0]


def _as_conf(merged: dict[str, Any]) -> Any:
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return merged
    try:
        return OmegaConf.create(merged, flags={"allow_objects": True})
    except Exception:  # a value OmegaConf cannot hold: hand back the plain dict
        return merged


def init(conf: Any = None) -> Any:
    """Start TransferQueue (or attach to the one running on this Ray cluster).

    Args:
        conf: a dict or an OmegaConf config merged over the defaults (see
            :mod:`streamrl.compat.transferqueue.config`); ignored when attaching.

    Returns:
        The merged configuration (``conf`` itself when attaching, as TransferQueue does).

    On Ray (``streamrl.transport: ray``, or ``auto`` with Ray initialised) the queue's
    actors and the controller actor ask for no CPU.
    """
    if _SYSTEM is not None or _attach():
        return conf
    merged = _config.merge(conf)
    settings = _config.settings(merged)
    opts = _config.queue_options(merged)
    loop = _Loop.get()
    if opts["transport"] == "ray":
        import ray

        import streamrl

        queue = streamrl.StreamQueue(**opts)
        actor_cls: Any = ray.remote(_actor_class())
        # Ray's stubs type ActorClass.remote() as "ActorHandle | the class itself"
        # (ActorProxy); it returns an ActorHandle, whose methods' .remote() they cannot type
        actor: Any
        try:
            actor = actor_cls.options(name=ACTOR_NAME, namespace=ACTOR_NAMESPACE, num_cpus=0,
                                      max_concurrency=1000).remote(merged, queue, settings)
        except ValueError:  # another process made it first: use that one
            loop.run(queue.shutdown())
            if _attach():
                return conf
            raise
        try:
            ray.get(actor.ping.remote())
        except BaseException:  # it could not start (a sampler that does not unpickle...)
            ray.kill(actor)
            loop.run(queue.shutdown())
            raise
        _set(System(queue, RayTQControl(actor), merged, owner=True, actor=actor))
    else:
        async def start():
            import streamrl

            q = streamrl.StreamQueue(**opts)
            return q, TQControllerService(merged, q, settings)

        queue, service = loop.run(start())
        _set(System(queue, service, merged, owner=True, service=service))
    return _as_conf(merged)


def close() -> None:
    """End this process's use of TransferQueue. The process that started the system
    also stops it: the controller and the queue (whose data is dropped)."""
    global _SYSTEM, _TQ_CLIENT, _TQ_CONTROLLER, _TQ_STORAGE
    system, _SYSTEM = _SYSTEM, None
    _TQ_CLIENT = _TQ_CONTROLLER = _TQ_STORAGE = None
    if system is None or not system.owner:
        return

    async def stop():
        try:
            await system.controller.shutdown()
        except Exception:
            pass
        try:
            await system.queue.close()
        finally:
            await system.queue.shutdown()

    try:
        system.loop.run(stop())
    finally:
        if system.actor is not None:
            import ray

            try:
                ray.kill(system.actor)
            except Exception:
                pass


def get_client() -> TransferQueueClient:
    """The blocking client of this process (``init`` first, or attach on Ray)."""
    return _client()


def _client() -> TransferQueueClient:
    _system()
    assert _TQ_CLIENT is not None
    return _TQ_CLIENT


def get_metrics_endpoint() -> str | None:
    """``None``: TransferQueue's Prometheus exporter has no counterpart here yet (see
    :meth:`streamrl.StreamQueue.stats`)."""
    return None


def _run(coro: Any) -> Any:
    return _system().loop.run(coro)


async def _hop(coro_fn: Callable, *args: Any, **kwargs: Any) -> Any:
    return await _system().loop.hop(coro_fn(*args, **kwargs))


# ---------------------------------------------------------------------- key-value calls


def _kv_fields(fields: Any) -> TensorDict:
    """``kv_put``'s ``fields``: a TensorDict of one row, or a dict of one sample's values."""
    if isinstance(fields, TensorDict):
        return fields
    if isinstance(fields, Mapping):
        out = {}
        for name, v in fields.items():
            if isinstance(v, torch.Tensor):
                if v.is_nested:
                    raise InvalidArgument("kv_put takes one sample; put nested tensors with kv_batch_put")
                out[name] = v.unsqueeze(0)
            else:
                out[name] = NonTensorStack(v)
        return TensorDict(out, batch_size=[1])
    raise InvalidArgument(f"fields must be a dict or a TensorDict, got {type(fields).__name__}")


def _kv_meta(keys: list[str], partition_id: str, meta: BatchMeta) -> KVBatchMeta:
    return KVBatchMeta(keys=keys, tags=meta.custom_meta, partition_id=partition_id,
                       fields=meta.field_names, extra_info=meta.extra_info)


async def _kv_batch_put(keys: Sequence[str], partition_id: str, fields: Any = None,
                        tags: Sequence[Mapping[str, Any]] | None = None,
                        data_parser: Callable | None = None, single: bool = False) -> KVBatchMeta:
    if fields is None and tags is None:
        raise InvalidArgument("give fields, tags, or both")
    keys = list(keys)
    if len(set(keys)) != len(keys):
        raise InvalidArgument("the keys repeat; give each key once")
    if fields is not None:
        fields = _kv_fields(fields) if single else fields
        if not isinstance(fields, TensorDict):
            raise InvalidArgument(f"fields must be a TensorDict, got {type(fields).__name__}")
        if fields.batch_size[0] != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but fields has {fields.batch_size[0]} rows")
    if tags is not None and len(tags) != len(keys):
        raise InvalidArgument(f"{len(keys)} keys but {len(tags)} tags; give one tag dict per key")
    client = _client()
    meta = await client.async_kv_retrieve_meta(keys, partition_id, create=True)
    if meta.size != len(keys):
        raise RuntimeError(f"got {meta.size} samples for {len(keys)} keys")
    if tags is not None:
        meta.update_custom_meta(tags)
    if fields is not None:
        meta = await client.async_put(fields, meta, data_parser=data_parser)
    else:
        await client.async_set_custom_meta(meta)
    return _kv_meta(keys, partition_id, meta)


async def _kv_batch_get(keys: Sequence[str] | str, partition_id: str,
                        select_fields: Sequence[str] | str | None = None) -> TensorDict:
    client = _client()
    meta = await client.async_kv_retrieve_meta(keys, partition_id, create=False)
    if meta.size == 0:
        raise InvalidArgument(f"keys {keys if isinstance(keys, str) else list(keys)[:8]} were not "
                         f"found in partition {partition_id!r}")
    if select_fields is not None:
        meta = meta.select_fields([select_fields] if isinstance(select_fields, str)
                                  else list(select_fields))
    if not meta.is_ready:
        raise InvalidArgument("some requested keys lack some of the fields: not every sample is ready")
    return await client.async_get_data(meta)


async def _kv_batch_get_by_meta(meta: KVBatchMeta,
                                select_fields: Sequence[str] | str | None = None) -> TensorDict:
    if meta.partition_id is None:
        raise InvalidArgument("the KVBatchMeta has no partition_id")
    wanted: list[str] | None  # None: every field of the batch
    if select_fields is not None:
        wanted = [select_fields] if isinstance(select_fields, str) else list(select_fields)
        if meta.fields is None or any(f not in meta.fields for f in wanted):
            raise InvalidArgument(f"select_fields {wanted} not found in the KVBatchMeta's fields "
                             f"{meta.fields}")
    else:
        wanted = meta.fields
    return await _kv_batch_get(meta.keys, meta.partition_id, wanted)


async def _kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    return await _client().async_kv_list(partition_id)


async def _kv_clear(keys: Sequence[str] | str, partition_id: str) -> None:
    client = _client()
    meta = await client.async_kv_retrieve_meta(keys, partition_id, create=False)
    if meta.size:
        await client.async_clear_samples(meta)


def kv_put(key: str, partition_id: str, fields: Any = None, tag: Mapping[str, Any] | None = None,
           data_parser: Callable | None = None) -> KVBatchMeta:
    """Write one sample under a key of yours (made when new): ``fields`` (a dict of its
    values, or a TensorDict of one row) and/or ``tag`` (its custom metadata). Returns the
    key's metadata, with every field the key holds."""
    return _run(_kv_batch_put([key], partition_id, fields, None if tag is None else [tag],
                              data_parser, single=True))


def kv_batch_put(keys: Sequence[str], partition_id: str, fields: TensorDict | None = None,
                 tags: Sequence[Mapping[str, Any]] | None = None,
                 data_parser: Callable | None = None) -> KVBatchMeta:
    """Write many samples under keys of yours (one row of ``fields`` and one tag per key)."""
    return _run(_kv_batch_put(keys, partition_id, fields, tags, data_parser))


def kv_batch_get(keys: Sequence[str] | str, partition_id: str,
                 select_fields: Sequence[str] | str | None = None) -> TensorDict:
    """The values of keys (keys not found are left out).

    Raises:
        ValueError: none of the keys is there, or some lack a selected field.
    """
    return _run(_kv_batch_get(keys, partition_id, select_fields))


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: Sequence[str] | str | None = None
                         ) -> TensorDict:
    """``kv_batch_get`` of what a ``kv_put``/``kv_batch_put`` returned."""
    return _run(_kv_batch_get_by_meta(meta, select_fields))


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """``{partition: {key: tags}}`` of one partition (or all)."""
    return _run(_kv_list(partition_id))


def kv_clear(keys: Sequence[str] | str, partition_id: str) -> None:
    """Forget keys and drop their data (keys not found are skipped)."""
    _run(_kv_clear(keys, partition_id))


async def async_kv_put(key: str, partition_id: str, fields: Any = None,
                       tag: Mapping[str, Any] | None = None,
                       data_parser: Callable | None = None) -> KVBatchMeta:
    """Async :func:`kv_put`."""
    return await _hop(_kv_batch_put, [key], partition_id, fields,
                      None if tag is None else [tag], data_parser, single=True)


async def async_kv_batch_put(keys: Sequence[str], partition_id: str,
                             fields: TensorDict | None = None,
                             tags: Sequence[Mapping[str, Any]] | None = None,
                             data_parser: Callable | None = None) -> KVBatchMeta:
    """Async :func:`kv_batch_put`."""
    return await _hop(_kv_batch_put, keys, partition_id, fields, tags, data_parser)


async def async_kv_batch_get(keys: Sequence[str] | str, partition_id: str,
                             select_fields: Sequence[str] | str | None = None) -> TensorDict:
    """Async :func:`kv_batch_get`."""
    return await _hop(_kv_batch_get, keys, partition_id, select_fields)


async def async_kv_batch_get_by_meta(meta: KVBatchMeta,
                                     select_fields: Sequence[str] | str | None = None
                                     ) -> TensorDict:
    """Async :func:`kv_batch_get_by_meta`."""
    return await _hop(_kv_batch_get_by_meta, meta, select_fields)


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """Async :func:`kv_list`."""
    return await _hop(_kv_list, partition_id)


async def async_kv_clear(keys: Sequence[str] | str, partition_id: str) -> None:
    """Async :func:`kv_clear`."""
    await _hop(_kv_clear, keys, partition_id)


# ---------------------------------------------------------------------- checkpoints


def _check_initialized() -> None:
    if _TQ_CONTROLLER is None:
        raise RuntimeError("TransferQueue is not initialized: call transfer_queue.init() first")


_METADATA_FILE = "metadata.json"


def _aside(path: Path, what: str) -> Path:
    return path.parent / f"{path.name}.{what}"


def save_checkpoint(checkpoint_dir: str | Path, *, include_storage: bool = True,
                    metadata: dict[str, Any] | None = None) -> None:
    """Save the whole system (every partition's samples, their data, keys, tags and
    consumption, the sampler's state) to the directory ``checkpoint_dir``, atomically:
    it is written beside it (``<dir>.tmp``) and renamed; a checkpoint already there is
    replaced, and a failed save leaves what was there before. Producers and consumers
    go on meanwhile (see :meth:`streamrl.StreamQueue.checkpoint`).

    Args:
        checkpoint_dir: the directory (on a filesystem every node mounts when the
            system spans several).
        include_storage: accepted; the data is always saved (it lives only in the
            queue's memory: a checkpoint without it could not be loaded), as
            ``metadata.json``'s ``storage_saved`` says.
        metadata: a JSON-serialisable dict of yours, kept in ``metadata.json`` under
            ``user_metadata``.

    Raises:
        RuntimeError: TransferQueue is not initialized.
        CheckpointError: the queue's checkpoint could not be written.
        TypeError: ``metadata`` is not JSON-serialisable.
    """
    _check_initialized()
    import json
    import shutil

    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}")
    text = json.dumps({"storage_saved": True, "user_metadata": dict(metadata or {}),
                       "written_by": "streamrl.compat.transferqueue"}, indent=2)
    target = Path(checkpoint_dir)
    tmp, old = _aside(target, "tmp"), _aside(target, "old")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        _client().save_storage_checkpoint(str(tmp))
        (tmp / _METADATA_FILE).write_text(text)
        if target.exists():
            if old.exists():
                shutil.rmtree(old)
            target.rename(old)
        tmp.rename(target)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not target.exists():
            old.rename(target)
        raise


def load_checkpoint(checkpoint_dir: str | Path) -> None:
    """Replace the system's state by the checkpoint in ``checkpoint_dir`` (see
    :meth:`.TransferQueueClient.load_storage_checkpoint`): partitions held now are
    cleared; the saved samples, their data, keys, tags, consumption and the sampler's
    state come back, into this system's queue whatever its transport or number of
    storage units. A save that was interrupted between its two renames is finished
    first (``<dir>.old`` becomes ``<dir>``). Call it while no other client uses the
    system.

    Raises:
        RuntimeError: TransferQueue is not initialized.
        FileNotFoundError: no such directory, or a file of it (``metadata.json``...) is
            missing.
        CheckpointError: not a checkpoint of this layer, or a damaged one.
    """
    _check_initialized()
    import json

    from streamrl.errors import CheckpointError

    path = Path(checkpoint_dir)
    old = _aside(path, "old")
    if not path.exists() and old.exists():
        old.rename(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    if not (path / _METADATA_FILE).exists():
        raise FileNotFoundError(f"{_METADATA_FILE} not found in {path}")
    try:
        meta = json.loads((path / _METADATA_FILE).read_text())
    except ValueError as e:
        raise CheckpointError(f"{_METADATA_FILE} in {path} is not JSON ({e})") from None
    if not isinstance(meta, dict) or not meta.get("storage_saved"):
        raise CheckpointError(
            f"the checkpoint in {path} holds no data (storage_saved is not true): it was not "
            "written by streamrl.compat.transferqueue's save_checkpoint")
    _client().load_storage_checkpoint(str(path))
