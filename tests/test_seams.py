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
    with pytest.raises(InvalidArgument, match="'ray' transport options go under 'options:'"):
        streamrl.StreamQueue.from_config({"transport": "ray", "namespace": "rl"})
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


# -- no reach-ins: layers use each other's public accessors

#: private names and the only modules (path prefixes under streamrl/) that may read them
#: on an object other than ``self``: the module that owns them
_OWNED = {
    "_transport": ("queue.py", "session.py"), "_control": ("queue.py",),
    "_data": ("queue.py",), "_tbits": ("controller/",), "_tokens": ("controller/",),
    "_loop": ("service.py",), "_current": ("queue.py", "compat/transferqueue/"),
    "_raw_tensor": ("codec.py",), "_dtype_name": ("codec.py",),
    "_TORCH_DTYPES": ("codec.py",),
}
#: reach-ins left (none: rdt/ uses codec.dtype_name, codec.torch_dtype, Runtime.member_actor)
_LEFT: set[tuple[str, str]] = set()
#: private attributes read in a file that does not define them, with why each is allowed:
#: anything else is a reach-in into another module's state (see the test below)
_CROSS_FILE = {
    ("queue.py", "target._learn"): "the queue seeds the cache of the batch a write was given",
    ("queue.py", "task._exception"): "CPython's Task: reading it does not mark it retrieved",
    ("transport/ray/transport.py", "controller._actor_id"): "Ray's handle has no public id",
    ("transport/rdt/group.py", "a._actor_id"): "the same",
    ("compat/transferqueue/client.py", "interface._system"):
        "the layer's one system, a module global of its own package",
}
#: getattr/hasattr of private names allowed: a lazily set attribute of the object's own
#: class, torch's nested-tensor internals, the sync twin's own method marks
_PROBES = {("transport/base.py", "_queue_id"), ("columns.py", "_ragged_idx"),
           ("sync.py", "_derived")}


def _private_uses():
    import ast
    from pathlib import Path

    root = Path(streamrl.__file__).parent
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Attribute) and n.attr in _OWNED and not (
                    isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                yield "attr", rel, n.attr, ast.unparse(n)
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                    and n.func.id in ("getattr", "hasattr") and len(n.args) > 1
                    and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
                    and n.args[1].value.startswith("_")
                    and not n.args[1].value.startswith("__")):
                yield "probe", rel, n.args[1].value, ast.unparse(n)


def test_no_module_reads_another_modules_private_state():
    """The service asks the controller (task_bit, rows_in_writes), the checkpoint client
    and the sync twin go through the queue's Session, the twin through
    Transport.owner_loop and Stream.current, storage through codec's public helpers."""
    bad = []
    for kind, rel, name, src in _private_uses():
        if kind == "attr" and not rel.startswith(_OWNED[name]) and (rel, src) not in _LEFT:
            bad.append(f"{rel}: {src}")
        if kind == "probe" and (rel, name) not in _PROBES:
            bad.append(f"{rel}: {src}")
    assert bad == []


def test_no_private_attribute_is_read_outside_the_file_that_defines_it():
    """General form of the check above, for names nobody listed: ``x._name`` (``x`` not
    ``self``, ``cls`` or ``super()``) in a file where nothing named ``_name`` is defined
    (no def, class, assignment or annotation of it) reads another module's private state.
    Each such read is in _CROSS_FILE with its reason; a new one fails here: add a public
    accessor instead."""
    import ast
    from pathlib import Path

    root = Path(streamrl.__file__).parent
    found = set()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text())
        defined = set()
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                defined.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                defined.add(n.id)
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and n.attr.startswith("_")
                    and not n.attr.startswith("__") and n.attr not in defined
                    and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))
                    and not (isinstance(n.value, ast.Call)
                             and ast.unparse(n.value.func) == "super")):
                found.add((rel, ast.unparse(n)))
    assert sorted(found - set(_CROSS_FILE)) == []
    assert sorted(set(_CROSS_FILE) - found) == []  # a fixed one leaves the list too


def test_transports_declare_metrics_url_and_owner_loop():
    """What the queue asked by getattr is declared on Transport (defaults for a
    transport that says nothing); the embedded one is bound to the loop that used it."""
    import asyncio

    from streamrl.transport import Transport
    from streamrl.transport.embedded import EmbeddedTransport

    assert Transport.metrics_url is None
    assert isinstance(inspect.getattr_static(Transport, "owner_loop"), property)

    async def main():
        q = streamrl.StreamQueue(capacity=8)
        t = q.session.transport
        assert isinstance(t, EmbeddedTransport) and t.owner_loop is None  # not used yet
        await q.put({"x": [1, 2]}, partition="p")
        assert t.owner_loop is asyncio.get_running_loop() and q.metrics_url is None

    asyncio.run(main())


def test_controller_answers_what_the_service_used_to_read_from_its_privates():
    from streamrl.controller import Controller, Request

    c = Controller(8)
    assert c.task_bit("t") == 0  # never asked
    tok = c.allocate("p", 2, ("x",), nbytes=16)
    assert c.rows_in_writes() == (set(tok.rows), set())
    c.commit(tok, {"x": [8, 8]})
    assert c.rows_in_writes() == (set(), set())
    tok2 = c.begin_write(tok.rows, ("y",))
    assert c.rows_in_writes() == (set(), set(tok.rows))
    c.commit(tok2, {"y": [8, 8]})
    c.take(Request("t", ("x",), batch_size=2, partition="p"))
    assert c.task_bit("t") != 0 and c.rows_in_writes() == (set(), set())


def test_the_config_docstring_lists_the_transport_options():
    """QueueConfig's docstring names exactly the options the embedded, Ray and RDT
    transports take (EMBEDDED_OPTIONS and RAY_OPTIONS are the lists their factories
    check against)."""
    import re

    pytest.importorskip("ray")
    from streamrl.transport.embedded import EMBEDDED_OPTIONS
    from streamrl.transport.ray import RAY_OPTIONS
    from streamrl.transport.rdt.transport import OPTIONS as RDT_OPTIONS

    doc = QueueConfig.__doc__ or ""
    text = doc[doc.index("options: transport-specific"):doc.index("Raises:")]
    named = re.findall(r"``(\w+)``", text)
    assert set(named) - {"embedded", "ray", "rdt"} == (
        set(EMBEDDED_OPTIONS) | set(RAY_OPTIONS) | set(RDT_OPTIONS))
    with pytest.raises(InvalidArgument, match=", ".join(RAY_OPTIONS)):
        streamrl.StreamQueue(transport="ray", nope=1)
    with pytest.raises(InvalidArgument, match=", ".join(EMBEDDED_OPTIONS)):
        streamrl.StreamQueue(nope=1)



def test_the_ray_transport_package_names_load_on_first_use():
    """streamrl.transport.ray imports none of its modules itself (a process loads what it
    uses: see tests/test_ray.py::test_a_producer_process_loads_neither_the_controller_nor_the_embedded_transport);
    every public name still resolves, to its module's object, and the actor classes a
    transport starts are named by "module:name" until create() imports them."""
    pytest.importorskip("ray")
    import streamrl.transport.ray as pkg
    from streamrl.transport.ray import controller, transport, unit
    from streamrl.transport.ray.transport import _actor_class
    from streamrl.transport.rdt.transport import RdtTransport
    from streamrl.transport.rdt.unit import RdtStorageActor

    for name in pkg.__all__:
        assert getattr(pkg, name) is not None, name
    assert pkg.RayTransport is transport.RayTransport and "RayTransport" in dir(pkg)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        pkg.nope  # noqa: B018
    assert _actor_class(transport.RayTransport.storage_actor) is unit.StorageActor
    assert _actor_class(transport.RayTransport.controller_actor) is controller.ControllerActor
    assert _actor_class(RdtTransport.storage_actor) is RdtStorageActor
    assert _actor_class(RdtStorageActor) is RdtStorageActor
