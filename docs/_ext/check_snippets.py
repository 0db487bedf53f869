"""Run the Python code blocks of README.md and the docs, to check them against the real API.

    python docs/_ext/check_snippets.py          # every runnable block (embedded transport)
    python docs/_ext/check_snippets.py --ray    # also the blocks marked <!-- test: ray -->
    python docs/_ext/check_snippets.py --ray deployment   # blocks of files whose path has it

The default test run does the same (``tests/test_docs_snippets.py``: one test per block,
the Ray ones marked ``ray`` and ``slow``), so CI checks every block.

Marker convention. Every fenced ```python block of ``README.md`` and ``docs/**/*.md`` runs
as a script of its own (a process of its own, this checkout's streamrl, a temporary
working directory), and must exit with status 0. A block that does not start Ray runs
in a process forked from one that imported :data:`PRELOAD` and nothing else (Python's
``forkserver``): it finds those modules imported, not its names defined, and pays
neither their import (about 1.6 s a block here) nor a fresh interpreter's start; its
``atexit`` handlers run when it ends, and the process waits for its threads, as an
interpreter's exit does. An HTML comment on the line right before
the fence changes that (it does not show in rendered Markdown):

- ``<!-- test: skip -->``: a fragment (names defined elsewhere, a cluster address...): not run;
- ``<!-- test: ray -->``: starts Ray: run with ``--ray`` (and in the test run, when Ray is
  installed), after a prelude that starts a local Ray on loopback with 2 CPUs.

Any other ``test:`` word is an error, so a typo cannot silently skip a block. Blocks in
other languages (```bash, ```text...) are never run. Exit status 1 when a block fails.
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing
import os
import pathlib
import re
import runpy
import subprocess
import sys
import tempfile

DOCS = pathlib.Path(__file__).resolve().parent.parent
ROOT = DOCS.parent
BLOCK = re.compile(r"(?:<!-- test: ([\w-]+) -->\n)?```python\n(.*?)```", re.S)
TAGS = ("run", "skip", "ray")
RAY_PRELUDE = ('import ray\nray.init(address="local", num_cpus=2, include_dashboard=False, '
               '_node_ip_address="127.0.0.1")\n')
#: the prelude that joins a running cluster instead (``run(..., ray_address=...)``): the
#: test run's own, so that each Ray block does not start one (about 8 s a block here)
RAY_JOIN = 'import ray\nray.init(address={!r}, _node_ip_address="127.0.0.1")\n'

#: seconds one block may take (a Ray block starts a cluster)
TIMEOUT = 300
#: what the process each non-Ray block is forked from has imported (see the docstring)
PRELOAD = ("numpy", "torch", "tensordict", "streamrl")
_forks: list = []  # the forkserver context, once made


@dataclasses.dataclass(frozen=True)
class Block:
    path: pathlib.Path  #: the Markdown file
    index: int  #: its position among the file's python blocks
    line: int  #: line of the opening fence
    tag: str  #: "run", "skip" or "ray" (see the module docstring)
    code: str

    @property
    def name(self) -> str:
        """``file block i`` (the file relative to the repository root)."""
        return f"{self.path.relative_to(ROOT).as_posix()} block {self.index}"


def sources() -> list[pathlib.Path]:
    """README.md and every Markdown file under docs/."""
    return [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))


def blocks() -> list[Block]:
    """Every python block of :func:`sources`. Raises ValueError on an unknown marker."""
    out = []
    for md in sources():
        text = md.read_text()
        for i, m in enumerate(BLOCK.finditer(text)):
            tag = m.group(1) or "run"
            line = text.count("\n", 0, m.start(2))
            if tag not in TAGS:
                raise ValueError(f"{md.relative_to(ROOT)}:{line}: unknown snippet marker "
                                 f"<!-- test: {tag} -->; use one of {', '.join(TAGS)}")
            out.append(Block(md, i, line, tag, m.group(2)))
    return out


def _forked() -> tuple:
    """The forkserver context and the function a forked process runs (``_exec`` of this
    file imported as the module ``check_snippets``, which the forked processes import by
    that name, whatever name the caller loaded it under)."""
    if not _forks:
        for d in (str(DOCS / "_ext"), str(ROOT)):  # (ROOT: this checkout's streamrl)
            if d not in sys.path:
                sys.path.insert(0, d)
        import check_snippets

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        _forks.append((ctx, check_snippets._exec))
    return _forks[0]


def _exec(script: str, out: str) -> None:
    """Run ``script`` as ``__main__`` in this (forked) process, its output to ``out``."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(os.path.dirname(script))
    os.environ.update({"RAY_ADDRESS": "", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    sys.argv = [script]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


def _run_forked(script: pathlib.Path) -> tuple[bool, str]:
    out = script.with_suffix(".out")
    ctx, target = _forked()
    p = ctx.Process(target=target, args=(str(script), str(out)))
    p.start()
    p.join(TIMEOUT)
    if p.exitcode is None:
        p.kill()
        p.join()
        return False, f"timed out after {TIMEOUT}s"
    text = out.read_text() if out.exists() else ""
    return p.exitcode == 0, text[-2000:]


def run(block: Block, tmp: pathlib.Path, ray_address: str | None = None) -> tuple[bool, str]:
    """Run ``block`` as a script in directory ``tmp``: (passed, the end of its output).
    ``ray_address``: a Ray block joins that cluster (its GCS address) instead of starting
    one of its own. A Ray block runs in a fresh interpreter, any other in a forked
    process (see the module docstring)."""
    script = tmp / f"{block.path.stem}_{block.index}.py"
    prelude = ""
    if block.tag == "ray":
        prelude = RAY_PRELUDE if ray_address is None else RAY_JOIN.format(ray_address)
    script.write_text(prelude + block.code)
    if block.tag != "ray":
        return _run_forked(script)
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           # this checkout's streamrl, whichever one is installed
           "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
    try:
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             timeout=TIMEOUT, cwd=tmp, env=env)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {TIMEOUT}s"
    return out.returncode == 0, out.stderr[-2000:]


def main(argv: list[str]) -> int:
    with_ray = "--ray" in argv
    only = [a for a in argv if not a.startswith("--")]
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for block in blocks():
            if block.tag == "skip" or (block.tag == "ray" and not with_ray):
                continue
            if only and not any(s in block.name for s in only):
                continue
            ok, detail = run(block, pathlib.Path(tmp))
            print(("ok    " if ok else "FAIL  ") + block.name, flush=True)
            if not ok:
                failed += 1
                print(detail)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
