"""Deployments of a queue: ``embedded`` (default, one process), ``ray`` (actors), and any
transport registered with :func:`register` (or the ``streamrl.transports`` entry points).

See :mod:`streamrl.transport.base` for the interfaces a transport implements and
:mod:`streamrl.transport.registry` for how names are resolved.
"""

from .base import DataCaps, DataPlane, Transport
from .registry import ENTRY_POINT_GROUP, available, register, resolve, unregister

__all__ = ["DataCaps", "DataPlane", "Transport", "register", "unregister", "resolve",
           "available", "ENTRY_POINT_GROUP"]
