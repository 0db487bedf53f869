"""The seams are declared once: surfaces that mirror each other are checked against the
one declaration, so they cannot drift."""

from __future__ import annotations

import inspect

import pytest

import streamrl
from streamrl.config import QueueConfig, Request
from streamrl.errors import InvalidArgument


def _params(fn, skip=("self",)):
    return {p.name: p for p in inspect.signature(fn).parameters.values() if p.name not in skip}


def test_queue_options_are_the_config_fields():
    """StreamQueue's keyword options are exactly QueueConfig's fields (transport options
    are the **options catch-all), with the same defaults."""
    params = _params(streamrl.StreamQueue.__init__)
    assert params.pop("options").kind is inspect.Parameter.VAR_KEYWORD
    fields = {f: getattr(QueueConfig(), f) for f in QueueConfig.fields() if f != "options"}
    assert set(params) == set(fields)
    for name, p in params.items():
        assert p.default == fields[name], name


def test_controller_options_are_the_config_fields():
    """Controller's keywords are the QueueConfig options it reads (controller.OPTIONS),
    with QueueConfig's defaults; from_config and the keywords make the same controller."""
    from streamrl.controller import OPTIONS, Controller

    params = _params(Controller.__init__)
    assert params.pop("clock").kind is inspect.Parameter.KEYWORD_ONLY
    assert params["capacity"].default is inspect.Parameter.empty  # (a controller needs one)
    assert list(params) == list(OPTIONS) and set(OPTIONS) <= set(QueueConfig.fields())
    default = QueueConfig()
    for name, p in list(params.items())[1:]:
        assert p.default == getattr(default, name), name
    cfg = QueueConfig(capacity=8, capacity_bytes=1 << 20, num_shards=3, lease_timeout=5.0,
                      max_staleness=2, max_lead=1, consumers=("a",),
                      sampler={"sampler": "priority", "field": "adv"})
    by_kw = Controller(**{k: getattr(cfg, k) for k in OPTIONS})
    by_cfg = Controller.from_config(cfg)
    assert by_cfg.config is cfg and by_kw.config == cfg
    for c in (by_kw, by_cfg):
        assert (c.capacity, c.capacity_bytes, c.num_shards, c.lease_timeout, c.max_staleness,
                c.max_lead, c.default_consumers) == (8, 1 << 20, 3, 5.0, 2, 1, {"a"})
        assert type(c.sampler).__name__ == "PrioritySampler"


@pytest.mark.parametrize("method", ["get", "stream"])
def test_request_options_are_the_request_fields(method):
    params = _params(getattr(streamrl.StreamQueue, method))
    assert params.pop("timeout").default is None  # the wait, not part of the request
    assert list(params)[:3] == ["task", "fields", "batch_size"]
    opts = {k: p.default for k, p in list(params.items())[3:]}
    want = {f: Request.__dataclass_fields__[f].default for f in Request.options()}
    assert opts == want


def test_from_config_takes_a_plain_mapping_and_names_unknown_keys():
    q = streamrl.StreamQueue.from_config({"capacity": 32, "num_shards": 3,
                                          "consumers": ["a"], "lease_timeout": 5})
    assert q.num_shards == 3 and q.config.capacity == 32 and q.config.consumers == ("a",)
    with pytest.raises(InvalidArgument, match=r"'num_shard'.*did you mean 'num_shards'.*capacity"):
        streamrl.StreamQueue.from_config({"num_shard": 2})
    with pytest.raises(InvalidArgument, match="unknown options for the embedded transport"):
        streamrl.StreamQueue.from_config({"options": {"namespace": "x"}})
    q2 = streamrl.StreamQueue.from_config(q.config, capacity=64)  # a config, overridden
    assert q2.config.capacity == 64 and q2.config.num_shards == 3


def test_from_config_takes_an_omegaconf_mapping():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create("capacity: 16\nnum_shards: 2\nconsumers: [a, b]\n")
    q = streamrl.StreamQueue.from_config(cfg)
    assert q.config.consumers == ("a", "b") and q.num_shards == 2


@pytest.mark.parametrize("bad", [
    {"capacity": True}, {"capacity": 0}, {"num_shards": 1.5}, {"lease_timeout": float("nan")},
    {"lease_timeout": float("inf")}, {"lease_timeout": 0}, {"consumers": 5},
    {"consumers": []}, {"max_staleness": -1}, {"capacity_bytes": True}, {"name": ""},
    {"transport": 3},
])
def test_bad_queue_options_raise_naming_the_option(bad):
    (name,) = bad
    with pytest.raises(InvalidArgument, match=name):
        streamrl.StreamQueue(**bad)


def test_unknown_transport_lists_the_registered_ones():
    with pytest.raises(InvalidArgument, match=r"unknown transport 'nope'.*embedded.*ray"):
        streamrl.StreamQueue(transport="nope")
