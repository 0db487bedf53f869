"""Third-party transports, storage backends and samplers found through their entry-point
groups (``streamrl.transports``, ``streamrl.storage``, ``streamrl.samplers``), the way
an installed package registers them: a package on the path whose ``*.dist-info`` names
its factories, with nothing registered by code. Each registry scans its group once per
process, so the check runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PACKAGE = '''
"""A third-party plug-in package: one transport, one storage backend, one sampler."""
from streamrl.controller import Controller
from streamrl.sampling import Sampler
from streamrl.storage import StorageUnit, create_unit
from streamrl.transport.embedded import EmbeddedTransport


class PlugTransport(EmbeddedTransport):
    name = "plug-transport"


def transport(config):
    units = [create_unit(config.storage, i) for i in range(config.num_shards)]
    return PlugTransport(Controller.from_config(config), units)


class PlugStore(StorageUnit):
    name = "plug-store"


def store(index, *, on_release=None):
    return PlugStore(index, on_release)


class Reverse(Sampler):
    """Newest ready rows first."""

    def order(self, ready, size):
        return list(ready.units())[::-1]
'''

ENTRY_POINTS = '''
[streamrl.transports]
plug-transport = plugpkg:transport
plug-broken = plugpkg_not_installed:transport

[streamrl.storage]
plug-store = plugpkg:store

[streamrl.samplers]
plug-reverse = plugpkg:Reverse
'''

SCRIPT = '''
import asyncio

import torch

import streamrl
import streamrl.sampling
import streamrl.storage
import streamrl.transport
from streamrl.errors import InvalidArgument

assert "plug-transport" in streamrl.transport.available()
assert "plug-store" in streamrl.storage.available()
assert "plug-reverse" in streamrl.sampling.available()
assert "plugpkg" not in __import__("sys").modules  # listed, not imported until used


async def main():
    async with streamrl.StreamQueue(transport="plug-transport", storage="plug-store",
                                    sampler="plug-reverse", capacity=16, num_shards=2) as q:
        assert q.transport == "plug-transport"
        assert [type(u).__name__ for u in q.session.data.units] == ["PlugStore"] * 2
        await q.put({"idx": torch.arange(6)}, partition="p")
        await q.seal("p")
        got = [(await mb.materialize())["idx"].tolist()
               async for mb in q.stream("t", ["idx"], 2, partition="p")]
        assert got == [[5, 4], [3, 2], [1, 0]], got


asyncio.run(main())
try:
    streamrl.StreamQueue(transport="plug-broken")
except InvalidArgument as e:
    assert "plug-broken" in str(e) and "plugpkg_not_installed" in str(e), e
else:
    raise AssertionError("a broken entry point must raise InvalidArgument")
print("ok")
'''


def test_entry_points_add_a_transport_a_storage_backend_and_a_sampler(tmp_path):
    (tmp_path / "plugpkg.py").write_text(textwrap.dedent(PACKAGE))
    info = tmp_path / "plugpkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugpkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_without_the_package_the_names_are_unknown():
    """The same names without the dist-info: nothing registers them (so the test above
    saw the entry points, not something else)."""
    out = subprocess.run([sys.executable, "-c", (
        "import streamrl, streamrl.storage, streamrl.sampling, streamrl.transport\n"
        "assert 'plug-transport' not in streamrl.transport.available()\n"
        "assert 'plug-store' not in streamrl.storage.available()\n"
        "assert 'plug-reverse' not in streamrl.sampling.available()\n")],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
