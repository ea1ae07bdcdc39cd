"""The import graph of tinyflow/ is the one README.md's tour documents, and a DAG.

The tour of the layers is a table read bottom up: a module may import modules of its
own row or of rows above it. This test reads that table, parses every module of
tinyflow/ with `ast` (imports inside functions count too: a lazy import is still a
dependency a reader has to follow), and fails on an import against that order, on a
cycle, or on a module the table does not list.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tinyflow"
FACADE = "__init__"  # `import tinyflow` / `from tinyflow import __version__`

# Edges allowed against the order, each with the reason it is still there.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _modules() -> set[str]:
    return {p.stem for p in PACKAGE.glob("*.py")}


def _imported(node: ast.AST, modules: set[str]) -> list[str]:
    """The tinyflow modules one import statement names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names if a.name.split(".")[0] == "tinyflow"]
        return [n.split(".")[1] if "." in n else FACADE for n in names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        parts = node.module.split(".")
        if parts[0] != "tinyflow":
            return []
        if len(parts) > 1:
            return [parts[1]]
        return [a.name if a.name in modules else FACADE for a in node.names]
    return []


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def import_graph() -> dict[str, set[str]]:
    """{module: the tinyflow modules it imports anywhere}, TYPE_CHECKING blocks aside."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name in sorted(modules):
        tree = ast.parse((PACKAGE / f"{name}.py").read_text(), filename=f"{name}.py")
        found: set[str] = set()
        stack: list[ast.AST] = [tree]
        while stack:
            node = stack.pop()
            if _is_type_checking(node):
                continue
            found.update(_imported(node, modules))
            stack.extend(ast.iter_child_nodes(node))
        graph[name] = found - {name}
    return graph


def tour_rows() -> list[list[str]]:
    """The modules of each row of README's tour table, bottom row first."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## A tour of the layers"):]
    section = section[:section.index("\n## ", 1)]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `tinyflow/"):
            first_cell = line.split("|")[1]
            rows.append(re.findall(r"`(?:tinyflow/)?(\w+)\.py`", first_cell))
    return rows


def _layer_of() -> dict[str, int]:
    layer: dict[str, int] = {}
    for row, names in enumerate(tour_rows()):
        for name in names:
            assert name not in layer, f"{name}.py is listed twice in README's tour"
            layer[name] = row
    return layer


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None
    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def _without_exceptions(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {t for t in targets if (m, t) not in KNOWN_EXCEPTIONS}
            for m, targets in graph.items()}


def test_the_tour_lists_every_module_once():
    layer = _layer_of()
    modules = _modules()
    assert not modules - set(layer), f"not in README's tour: {sorted(modules - set(layer))}"
    assert not set(layer) - modules, f"in the tour, not in tinyflow/: {set(layer) - modules}"


def test_imports_follow_the_documented_order():
    layer, rows = _layer_of(), tour_rows()
    wrong = [f"{m}.py (row {layer[m] + 1}: {', '.join(rows[layer[m]])}) imports {t}.py "
             f"(row {layer[t] + 1}, below it in the tour)"
             for m, targets in _without_exceptions(import_graph()).items()
             for t in sorted(targets) if layer[t] > layer[m]]
    assert not wrong, "imports against README's order:\n" + "\n".join(wrong)


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(_without_exceptions(import_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_catch_a_cycle_and_a_lazy_import(tmp_path):
    """The helpers themselves: a cycle is found, and an import inside a function
    counts (the ops <-> shape_ops cycle was one import at the bottom of ops.py)."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse("def f():\n    from tinyflow import shape_ops\n")
    found = [m for node in ast.walk(tree) for m in _imported(node, {"shape_ops"})]
    assert found == ["shape_ops"]


def test_tinyflow_never_imports_viz():
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "viz" for n in names), path.name
