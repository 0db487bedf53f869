"""Run a recipe of the docs (a ```python block after ``<!-- recipe: NAME -->``) as a
module of its own, from outside the package, and return that module."""

from __future__ import annotations

import pathlib
import re
import types

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def load_recipe(page: str, name: str) -> types.ModuleType:
    text = (DOCS / page).read_text()
    m = re.search(rf"<!-- recipe: {name} -->\n```python\n(.*?)```", text, re.S)
    assert m, f"no recipe {name!r} in docs/{page}"
    mod = types.ModuleType(f"recipe_{name}")
    exec(compile(m.group(1), f"docs/{page}", "exec"), mod.__dict__)
    return mod
