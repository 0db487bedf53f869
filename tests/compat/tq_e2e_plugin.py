"""Pytest plugin for the subprocess that runs TransferQueue's own e2e tests against
streamrl.compat.transferqueue (see test_transferqueue_e2e.py).

Their fixtures call a bare ``ray.init()``, which would attach to any Ray cluster already
running on the machine; here the first ``ray.init`` starts a small local cluster of this
process (2 CPUs, loopback only, no dashboard) and it serves every test module, as the
external Ray head TransferQueue's own CI uses does: their per-module ``ray.shutdown()``
is deferred to the end of the session (a Ray start takes 15-20 s on this machine).
Nothing else of theirs is changed.
"""

import os

import ray

_init = ray.init


def _local_init(*args, **kwargs):
    if not args and not kwargs.get("address"):
        kwargs["address"] = "local"
    kwargs.setdefault("num_cpus", int(os.environ.get("TQ_E2E_NUM_CPUS", "2")))
    kwargs.setdefault("include_dashboard", False)
    kwargs.setdefault("_node_ip_address", "127.0.0.1")
    kwargs.setdefault("object_store_memory", 256 << 20)
    return _init(*args, **kwargs)


ray.init = _local_init
_shutdown = ray.shutdown
ray.shutdown = lambda *args, **kwargs: None


# -- outcomes, for the test that runs this subprocess: {test id: "passed" | "failed" |
# "error" | "skipped"} written to $TQ_E2E_REPORT at the end of the session

_outcomes: dict = {}


def _test_id(nodeid: str) -> str:
    return nodeid.split("e2e/", 1)[-1]


def pytest_runtest_logreport(report):
    tid = _test_id(report.nodeid)
    if report.failed:
        # a failing setup/teardown is an error; a failing call, a failure
        _outcomes[tid] = "failed" if report.when == "call" else (
            "failed" if _outcomes.get(tid) == "failed" else "error")
    elif report.skipped:
        _outcomes.setdefault(tid, "skipped")
    elif report.when == "call":
        _outcomes.setdefault(tid, "passed")


def pytest_sessionfinish(session, exitstatus):
    import json
    import os

    _shutdown()
    path = os.environ.get("TQ_E2E_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_outcomes, f, indent=1, sort_keys=True)
