"""A Griffe extension used by the docs build (mkdocs.yml -> mkdocstrings -> extensions).

streamrl's docstrings are Google style, but cross-references in them use Sphinx roles
(``:class:`~streamrl.errors.QueueFull```, ``:meth:`declare```) and the codec module uses
reStructuredText simple tables. mkdocstrings renders docstrings as Markdown, where those
would show up as literal text. This extension rewrites them once the package is loaded:

* a role becomes an *optional* mkdocs-autorefs cross-reference: a link when the target is
  documented in the site, plain code otherwise (never a build warning). Targets are
  resolved like Sphinx would: absolute (``streamrl.StreamQueue`` follows the package's
  lazy re-exports to ``streamrl.queue.StreamQueue``), or relative to the documented
  object, its class and its module (``:meth:`declare``` inside ``StreamQueue``);
* an RST simple table (``====  ====`` rulers) becomes a Markdown table;
* an attribute without a docstring gets the Sphinx-style ``#:`` comment above it, if any.

The source files are not touched; only the docstrings Griffe hands to mkdocstrings.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(class|meth|func|mod|attr|exc|data|obj|const):`(~?)([^`<>]+?)`")
_RULER = re.compile(r"^(\s*)(=+)((?:\s+=+)+)\s*$")


class SphinxRoles(griffe.Extension):
    """Turn Sphinx roles into autorefs and RST simple tables into Markdown tables."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._pkg = pkg
        self._walk(pkg, set())

    # ------------------------------------------------------------------ traversal

    def _walk(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is None and obj.is_attribute:
            comment = _comment_doc(obj)
            if comment:
                obj.docstring = griffe.Docstring(comment, parent=obj)
        if obj.docstring is not None:
            text = _tables(obj.docstring.value)
            obj.docstring.value = _ROLE.sub(lambda m: self._ref(obj, m), text)
        for member in list(obj.members.values()):
            if member.is_alias:
                continue
            self._walk(member, seen)

    # ------------------------------------------------------------------ roles

    def _ref(self, obj: griffe.Object, m: re.Match) -> str:
        kind, tilde, target = m.group(1), m.group(2), m.group(3).strip()
        target = target.lstrip(".")
        title = target.rsplit(".", 1)[-1] if tilde else target
        if kind in ("meth", "func"):
            title += "()"
        ident = self._resolve(obj, target) or target
        return (f'<autoref identifier="{html.escape(ident)}" optional>'
                f"<code>{html.escape(title)}</code></autoref>")

    def _lookup(self, path: str) -> str | None:
        """The canonical path of ``path`` in the package (following aliases), or None."""
        root, _, rest = path.partition(".")
        if root != self._pkg.name:
            return None
        node: Any = self._pkg
        for part in rest.split(".") if rest else []:
            try:
                if node.is_alias:
                    node = node.final_target
                node = node.members[part]
            except Exception:
                return self._lazy(path)
        try:
            if node.is_alias:
                node = node.final_target
        except Exception:
            return None
        return node.path

    def _lazy(self, path: str) -> str | None:
        """``streamrl.Name[.rest]`` for names the package re-exports lazily."""
        parts = path.split(".")
        if len(parts) < 2 or parts[0] != self._pkg.name:
            return None
        for mod in self._pkg.modules.values():
            member = mod.members.get(parts[1])
            if member is not None and not member.is_alias:
                canon = ".".join([member.path, *parts[2:]])
                return canon if canon != path and self._lookup(canon) else None
        return None

    def _resolve(self, obj: griffe.Object, target: str) -> str | None:
        if target.startswith(self._pkg.name + "."):
            return self._lookup(target)
        scope: Any = obj
        while scope is not None:
            found = self._lookup(f"{scope.path}.{target}")
            if found:
                return found
            scope = scope.parent
        return None


# ---------------------------------------------------------------------- #: comments


def _comment_doc(obj: griffe.Object) -> str | None:
    """The Sphinx-style ``#:`` comment lines right above an attribute, as its docstring."""
    try:
        lines = obj.lines_collection[obj.filepath]
    except Exception:
        return None
    i = (obj.lineno or 0) - 2  # the line above the assignment (0-based)
    out: list[str] = []
    while i >= 0 and lines[i].lstrip().startswith("#:"):
        out.insert(0, lines[i].lstrip()[2:].strip())
        i -= 1
    return " ".join(out) or None


# ---------------------------------------------------------------------- tables


def _tables(text: str) -> str:
    """Convert reStructuredText simple tables to Markdown tables."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _RULER.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        # a table: ruler, header row(s), ruler, body rows, ruler
        indent = m.group(1)
        cols = [(s.start(), s.end()) for s in re.finditer(r"=+", lines[i])]
        rulers = 1
        rows: list[list[str]] = []
        header: list[str] | None = None
        j = i + 1
        while j < len(lines) and rulers < 3:
            if _RULER.match(lines[j]):
                rulers += 1
                if rulers == 2:
                    header, rows = (rows[0] if rows else None), []
                j += 1
                continue
            line = lines[j]
            cells = []
            for k, (a, _b) in enumerate(cols):
                end = cols[k + 1][0] if k + 1 < len(cols) else len(line)
                cells.append(line[a:end].strip())
            rows.append(cells)
            j += 1
        if rulers < 3 or header is None:
            out.append(lines[i])
            i += 1
            continue
        out.append("")
        out.append(indent + "| " + " | ".join(header) + " |")
        out.append(indent + "|" + "|".join("---" for _ in header) + "|")
        for r in rows:
            out.append(indent + "| " + " | ".join(c.replace("|", "\\|") for c in r) + " |")
        out.append("")
        i = j
    return "\n".join(out)
