"""The package's shape, checked on its source with `ast` (nothing is imported):

- no import cycle among kdump's modules, counting imports inside functions, under
  TYPE_CHECKING and by name (`importlib.import_module`, `__import__`, and the module names a
  module that imports by name lists in its strings);
- no import from a lower layer to a higher one, by the layer table below;
- no module over 800 lines and no function over 100 lines.

An import of `a.b.c` is an edge to the module `a.b.c` (its parent packages' `__init__` run too,
but a package's `__init__` here only names its modules lazily, so edges to parents would only
repeat the child's). `from pkg import name` is an edge to `pkg.name` where that is a module, and
to `pkg` otherwise.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kdump"

# Lower numbers are lower layers; a module may import from its own layer and those below. The
# longest matching prefix decides a module's layer.
LAYERS: dict[str, int] = {
    # the base: no kdump imports but each other
    "kdump._version": 0,
    "kdump.errors": 0,
    "kdump.config": 0,
    "kdump.text": 0,
    "kdump.log": 0,
    "kdump.progress": 0,
    # torch-free formats and the CUDA toolchain
    "kdump.format": 1,
    "kdump.cuda": 1,
    # bundles: the torch side of the format
    "kdump.bundle": 2,
    # kernel libraries as plug-ins, and the environment a bundle carries
    "kdump.kernels": 3,
    "kdump.envinfo": 4,
    # recording: hooks, triggers, the repeat key, the recorder protocol ...
    "kdump.record": 5,
    # ... the two recorders, and where they write (its index names the flight recorder's
    # announce files) ...
    "kdump.record.flight": 6,
    "kdump.record.sync": 6,
    "kdump.record.capture_dir": 6,
    # ... and what drives them in a process
    "kdump.record.session": 7,
    "kdump.record.one_call": 7,
    "kdump.record.startup": 8,
    "kdump.record._startup": 9,
    # replay, and what reads its results
    "kdump.replay": 10,
    "kdump.doctor": 11,
    "kdump.report": 11,
    # `kdump record`'s driver: runs the program, salvages, and checks what a replay can import
    "kdump.record.launcher": 11,
    # the user's entry points
    "kdump.cli": 12,
    "kdump.pytest_plugin": 12,
    "kdump.__main__": 13,
    "kdump": 13,  # the facade: `kdump.recording`, `kdump.load_bundle`, ...
}

MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 100
_MODULE_NAME = re.compile(r"kdump(\.[A-Za-z_]\w*)+")  # a dotted name: "kdump" alone is a word


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _known(name: str) -> str | None:
    """The kdump module an import of `name` runs (itself, or its nearest parent module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports_by_name(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if fname in ("import_module", "__import__"):
                return True
    return False


def _targets(name: str, path: Path, tree: ast.AST) -> Iterator[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                yield sub if sub in MODULES else mod
    if _imports_by_name(tree):
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value.split(":")[0]
                if _MODULE_NAME.fullmatch(text) and text in MODULES:
                    yield text


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        out = set()
        for t in _targets(name, path, tree):
            if t == "kdump" or t.startswith("kdump."):
                k = _known(t)
                if k and k != name:
                    out.add(k)
        edges[name] = out
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def layer_of(module: str) -> int:
    name = module
    while name:
        if name in LAYERS:
            return LAYERS[name]
        name = name.rpartition(".")[0]
    raise AssertionError(f"{module} has no layer: add it to LAYERS in {__file__}")


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_imports_go_down_the_layers() -> None:
    wrong = [
        f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
        for a, bs in sorted(_graph().items())
        for b in sorted(bs)
        if layer_of(b) > layer_of(a)
    ]
    assert not wrong, "imports from a lower layer to a higher one:\n" + "\n".join(wrong)


def test_module_and_function_sizes() -> None:
    big = []
    for name, path in sorted(MODULES.items()):
        text = path.read_text()
        n = len(text.splitlines())
        if n > MAX_MODULE_LINES:
            big.append(f"{name}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    big.append(f"{name}.{node.name} (line {node.lineno}): {length} lines")
    assert not big, "too large:\n" + "\n".join(big)


# The checker itself, on small made-up graphs: it must be able to fail.
def test_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize(
    ("module", "layer"),
    [
        ("kdump.record.flight.recorder", 6),
        ("kdump.record.session", 7),
        ("kdump.record.triggers", 5),
        ("kdump.format.records", 1),
        ("kdump", 13),
    ],
)
def test_layer_table_longest_prefix(module: str, layer: int) -> None:
    assert layer_of(module) == layer


def test_imports_by_name_are_edges() -> None:
    """The facade imports its lazy names by name: those count as edges."""
    assert "kdump.errors" in _graph()["kdump"]
