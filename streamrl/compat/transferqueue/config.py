"""TransferQueue's configuration, read by the compatibility layer.

``init(conf)`` takes what TransferQueue 0.1.11 takes (a dict or an OmegaConf config,
merged over the defaults below). Keys with a meaning here:

=========================================================  =================================
key                                                        becomes
=========================================================  =================================
``controller.polling_mode``                                fetch-mode ``get_meta`` returns an
                                                           empty ``BatchMeta`` instead of
                                                           waiting
``controller.sampler``                                     the sampler (name, class or
                                                           instance)
``controller.get_meta_timeout`` (new; default 5)           seconds a waiting ``get_meta``
                                                           waits before ``TimeoutError``
                                                           (``null``: for ever)
``backend.SimpleStorage.num_data_storage_units``           ``num_shards``
``backend.SimpleStorage.total_storage_size``               ``capacity`` (rows; ``null``: no
                                                           row bound, bytes still bound)
``backend.SimpleStorage.required_node_resource``           storage units need that Ray
                                                           resource
``streamrl.transport`` (new; ``auto``)                     ``"ray"`` when Ray is initialised,
                                                           else ``"embedded"``
``streamrl.capacity_bytes`` (new; ``auto``)                bytes held at once (``auto``: half
                                                           the machine's memory; ``null``:
                                                           none)
``streamrl.put_timeout`` (new; ``null``)                   seconds a ``put`` waits for room
                                                           before it raises
``streamrl.namespace`` (new)                               Ray namespace of the queue's
                                                           actors
``backend.SimpleStorage.ssd_offload.enabled``              ``storage="spill"``: tensor data
                                                           beyond a memory budget per unit
                                                           goes to a local file (streamrl's
                                                           spill backend, docs/storage.md)
``backend.SimpleStorage.ssd_offload.path``                 the spill file's directory:
                                                           ``<path>/transfer_queue_ssd_offload``
                                                           (``null``: the system temp dir)
``streamrl.spill_memory_bytes`` (new; 1 GiB)               with ``ssd_offload``: tensor bytes
                                                           each unit keeps in memory
``streamrl.copy_on_get`` (new; ``true``)                   ``get_data`` returns data the
                                                           caller owns (copy-on-write on
                                                           Ray; ``false``: views of the
                                                           stored data; do not write into
                                                           them)
=========================================================  =================================

``ssd_offload`` maps onto streamrl's spill backend, which spills by a memory budget
(least recently put first), not per sample by size: ``threshold_bytes`` and
``glibc_mmap_threshold_bytes`` have no meaning here. The spill file is unlinked as soon
as it is made (the kernel frees it however the process ends), so no ``*.bin`` files
appear under ``path``.

``zmq_info`` entries are filled by TransferQueue itself and ignored silently. Everything
else TransferQueue accepts (``metrics``, ``ssd_offload.threshold_bytes``, other storage
backends, ...) has no meaning here: it is accepted and ignored with a :class:`CompatWarning` naming
it. A key TransferQueue does not know is ignored with a warning too.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Mapping
from typing import Any

from streamrl.errors import InvalidArgument


__all__ = ["DEFAULTS", "CompatWarning", "merge", "settings", "queue_options"]


class CompatWarning(UserWarning):
    """A TransferQueue setting the compatibility layer accepts but ignores."""


_SSD = {"enabled": False, "path": None, "threshold_bytes": 1048576,
        "glibc_mmap_threshold_bytes": 1048576}

#: TransferQueue 0.1.11's defaults for the keys read here (the other backends' sections
#: are accepted as given), plus the ``streamrl`` section.
DEFAULTS: dict[str, Any] = {
    "metrics": {"enabled": False, "port": 0},
    "controller": {"sampler": "SequentialSampler", "polling_mode": False, "zmq_info": None,
                   "get_meta_timeout": 5.0},
    "backend": {
        "storage_backend": "SimpleStorage",
        "SimpleStorage": {"total_storage_size": None, "num_data_storage_units": 2,
                          "required_node_resource": None, "zmq_info": None,
                          "ssd_offload": dict(_SSD)},
    },
    "streamrl": {"transport": "auto", "capacity_bytes": "auto", "put_timeout": None,
                 "namespace": None, "copy_on_get": True, "spill_memory_bytes": 1 << 30},
}

_USED = {"controller.polling_mode", "controller.sampler", "controller.get_meta_timeout",
         "backend.storage_backend", "backend.SimpleStorage.total_storage_size",
         "backend.SimpleStorage.num_data_storage_units",
         "backend.SimpleStorage.required_node_resource",
         "backend.SimpleStorage.ssd_offload.enabled", "backend.SimpleStorage.ssd_offload.path"}
_KNOWN_TQ = {"metrics.enabled", "metrics.port", "backend.SimpleStorage.ssd_offload"}
_OTHER_BACKENDS = {"MooncakeStore", "Yuanrong", "RayStore"}


def _plain(conf: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:
        pass
    else:
        if isinstance(conf, (DictConfig, ListConfig)):
            return OmegaConf.to_container(conf, resolve=True)
    if isinstance(conf, Mapping):
        return {k: _plain(v) for k, v in conf.items()}
    return conf


def _leaves(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping) and v and not path.endswith(("zmq_info", "ucx_env_vars")):
            out.update(_leaves(v, path + "."))
        else:
            out[path] = v
    return out


def _default_at(path: str) -> Any:
    node: Any = DEFAULTS
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return KeyError
        node = node[part]
    return node


def merge(conf: Any = None) -> dict[str, Any]:
    """The defaults with ``conf`` (a dict or an OmegaConf config) merged over them, as a
    plain dict. Warns (:class:`CompatWarning`) once per key that is accepted but has no
    meaning here, or is unknown."""
    user = _plain(conf) if conf is not None else {}
    if not isinstance(user, Mapping):
        raise InvalidArgument(f"init takes a dict or an OmegaConf config, got {type(conf).__name__}")
    out = copy.deepcopy(DEFAULTS)

    def deep(dst: dict, src: Mapping) -> None:
        for k, v in src.items():
            if isinstance(v, Mapping) and isinstance(dst.get(k), dict):
                deep(dst[k], v)
            else:
                dst[k] = copy.deepcopy(v) if isinstance(v, (dict, list)) else v

    deep(out, user)
    ignored, unknown = [], []
    for path, value in _leaves(user).items():
        if path in _USED or path.startswith("streamrl.") or path.endswith("zmq_info"):
            if path.startswith("streamrl.") and _default_at(path) is KeyError:
                unknown.append(path)
            continue
        if path.split(".")[0] == "backend" and path.split(".")[1] in _OTHER_BACKENDS:
            if out["backend"]["storage_backend"] == path.split(".")[1]:
                ignored.append(path)
            continue
        default = _default_at(path)
        if default is KeyError and not any(path.startswith(k) for k in _KNOWN_TQ):
            unknown.append(path)
        elif default is KeyError or value != default:
            ignored.append(path)
    if out["backend"]["storage_backend"] != "SimpleStorage":
        ignored.append(f"backend.storage_backend={out['backend']['storage_backend']}")
    if ignored:
        warnings.warn(
            "streamrl.compat.transferqueue: these TransferQueue settings have no meaning on "
            f"streamrl and are ignored: {', '.join(ignored)} (data is held by streamrl's "
            "storage units; see the module docs of streamrl.compat.transferqueue.config)",
            CompatWarning, stacklevel=3)
    if unknown:
        warnings.warn(f"streamrl.compat.transferqueue: unknown settings ignored: "
                      f"{', '.join(unknown)}", CompatWarning, stacklevel=3)
    return out


def settings(conf: Mapping[str, Any]) -> dict[str, Any]:
    """The controller's settings of a merged config."""
    c = conf["controller"]
    timeout = c.get("get_meta_timeout", 5.0)
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
        raise InvalidArgument(f"controller.get_meta_timeout must be seconds >= 0 or null, got {timeout!r}")
    if not isinstance(c.get("polling_mode"), bool):
        raise InvalidArgument(f"controller.polling_mode must be true or false, got {c.get('polling_mode')!r}")
    return {"sampler": c.get("sampler", "SequentialSampler"), "polling_mode": c["polling_mode"],
            "get_meta_timeout": timeout}


def _memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def transport_of(conf: Mapping[str, Any]) -> str:
    t = conf["streamrl"].get("transport", "auto")
    if t == "auto":
        try:
            import ray
        except ImportError:
            return "embedded"
        return "ray" if ray.is_initialized() else "embedded"
    return t


def queue_options(conf: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`streamrl.StreamQueue` options of a merged config."""
    simple = conf["backend"]["SimpleStorage"]
    ours = conf["streamrl"]
    units = simple.get("num_data_storage_units", 2)
    if not isinstance(units, int) or units <= 0:
        raise InvalidArgument(f"backend.SimpleStorage.num_data_storage_units must be a positive int, "
                         f"got {units!r}")
    total = simple.get("total_storage_size")
    if total is not None and (not isinstance(total, int) or total <= 0):
        raise InvalidArgument(f"backend.SimpleStorage.total_storage_size must be a positive int or "
                         f"null, got {total!r}")
    cap_bytes = ours.get("capacity_bytes", "auto")
    if cap_bytes == "auto":
        mem = _memory()
        cap_bytes = mem // 2 if mem else None
    opts: dict[str, Any] = {"capacity": total if total is not None else 1 << 40,
                            "num_shards": units, "capacity_bytes": cap_bytes,
                            "transport": transport_of(conf)}
    ssd = simple.get("ssd_offload") or {}
    if not isinstance(ssd.get("enabled", False), bool):
        raise InvalidArgument(f"backend.SimpleStorage.ssd_offload.enabled must be true or "
                              f"false, got {ssd.get('enabled')!r}")
    if ssd.get("enabled"):  # streamrl's spill backend (see the module docstring)
        path = ssd.get("path")
        opts["storage"] = {"backend": "spill",
                           "memory_bytes": ours.get("spill_memory_bytes", 1 << 30),
                           "dir": (os.path.join(os.fspath(path), "transfer_queue_ssd_offload")
                                   if path else None)}
    if opts["transport"] == "ray":
        if ours.get("namespace"):
            opts["namespace"] = ours["namespace"]
        res = simple.get("required_node_resource")
        if res:
            opts["unit_options"] = {"resources": {str(res): 0.001}}
    return opts
