"""The layering rule of docs/internals.md ("Layers"): an import runs down the layers or
across one, never up, and no import closes a circle. Checked, without building anything,
on python/rsccl (every `import`, lazy ones included) and on rust/core/src (every `use`, and
every `crate::`/`super::` path in code, resolved through re-exports to the module that
defines the name).

The layer tables are read from docs/internals.md; a module that no row names fails, so a
new module is placed there first. `python tests/test_layering.py` prints the module graphs'
upward arrows and circles.

Files are the nodes. A module's arrows to modules inside it (a folder's mod.rs declaring or
re-exporting its children) are containment, not imports, and are not counted; a child's
arrows to its parent (`super::Shared`) are.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "internals.md"
PY_ROOT = ROOT / "python" / "rsccl"
RS_ROOT = ROOT / "rust" / "core" / "src"

# Upward arrows and circles that stand until a named change removes them. Each entry says
# why it is here and what removes it; the test fails when one is no longer seen, so the
# list only shrinks.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    # (from file, to file), as the graphs name them. None stand: the last ones went with
    # issue 29 item 1 (each engine translates the op record itself).
}
ALLOWED_CIRCLES: dict[frozenset[str], str] = {}


# ---- the layer tables ---------------------------------------------------------------------


def read_layers(tree: str) -> list[list[str]]:
    """The rows of the table under docs/internals.md's "### Layers of `tree`", lowest first:
    each row's second cell lists its modules in backticks."""
    text = DOC.read_text()
    head = f"### Layers of `{tree}`"
    assert head in text, f"docs/internals.md has no section {head!r}"
    rows = []
    for line in text.split(head, 1)[1].splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and cells[0].isdigit():
            assert int(cells[0]) == len(rows) + 1, f"{head}: layer {cells[0]} out of order"
            rows.append(re.findall(r"`([^`]+)`", cells[1]))
    assert rows, f"{head}: no rows"
    return rows


def layer_of(module: str, layers: list[list[str]], sep: str) -> tuple[int, str] | None:
    """(layer, room): the longest name in the tables that is `module` or a folder above it."""
    best: tuple[int, str] | None = None
    for k, room_names in enumerate(layers):
        for room in room_names:
            if (module == room or module.startswith(room + sep)) and (best is None or len(room) > len(best[1])):
                best = (k, room)
    return best


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def violations(graph: dict[str, set[str]], layers: list[list[str]], sep: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(modules no table names, upward arrows)."""
    unplaced = sorted(m for m in graph if layer_of(m, layers, sep) is None)
    upward = []
    for a, targets in sorted(graph.items()):
        la = layer_of(a, layers, sep)
        for b in sorted(targets):
            lb = layer_of(b, layers, sep)
            if la and lb and lb[0] > la[0]:
                upward.append((a, b))
    return unplaced, upward


# ---- python/rsccl ---------------------------------------------------------------------------


def python_modules() -> dict[str, Path]:
    """Module name inside the package ("_backend", "bench.cuda.config"; "__init__" for the
    package itself, "bench" for bench/__init__.py) -> its file; the extension by its stub."""
    mods = {}
    for p in sorted(PY_ROOT.rglob("*.py")) + [PY_ROOT / "_rsccl.pyi"]:
        parts = list(p.relative_to(PY_ROOT).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts.pop()
        mods[".".join(parts)] = p
    return mods


def python_graph() -> dict[str, set[str]]:
    mods = python_modules()

    def known(name: str) -> str | None:
        """The module of an absolute name inside the package: itself, or the nearest above."""
        while name:
            if name in mods:
                return name
            name = name.rpartition(".")[0]
        return None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        if path.suffix == ".pyi":
            continue
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        if mod == "__init__":
            package = ""
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    stem = ".".join(base + ([node.module] if node.module else []))
                    targets = [f"rsccl.{stem}" if stem else "rsccl"]
                else:
                    targets = [node.module or ""]
                targets = [f"{targets[0]}.{a.name}" for a in node.names]
            for t in targets:
                if t == "rsccl" or t.startswith("rsccl."):
                    inner = t.removeprefix("rsccl").lstrip(".")
                    hit = known(inner) or "__init__"
                    if hit != mod:
                        graph[mod].add(hit)
    return graph


# ---- rust/core/src --------------------------------------------------------------------------

_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|::|[{}();,*!]|\S")
_ITEM_KEYWORDS = {"fn", "struct", "enum", "trait", "type", "const", "static", "union", "mod"}


def rust_strip(src: str) -> str:
    """Source without comments and with string and char literals emptied (newlines kept)."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if src.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif src.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    out.append("\n" if src[i] == "\n" else "")
                    i += 1
        elif m := re.match(r'b?r(#*)"', src[i:]):
            end = src.find('"' + m.group(1), i + len(m.group(0)))
            out.append(" " + '""' + "\n" * src.count("\n", i, end))
            i = end + 1 + len(m.group(1))
        elif c == '"' or (c == "b" and src.startswith('b"', i)):
            j = i + (2 if c == "b" else 1)
            while src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append('""' + "\n" * src.count("\n", i, j))
            i = j + 1
        elif c == "'" and (m := re.match(r"'(\\.[^']*|[^\\'])'", src[i:])):
            out.append("' '")
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _use_paths(toks: list[str], prefix: list[str]) -> Iterable[tuple[list[str], str | None, bool]]:
    """(path, bound name or None, glob) for each leaf of a use tree's tokens."""
    path, i = list(prefix), 0
    while i < len(toks):
        t = toks[i]
        if t == "::":
            i += 1
        elif t == "{":
            depth, j, start, parts = 1, i + 1, i + 1, []
            while depth:
                if toks[j] == "{":
                    depth += 1
                elif toks[j] == "}":
                    depth -= 1
                if (toks[j] == "," and depth == 1) or depth == 0:
                    parts.append(toks[start:j])
                    start = j + 1
                j += 1
            for part in parts:
                if part:
                    yield from _use_paths(part, path)
            return
        elif t == "*":
            yield path, None, True
            return
        elif t == "as":
            yield path, toks[i + 1], False
            return
        elif t == "self" and i == 0 and prefix:
            yield path, path[-1], False
            return
        else:
            path.append(t)
            i += 1
    if path:
        yield path, path[-1], False


class RustModule:
    def __init__(self, name: str, file: str):
        self.name, self.file = name, file
        self.children: set[str] = set()
        self.defined: set[str] = set()
        self.bindings: dict[str, list[str]] = {}
        self.globs: list[list[str]] = []
        self.refs: list[list[str]] = []  # every use path and code path, as written


def rust_modules() -> dict[str, RustModule]:
    """Every module of rust/core/src (inline ones included) by its path ("" is the crate)."""
    mods: dict[str, RustModule] = {}
    for p in sorted(RS_ROOT.rglob("*.rs")):
        parts = list(p.relative_to(RS_ROOT).with_suffix("").parts)
        if parts[-1] in ("mod", "lib"):
            parts.pop()
        name = "::".join(parts)
        mods[name] = RustModule(name, name or "crate")
    for p in sorted(RS_ROOT.rglob("*.rs")):
        parts = list(p.relative_to(RS_ROOT).with_suffix("").parts)
        if parts[-1] in ("mod", "lib"):
            parts.pop()
        _scan_rust(mods, "::".join(parts), rust_strip(p.read_text()))
    for name in mods:
        if name:
            mods[name.rpartition("::")[0]].children.add(name.rpartition("::")[2])
    return mods


def _scan_rust(mods: dict[str, RustModule], file_mod: str, text: str) -> None:
    toks = _TOKEN.findall(text)
    scopes: list[str | None] = []  # module name for `mod x {`, None for any other block
    pending_mod: str | None = None

    def here() -> RustModule:
        inline = [s for s in scopes if s is not None]
        return mods[_join(file_mod, *inline)] if inline else mods[file_mod]

    at_module_level = lambda: all(s is not None for s in scopes)
    i = 0
    while i < len(toks):
        t = toks[i]
        if t == "{":
            scopes.append(pending_mod)
            if pending_mod is not None:
                full = _join(file_mod, *[s for s in scopes if s is not None])
                mods.setdefault(full, RustModule(full, file_mod or "crate"))
            pending_mod = None
        elif t == "}":
            scopes.pop()
        elif t == ";":
            pending_mod = None
        elif t == "use" and (i == 0 or toks[i - 1] != "::"):
            j = toks.index(";", i)
            m = here()
            for path, bound, glob in _use_paths(toks[i + 1 : j], []):
                m.refs.append(path)
                if at_module_level():
                    if glob:
                        m.globs.append(path)
                    elif bound:
                        m.bindings[bound] = path
            i = j
        elif t in ("crate", "super", "self") and i + 2 < len(toks) and toks[i + 1] == "::" and toks[i - 1] not in ("::", "in"):
            path, j = [t], i + 1
            while j + 1 < len(toks) and toks[j] == "::" and re.match(r"\w", toks[j + 1]):
                path.append(toks[j + 1])
                j += 2
            here().refs.append(path)
            i = j - 1
        elif t in _ITEM_KEYWORDS and at_module_level() and i + 1 < len(toks):
            k = i + 1
            while toks[k] in _ITEM_KEYWORDS or toks[k] in ("unsafe", "extern"):
                k += 1
            if re.match(r"[A-Za-z_]\w*$", toks[k]):
                here().defined.add(toks[k])
                if t == "mod":
                    pending_mod = toks[k]
        elif t == "macro_rules" and toks[i + 1] == "!":
            here().defined.add(toks[i + 2])
        i += 1


def _join(*parts: str) -> str:
    return "::".join(p for p in parts if p)


def _parent(name: str) -> str:
    return name.rpartition("::")[0] if "::" in name else ""


def rust_resolve(mods: dict[str, RustModule], at: str, path: list[str], seen: frozenset = frozenset()) -> tuple[str, bool] | None:
    """(module, whole path is that module) for a path written in module `at`; None outside the crate."""
    if (at, tuple(path)) in seen:
        return None
    seen = seen | {(at, tuple(path))}
    head, rest = path[0], path[1:]
    if head == "crate":
        start = ""
    elif head in ("self", "super"):
        start = at
        while rest is not None and head == "super":
            start = _parent(start)
            head, rest = (rest[0], rest[1:]) if rest and rest[0] == "super" else ("", rest)
    elif head in mods[at].children or head in mods[at].bindings or head in mods[at].defined:
        start, rest = at, path
    else:
        return None  # another crate
    return _walk(mods, start, rest, seen)


def _walk(mods: dict[str, RustModule], mod: str, segs: list[str], seen: frozenset) -> tuple[str, bool] | None:
    if not segs:
        return mod, True
    s, m = segs[0], mods[mod]
    if s in m.children:
        return _walk(mods, _join(mod, s), segs[1:], seen)
    if s in m.defined:
        return mod, False
    if s in m.bindings:
        hit = rust_resolve(mods, mod, m.bindings[s], seen)
        if hit is None:
            return None
        return _walk(mods, hit[0], segs[1:], seen) if hit[1] else hit
    for g in m.globs:
        hit = rust_resolve(mods, mod, g, seen)
        if hit and hit[1]:
            gm = mods[hit[0]]
            if s in gm.children or s in gm.defined or s in gm.bindings:
                return _walk(mods, hit[0], segs, seen)
    return mod, False


def rust_graph() -> dict[str, set[str]]:
    """File -> files it imports from, by module path ("cuda::engine::status"; "crate": lib.rs)."""
    mods = rust_modules()
    graph: dict[str, set[str]] = {m.file: set() for m in mods.values()}
    for m in mods.values():
        for path in m.refs:
            hit = rust_resolve(mods, m.name, path)
            if hit is None:
                continue
            target = mods[hit[0]].file
            inside = target == m.file or m.file == "crate" or target.startswith(m.file + "::")
            if not inside:
                graph[m.file].add(target)
    return graph


# ---- the checks -----------------------------------------------------------------------------


def _report(graph: dict[str, set[str]], layers: list[list[str]], sep: str) -> tuple[list[str], list[tuple[str, str]], list[frozenset[str]]]:
    unplaced, upward = violations(graph, layers, sep)
    return unplaced, upward, circles(graph)


def _check(tree: str, graph: dict[str, set[str]], sep: str) -> None:
    unplaced, upward, found = _report(graph, read_layers(tree), sep)
    assert not unplaced, f"modules of {tree} that no row of docs/internals.md's layer table names: {unplaced}"
    allowed_up = {k for k in ALLOWED_UPWARD if k[0] in graph}
    bad_up = [e for e in upward if e not in allowed_up]
    assert not bad_up, f"{tree}: imports that run up the layers of docs/internals.md: " + ", ".join(f"{a} -> {b}" for a, b in bad_up)
    allowed_c = {k for k in ALLOWED_CIRCLES if next(iter(k)) in graph}
    bad_c = [sorted(c) for c in found if c not in allowed_c]
    assert not bad_c, f"{tree}: import circles (files that import each other, directly or around): {bad_c}"
    stale = sorted(allowed_up - set(upward)) + sorted(sorted(c) for c in allowed_c - set(found))  # type: ignore[arg-type]
    assert not stale, f"{tree}: allowed up-arrows or circles no longer seen; remove them from tests/test_layering.py: {stale}"


def test_python_package_imports_run_down_the_layers_without_circles():
    _check("python/rsccl", python_graph(), ".")


def test_rust_core_imports_run_down_the_layers_without_circles():
    _check("rust/core/src", rust_graph(), "::")


def test_the_checks_see_an_upward_import_and_a_circle():
    """The checker itself: an invented graph with one upward arrow and one circle."""
    layers = [["low"], ["mid", "side"], ["top"]]
    graph = {"top": {"mid"}, "mid": {"low", "side"}, "side": {"mid"}, "low": {"top"}, "low::x": set(), "stray": set()}
    unplaced, upward, found = _report(graph, layers, "::")
    assert unplaced == ["stray"]
    assert upward == [("low", "top")]
    assert sorted(sorted(c) for c in found) == [["low", "mid", "top"], ["mid", "side"]] or sorted(sorted(c) for c in found) == [
        ["low", "mid", "side", "top"]
    ]


def test_the_rust_reader_resolves_reexports_and_skips_comments_and_strings():
    src = 'use super::{a::{self, B}, c::*};\n// use crate::x;\nlet s = "crate::y::z"; /* crate::w */\nfn f() { crate::v::g(); }\nmod t { use super::*; }\n'
    text = rust_strip(src)
    assert "crate::x" not in text and "crate::y" not in text and "crate::w" not in text and "crate::v::g" in text
    mods = {n: RustModule(n, n) for n in ("", "p", "p::a", "p::c", "p::m", "v")}
    mods[""].children = {"p", "v"}
    mods["p"].children = {"a", "c", "m"}
    mods["p::a"].defined = {"B"}
    mods["p::c"].defined = {"D"}
    mods["v"].defined = {"g"}
    mods["p"].bindings = {"E": ["c", "D"]}  # `pub use c::D as E;` in p
    _scan_rust(mods, "p::m", text)
    assert mods["p::m"].refs[:3] == [["super", "a"], ["super", "a", "B"], ["super", "c"]]
    assert rust_resolve(mods, "p::m", ["super", "a", "B"]) == ("p::a", False)
    assert rust_resolve(mods, "p::m", ["super", "E"]) == ("p::c", False)
    assert rust_resolve(mods, "p::m", ["crate", "v", "g"]) == ("v", False)
    assert rust_resolve(mods, "p::m", ["std", "sync"]) is None
    assert "p::m::t" in mods and rust_resolve(mods, "p::m::t", ["super", "x"]) == ("p::m", False)


def main() -> None:
    for tree, graph, sep in (("python/rsccl", python_graph(), "."), ("rust/core/src", rust_graph(), "::")):
        unplaced, upward, found = _report(graph, read_layers(tree), sep)
        print(f"{tree}: {len(graph)} files, {sum(map(len, graph.values()))} arrows")
        print(f"  unplaced: {unplaced}")
        for a, b in upward:
            print(f"  up: {a} -> {b}{'  (allowed)' if (a, b) in ALLOWED_UPWARD else ''}")
        for c in found:
            print(f"  circle: {sorted(c)}{'  (allowed)' if c in ALLOWED_CIRCLES else ''}")
    if "-v" in sys.argv:
        for tree, graph in (("python", python_graph()), ("rust", rust_graph())):
            for a, bs in sorted(graph.items()):
                print(f"{tree} {a or '<crate>'} -> {', '.join(sorted(bs))}")


if __name__ == "__main__":
    main()
