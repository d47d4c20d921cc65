"""The layout of src/splitrl: imports point down, so no two files import each other, directly or
through others (a circle means neither file can be read, tested or moved without the other).

Every module is parsed with ``ast`` (nothing is imported) and every import counts, including the
ones inside functions, since a deferred import is still a dependency. Exceptions, each with its
reason:

- imports under ``if TYPE_CHECKING:`` never run (annotations only) and do not count;
- ``from pkg import name`` counts as an import of ``pkg.name`` where that is a module of
  src/splitrl, else of ``pkg`` itself, i.e. of its ``__init__`` (so ``from splitrl.logging import
  plot`` depends on plot.py alone, ``from splitrl.logging import read_metrics`` on
  logging/__init__.py); ``import a.b.c`` counts as an import of ``a.b.c``;
- the parent packages' ``__init__`` files that Python runs on the way to a module are not counted:
  every module of a package would otherwise import its own ``__init__``.
"""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "splitrl"

# Circles still to be taken apart, each as the set of its modules. Only a circle of exactly these
# modules passes; remove an entry once its circle is gone.
ALLOWED_CYCLES: set[frozenset[str]] = set()


def _modules(root: Path) -> dict[str, Path]:
    """Module name -> file of every module of the package under ``root`` (packages by __init__)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree`` that can run (all but those under ``if TYPE_CHECKING:``)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, modules) -> list[str]:
    """The modules of the package that import statement ``node`` of module ``name`` imports."""
    if isinstance(node, ast.Import):
        wanted = [alias.name for alias in node.names]
    else:
        if node.level:  # relative: from the module's package, one level up per extra dot
            package = name if is_package else name.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{node.module}" if node.module else package
        else:
            base = node.module or ""
        wanted = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    out = []
    for target in wanted:
        if target.split(".")[0] != PACKAGE:
            continue
        while target and target not in modules:  # `import splitrl.x.y` of a name y in x: x
            target = target.rpartition(".")[0]
        if target and target != name:
            out.append(target)
    return out


def import_graph(root: Path = SRC) -> dict[str, dict[str, int]]:
    """module -> {imported module of the package: line of the first such import}."""
    modules = _modules(root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph[name] = {}
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            for target in _targets(node, name, path.name == "__init__.py", modules):
                edges.setdefault(target, node.lineno)
    return graph


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _a_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """One circle through the first module of ``component`` (a shortest one, by breadth-first search)."""
    members, first = set(component), component[0]
    paths = {first: [first]}
    queue = [first]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node]):
            if child == first:
                return paths[node] + [first]
            if child in members and child not in paths:
                paths[child] = paths[node] + [child]
                queue.append(child)
    raise AssertionError(f"no circle in {component}")


def _describe(graph: dict[str, dict[str, int]], component: list[str], root: Path) -> str:
    cycle = _a_cycle(graph, component)
    modules = _modules(root)
    steps = [
        f"    {a} -> {b}  ({modules[a].relative_to(root)}:{graph[a][b]})" for a, b in pairwise(cycle)
    ]
    return f"  {len(component)} modules: {', '.join(component)}\n" + "\n".join(steps)


def cycles(root: Path = SRC) -> list[str]:
    """A description of each circle of imports under ``root`` that ``ALLOWED_CYCLES`` does not allow."""
    graph = import_graph(root)
    return [
        _describe(graph, c, root) for c in _strongly_connected(graph) if frozenset(c) not in ALLOWED_CYCLES
    ]


def test_no_import_circle_between_files():
    found = cycles()
    assert not found, "import circles in src/splitrl (make one side import the other only):\n" + "\n".join(found)


def test_models_do_not_import_the_loss():
    """The model computes logits and logprobs; losses are built on it, never the other way round."""
    graph = import_graph()
    bad = [
        f"{m} imports {t} (line {line})"
        for m, edges in graph.items()
        if m == "splitrl.models" or m.startswith("splitrl.models.")
        for t, line in edges.items()
        if t == "splitrl.loss" or t.startswith("splitrl.loss.")
    ]
    assert not bad, "\n".join(bad)


def test_the_check_sees_circles_through_deferred_and_relative_imports(tmp_path):
    """The checker itself on a made-up package: a circle closed by an import inside a function and
    a relative import is found; one under TYPE_CHECKING, or of a parent package's name, is not."""
    pkg = tmp_path / PACKAGE / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from splitrl.sub.a import A\n")
    (pkg / "a.py").write_text("A = 1\ndef f():\n    from .b import B\n")
    (pkg / "b.py").write_text("from splitrl.sub import a\nB = 2\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from splitrl.sub.d import D\n")
    (pkg / "d.py").write_text("from splitrl.sub.c import C\nfrom splitrl.sub import A\n")
    graph = import_graph(tmp_path)
    assert graph["splitrl.sub.a"] == {"splitrl.sub.b": 3}
    assert graph["splitrl.sub.b"] == {"splitrl.sub.a": 1}  # `from pkg import module`: the module
    assert graph["splitrl.sub.c"] == {}
    assert graph["splitrl.sub.d"] == {"splitrl.sub.c": 1, "splitrl.sub": 2}  # a name: the __init__
    [found] = cycles(tmp_path)
    assert "splitrl.sub.a, splitrl.sub.b" in found and "splitrl/sub/a.py:3" in found, found
