"""The Python blocks of README.md and docs/ run, each as a script of its own.

The blocks and their markers (``<!-- test: skip -->``, ``<!-- test: ray -->``) are those
of ``docs/_ext/check_snippets.py``, whose docstring states the convention; this runs the
same checker inside the default test run. Blocks that start Ray are marked ``ray`` and
``slow`` (deselect with ``-m "not slow"``) and need Ray installed.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "docs" / "_ext" / "check_snippets.py"
_spec = importlib.util.spec_from_file_location("streamrl_docs_check_snippets", _PATH)
assert _spec is not None and _spec.loader is not None
snippets = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = snippets  # (its dataclass looks its module up there)
_spec.loader.exec_module(snippets)

BLOCKS = [b for b in snippets.blocks() if b.tag != "skip"]


def _param(block):
    marks = [pytest.mark.timeout(snippets.TIMEOUT + 60)]
    if block.tag == "ray":
        marks += [pytest.mark.ray, pytest.mark.slow]
    return pytest.param(block, id=block.name, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_doc_snippet(block, tmp_path, request):
    address = None
    if block.tag == "ray":
        pytest.importorskip("ray")
        # the block joins the test run's Ray rather than start its own (~8 s a block)
        address = request.getfixturevalue("ray_session").get_runtime_context().gcs_address
    ok, detail = snippets.run(block, tmp_path, address)
    assert ok, f"{block.name} (line {block.line} of {block.path.name}) failed:\n{detail}"


@pytest.mark.parametrize("code, ok, says", [
    ("import torch\nprint(torch.zeros(2).sum().item())\n", True, "0.0"),
    ("import torch\nraise ValueError('boom')\n", False, "ValueError: boom"),
    ("print(torch.zeros(1))\n", False, "NameError"),  # (preloaded, but not its name)
    ("import sys\nsys.exit(3)\n", False, ""),
    ("import asyncio, streamrl\nasync def main():\n    async with streamrl.StreamQueue() as q:\n"
     "        await q.put({'x': [1]})\n        raise RuntimeError((await q.stats()).rows)\n"
     "asyncio.run(main())\n", False, "RuntimeError: 1"),
])
def test_a_block_passes_or_fails_as_a_script_would(tmp_path, code, ok, says):
    """The checker itself (a non-Ray block runs in a forked process): a block passes only
    when it exits with status 0, a name it did not import is an error even where the
    module was preloaded, and its output (a traceback) comes back."""
    block = snippets.Block(pathlib.Path(snippets.ROOT / "docs" / "x.md"), 0, 1, "run", code)
    got, detail = snippets.run(block, tmp_path)
    assert got is ok and says in detail, detail


def test_readme_quick_start_is_checked():
    # the README's first block is the quick start: it runs, it is not skipped
    readme = [b for b in snippets.blocks() if b.path.name == "README.md"]
    assert readme and readme[0].tag == "run"


def test_unknown_marker_is_an_error(tmp_path, monkeypatch):
    md = tmp_path / "page.md"
    md.write_text("<!-- test: skpi -->\n```python\nraise SystemExit(1)\n```\n")
    monkeypatch.setattr(snippets, "ROOT", tmp_path)
    monkeypatch.setattr(snippets, "sources", lambda: [md])
    with pytest.raises(ValueError, match="unknown snippet marker"):
        snippets.blocks()


def test_the_architecture_page_lists_every_module():
    """docs/architecture.md's module table names every module of the package: in the
    first column, or (for a package row such as `transport/ray/`) in its description."""
    import re

    repo = _PATH.parents[2]
    root = repo / "streamrl"
    text = (repo / "docs" / "architecture.md").read_text()
    table = text[text.index("## Modules"):text.index("## The path of one row")]
    listed = set()
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        head, desc = line.split("|")[1:3]
        for name in re.findall(r"`([\w/.]+)`", head):
            name = name.removeprefix("streamrl/")
            listed.add(name)
            if name.endswith("/"):
                listed.add(name + "__init__.py")
                listed.update(name + m for m in re.findall(r"`(\w+\.py)`", desc))
    modules = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    assert [m for m in modules if m not in listed] == []
