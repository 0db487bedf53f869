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
#: the RDT transport runs the tests of RDT_SUITE (where Ray runs)
RDT = "ray" in TRANSPORTS
#: the transports that start Ray actors (their spill deployments too: "ray-spill")
RAY_TRANSPORTS = ("ray", "rdt")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session of this process (each pytest-xdist worker
    starts its own; small: this machine has 2 cores)."""
    import ray

    if not ray.is_initialized():
        here = os.path.dirname(os.path.abspath(__file__))
        # Workers import actor classes defined in test files: put tests/ on their path.
        # Through the environment the local Ray inherits, not a job-level runtime_env:
        # with one, every worker starts through Ray's runtime-env setup (one more Python
        # process) and no prestarted worker fits, which made a queue's three actors start
        # in 1.35-1.45 s instead of 0.8 (a third of the whole test run).
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in [here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")] if p)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=1 << 30, namespace="streamrl-tests",
                 _node_ip_address="127.0.0.1")  # tests talk to loopback only
    yield ray
    ray.shutdown()


#: The behavioural suite also runs on the spill storage backend with a tiny memory budget
#: (so rows really go to disk and come back): its tests (those using ``make_queue``) get
#: the deployment "embedded-spill" besides "embedded" and "ray", and those of RAY_SPILL
#: also "ray-spill" (each Ray test costs ~10 s here, mostly starting actors: the whole
#: suite on ray-spill would add ~8 minutes).
SPILL_SUITE = {"test_semantics", "test_lifecycle", "test_cancellation"}
#: the data-path tests of the suite: puts, reads of ragged and object fields, writes of
#: new fields, failed/cancelled/expired writes and their undo, drops, nothing left behind
RAY_SPILL = {
    "test_partial_samples_pipeline_through_four_roles",
    "test_exactly_once_per_task_with_concurrent_consumers",
    "test_failed_write_of_new_fields_keeps_the_rows_other_fields",
    "test_expired_write_to_existing_rows_frees_what_it_stored",
    "test_drop_and_clear_leave_zero_rows_and_bytes",
    "test_materialize_fetches_only_requested_fields",
    "test_non_tensor_and_ragged_fields",
    "test_a_cancelled_write_of_a_new_field_then_retried_lands_whole",
    "test_a_cancelled_put_of_new_rows_leaves_nothing",
    "test_a_cancelled_overwrite_leaves_old_or_new_values",
    "test_grpo_zero_variance_filter_ends_with_nothing_held",
}
#: The tests of the suite that also run on "rdt" by default (each Ray test costs 10-20 s
#: on this loaded 2-core machine): the data-path tests above, plus those where held
#: tensors change what happens (a put refused after its tensors were held must free them,
#: reads of views and by several tasks, filters in the controller actor reading held
#: fields, capacity counting held bytes, writes taken back). ``STREAMRL_RDT_SUITE=all``
#: runs every test of the suite's modules (SPILL_SUITE) that makes its queues with
#: ``make_queue`` on "rdt": 69 tests, 17-18 minutes here under a load of 16-23. Their queues hold tensor fields in the test's own
#: process (``rdt_hold_anywhere=True``: the driver is in no RDT group), so puts keep
#: tensors in its holder, its reads are local, and the filters' reads in the controller
#: actor take the fallback path (the holder's socket): a suite test runs in one process,
#: so it cannot move tensors between processes. Transfers between the actors of an RDT
#: group, suite-style tests included, are tests/test_rdt.py's.
RDT_SUITE = RAY_SPILL | {
    "test_many_tasks_read_the_same_rows_independently",
    "test_views_index_select_concat_split",
    "test_unencodable_object_is_refused_and_queue_stays_consistent",
    "test_a_field_has_one_dtype",
    "test_write_wrong_length_and_duplicate_field",
    "test_capacity_bytes_bounds_admission",
    "test_filter_sees_fields_and_rows_leased_elsewhere_shrink",
    "test_a_batch_loses_rows_whose_write_was_taken_back",
    "test_a_stream_acks_the_batch_before_when_it_asks_for_the_next",
    "test_a_cancelled_write_of_a_new_field_then_retried_lands_whole",
}
#: every make_queue test of the suite's modules on "rdt" (see RDT_SUITE)
RDT_SUITE_ALL = os.environ.get("STREAMRL_RDT_SUITE") == "all"
#: STREAMRL_TEST_HOP=1: the suite's tests (those of SPILL_SUITE using ``make_queue``) also
#: run on the "hop" transport of docs/transports.md's recipe, loaded from the page itself
#: (tests/recipes/_docs.py), as a transport written outside the package
HOP = os.environ.get("STREAMRL_TEST_HOP") == "1"
_hop_loaded: list = []
#: 256 bytes of tensors per unit: most puts of the suite go to disk at once, the last
#: small ones stay in memory
SPILL = {"backend": "spill", "memory_bytes": 256}


def pytest_generate_tests(metafunc):
    """Parametrise ``transport`` over TRANSPORTS (plus the spill deployments for the
    suite), unless the test parametrises it itself (``test_ray.py``: ``["ray"]``)."""
    if "transport" not in metafunc.fixturenames or any(
            "transport" in m.args[0] for m in metafunc.definition.iter_markers("parametrize")):
        return
    params = list(TRANSPORTS)
    if RDT and (metafunc.function.__name__ in RDT_SUITE or (
            RDT_SUITE_ALL and metafunc.module.__name__ in SPILL_SUITE
            and "make_queue" in metafunc.fixturenames)):
        params.append("rdt")
    if metafunc.module.__name__ in SPILL_SUITE and "make_queue" in metafunc.fixturenames:
        params += [f"{t}-spill" for t in TRANSPORTS
                   if t != "ray" or metafunc.function.__name__ in RAY_SPILL]
        if HOP:
            params.append("hop")
    metafunc.parametrize("transport", params, indirect=True)


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.on_ray(name=value, ...)``: on the Ray transports ("ray", "rdt" and
    their spill deployments), run the test only with these values of its other
    parameters; every value still runs on the embedded ones. For parameters that choose
    between code paths of the client, which is the same on every transport: each Ray
    test starts its actor processes (about a second here), so one value there shows the
    transport's part. The other combinations are deselected (counted as such)."""
    keep, drop = [], []
    for item in items:
        mark = item.get_closest_marker("on_ray")
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (mark is not None and str(params.get("transport", "")).split("-")[0] in RAY_TRANSPORTS
                and any(params.get(k) != v for k, v in mark.kwargs.items())):
            drop.append(item)
            continue
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def transport(request):
    """The transport name: the parametrised ``"<transport>"`` or ``"<transport>-spill"``
    (see SPILL_SUITE) without its storage part."""
    name = request.param.split("-")[0]
    if name in RAY_TRANSPORTS:
        request.getfixturevalue("ray_session")
    if name == "hop" and not _hop_loaded:
        from recipes._docs import load_recipe

        _hop_loaded.append(load_recipe("transports.md", "transport"))  # registers "hop"
    return name


@pytest.fixture
def storage(request, tmp_path):
    """The ``storage=`` of the parametrised deployment (spill files under tmp_path)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and str(callspec.params.get("transport", "")).endswith("-spill"):
        return {**SPILL, "dir": str(tmp_path)}
    return "memory"


#: On Ray every storage unit is one more actor process to start, and starting processes
#: is most of a Ray test's time on this 2-core machine (a queue with two units: ~1.1 s,
#: ~1.9 CPU-seconds; with one: ~0.7 s). So a Ray queue of ``make_queue`` has one unit
#: unless the test asks for more, except in the data-path tests (RDT_SUITE: reads,
#: writes and drops spread over several units), which keep two.
SHARDED_ON_RAY = RDT_SUITE


@pytest.fixture
async def make_queue(request, transport, storage):
    """make_queue(**kwargs) -> StreamQueue on the parametrised transport and storage;
    every queue is closed and shut down after the test. ``num_shards`` defaults to 2
    (1 on Ray outside SHARDED_ON_RAY)."""
    made: list[streamrl.StreamQueue] = []
    shards = 1 if transport in RAY_TRANSPORTS and (
        request.node.originalname not in SHARDED_ON_RAY) else 2

    def make(**kw) -> streamrl.StreamQueue:
        kw.setdefault("capacity", 1024)
        kw.setdefault("num_shards", shards)
        kw.setdefault("storage", storage)
        if transport == "rdt":
            kw.setdefault("rdt_hold_anywhere", True)
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
    if transport == "rdt" and made:  # held tensors do not outlive their queue
        from streamrl.transport.rdt import holder_stats

        assert holder_stats() == {"tensors": 0, "bytes": 0}
