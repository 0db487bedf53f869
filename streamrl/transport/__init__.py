"""Deployments of a queue: ``embedded`` (default, one process) and ``ray`` (actors).

See :mod:`streamrl.transport.base` for the interface a transport implements.
"""

from .base import DataPlane, Transport

__all__ = ["DataPlane", "Transport"]
