"""The layering ARCHITECTURE.md draws is the code's: every import of a foresight module points down (or stays in
its own package), no two packages import each other, and an import inside a function says why it is there.

Each module under python/foresight is parsed (ast, nothing imported), mapped to its layer, and every import of a
foresight module in it is checked:

(a) the imported module's layer is not above the importer's (and two packages of one layer do not import each
    other: io and media are siblings);
(b) the graph of packages (arrows: top-level and in-function imports alike) has no cycle;
(c) an import inside a function carries ``# lazy: <reason>`` on its line: an optional heavy dependency (torch,
    pyarrow.flight, PyAV, safetensors) or a CLI's ``--help`` kept fast. Never to dodge a cycle.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "foresight"

#: Bottom to top. A module may import its own package and the layers below; the root package ``foresight`` (its
#: ``__version__`` and lazy attribute table, no imports of its own) counts as base.
LAYERS: list[set[str]] = [
    {"", "errors", "checksum", "_native", "_closing", "distributed", "_core", "_uring"},
    {"io", "media"},
    {"format"},
    {"bucket"},
    {"plan"},
    {"source"},
    {"loader"},
    {"checkpoint"},
    {"cluster"},
    {"replication"},
    {"node"},
    {"cli", "demo", "__main__", "testing"},
]
#: Groups whose members may import each other (one room split into modules); other same-layer pairs may not.
SHARED = ({"", "errors", "checksum", "_native", "_closing", "distributed", "_core", "_uring"},
          {"cli", "demo", "__main__", "testing"})
#: Who may import the test beds (foresight.testing): nothing on a user's code path.
TESTING_USERS = {"cli", "demo", "__main__", "testing"}

#: foresight's own submodules and packages (sources and built extensions alike).
SUBMODULES = {p.name.split(".")[0] for p in PACKAGE.iterdir() if p.suffix in (".py", ".so") or p.is_dir()}


def _layer_of(package: str) -> int:
    if package.startswith("_") and not package.startswith("__"):
        package = "_native"  # private top-level modules: native bindings (_core, _uring, the Cython kernels), helpers
    for i, members in enumerate(LAYERS):
        if package in members:
            return i
    raise AssertionError(f"package foresight.{package} has no layer in tests/test_layers.py (add it, and to "
                         "ARCHITECTURE.md's picture)")


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str | None = None):
    """(target module, line, in_function, source line) for each import of a foresight module in ``path``
    (``module``: its dotted name, by default from its place under python/)."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source, str(path))
    module = module or _module_name(path)
    is_package = path.name == "__init__.py"
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # "from foresight import errors" imports foresight.errors, "from foresight import __version__" the
            # root; "from foresight.x import name" foresight.x
            targets = [f"{target}.{a.name}" if target == "foresight" and a.name in SUBMODULES else target
                       for a in node.names]
        else:
            continue
        for t in targets:
            if t == "foresight" or t.startswith("foresight."):
                yield t, node.lineno, id(node) in in_function, lines[node.lineno - 1]


def _all_imports():
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        for target, line, in_function, text in _imports(path):
            out.append((path.relative_to(PACKAGE).as_posix(), module, target, line, in_function, text))
    return out


def up_arrows(imports) -> list[str]:
    bad = []
    for rel, module, target, line, _, text in imports:
        a, b = _package(module), _package(target)
        if a == b:
            continue
        la, lb = _layer_of(a), _layer_of(b)
        same_room = any(a in g and b in g for g in SHARED)
        if lb > la or (lb == la and not same_room):
            bad.append(f"{rel}:{line}: {a or 'foresight'} (layer {la}) imports {b} (layer {lb}): {text.strip()}")
        if b == "testing" and a not in TESTING_USERS:
            bad.append(f"{rel}:{line}: only the CLI and the demo import foresight.testing: {text.strip()}")
    return bad


def package_cycles(imports) -> list[str]:
    graph: dict[str, set[str]] = defaultdict(set)
    for _, module, target, *_ in imports:
        a, b = _package(module), _package(target)
        if a != b:
            graph[a].add(b)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    return sorted({" <-> ".join(sorted((a, b))) for a in list(graph) for b in graph[a] if reaches(b, a)})


def unexplained_lazy(imports) -> list[str]:
    return [f"{rel}:{line}: {text.strip()}" for rel, _, _, line, in_function, text in imports
            if in_function and "# lazy:" not in text]


IMPORTS = _all_imports()


def test_the_package_is_found():
    assert len(IMPORTS) > 100 and any(m == "foresight.node.server" for _, m, *_ in IMPORTS)


def test_no_import_points_up():
    bad = up_arrows(IMPORTS)
    assert not bad, "imports against the layering (tests/test_layers.py, ARCHITECTURE.md):\n" + "\n".join(bad)


def test_no_cycle_between_packages():
    cycles = package_cycles(IMPORTS)
    assert not cycles, f"packages that import each other: {cycles}"


def test_imports_inside_functions_say_why():
    bad = unexplained_lazy(IMPORTS)
    assert not bad, ("imports inside functions without '# lazy: <reason>' (move them to the top; a cycle is "
                     "fixed by moving code to its layer, never by a late import):\n" + "\n".join(bad))


def test_the_checks_catch_what_they_are_for(tmp_path):
    """A format module reaching up to bucket (in a function, unexplained) and a bucket module importing format:
    one arrow up, one cycle, one unexplained late import; a relative import resolves to its package."""
    up = tmp_path / "up.py"
    up.write_text("from . import types\n\n\ndef f():\n    from foresight.bucket import cache\n"
                  "    from foresight import errors  # lazy: a reason\n")
    down = tmp_path / "down.py"
    down.write_text("from foresight.format import reader\nfrom ..io import arena\n")
    imports = [("up.py", "foresight.format.up", *i) for i in _imports(up, "foresight.format.up")]
    imports += [("down.py", "foresight.bucket.down", *i) for i in _imports(down, "foresight.bucket.down")]
    assert [t for _, _, t, *_ in imports] == ["foresight.format", "foresight.bucket", "foresight.errors",
                                             "foresight.format", "foresight.io"]
    assert [b.split(":")[0] for b in up_arrows(imports)] == ["up.py"]
    assert package_cycles(imports) == ["bucket <-> format"]
    assert [b.split(":")[:2] for b in unexplained_lazy(imports)] == [["up.py", "5"]]
