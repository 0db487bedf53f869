"""The ``Examples:`` blocks of streamrl's docstrings are run, so they cannot go stale.

Every module of the package is searched (``doctest.DocTestFinder``: each object's own
docstring, in the module that defines it); each docstring with examples is one test.
Examples run with ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``, in a copy of their module's
globals, in a plain thread with no event loop (so ``asyncio.run(main())`` works).

:data:`MUST_HAVE_EXAMPLES` lists the public API whose docstrings must carry a runnable
example; a new public class or function belongs there once it has one. Examples are
meant to be fast (a queue of a few rows, in process); the Ray transport's examples live
in the docs (see ``tests/test_docs_snippets.py``), not here.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import streamrl

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

#: modules not searched: ``__main__`` is a command line, nothing to import for docs
SKIP_MODULES = {"streamrl.__main__"}


def _modules() -> list[str]:
    names = ["streamrl"]
    for info in pkgutil.walk_packages(streamrl.__path__, "streamrl."):
        if info.name not in SKIP_MODULES:
            names.append(info.name)
    return sorted(names)


def _doctests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    out: dict[str, doctest.DocTest] = {}
    for name in _modules():
        if name.startswith("streamrl.transport.ray"):
            try:
                import ray  # noqa: F401
            except ImportError:  # the Ray transport's modules need ray to import
                continue
        mod = importlib.import_module(name)
        for test in finder.find(mod, name):
            if test.examples:
                out.setdefault(test.name, test)
    return [out[k] for k in sorted(out)]


DOCTESTS = _doctests()


@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
def test_docstring_examples(test: doctest.DocTest) -> None:
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    try:
        result = runner.run(test, out=report.append, clear_globs=True)
    finally:
        test.globs.clear()
    if result.failed:
        pytest.fail(f"{result.failed} of {result.attempted} examples of {test.name} "
                    f"failed:\n{''.join(report)}", pytrace=False)


#: the public API whose docstrings carry a runnable ``Examples:`` block (TorchRL style:
#: Args, Keyword Args, Examples)
MUST_HAVE_EXAMPLES = [
    "streamrl.queue.StreamQueue",
    "streamrl.queue.StreamQueue.from_config",
    "streamrl.queue.StreamQueue.timed",
    "streamrl.queue.Stream",
    "streamrl.batch.RowRemoteBatch",
    "streamrl.batch.ColumnRemoteBatch",
    "streamrl.batch.BatchProxy",
    "streamrl.stats.Stats",
    "streamrl.sync",
    "streamrl.sync.StreamQueue",
    "streamrl.config",
    "streamrl.filters.zero_variance",
    "streamrl.filters.max_length",
    "streamrl.filters.predicate",
    "streamrl.sampling",
    "streamrl.sampling.FifoSampler",
    "streamrl.sampling.PrioritySampler",
    "streamrl.sampling.register",
    "streamrl.storage.memory.StorageUnit",
    "streamrl.storage.spill.SpillUnit",
    "streamrl.storage.registry.register",
    "streamrl.transport.registry.register",
    "streamrl.codec.encode",
]


def test_public_api_has_examples() -> None:
    have = {t.name for t in DOCTESTS}
    missing = [name for name in MUST_HAVE_EXAMPLES if name not in have]
    assert not missing, f"public docstrings without a runnable Examples block: {missing}"
