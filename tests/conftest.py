"""Shared fixtures: the behavioural suite runs over every transport in TRANSPORTS."""

from __future__ import annotations

import os

import pytest

# Tests talk to loopback only; without this Ray resolves 127.0.0.1 to the host's address.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import streamrl

TRANSPORTS = ["embedded"]
try:  # the Ray transport joins when Ray and the transport are importable
    import ray  # noqa: F401

    from streamrl.transport import ray as _ray_transport  # noqa: F401

    if os.environ.get("STREAMRL_SKIP_RAY") != "1":
        TRANSPORTS.append("ray")
except ImportError:
    pass


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session (small: this machine has 2 cores)."""
    import ray

    if not ray.is_initialized():
        here = os.path.dirname(os.path.abspath(__file__))
        # workers import actor classes defined in test files: put tests/ on their path
        path = os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=1 << 30, namespace="streamrl-tests",
                 _node_ip_address="127.0.0.1",  # tests talk to loopback only
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield ray
    ray.shutdown()


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    return request.param


@pytest.fixture
async def make_queue(transport):
    """make_queue(**kwargs) -> StreamQueue on the parametrised transport; every queue is
    closed and shut down after the test."""
    made: list[streamrl.StreamQueue] = []

    def make(**kw) -> streamrl.StreamQueue:
        kw.setdefault("capacity", 1024)
        kw.setdefault("num_shards", 2)
        q = streamrl.StreamQueue(transport=transport, **kw)
        made.append(q)
        return q

    yield make
    for q in made:
        try:
            await q.close()
        except streamrl.errors.TransportError:  # a test killed its controller on purpose
            pass
        finally:
            await q.shutdown()
