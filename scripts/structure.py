"""Structure figures of src/lazyckpt (issue 21): private reach, import cycles, module sizes.

    python scripts/structure.py            # summary
    python scripts/structure.py --list     # every private access across objects, by file

Private reach: an attribute ``x._name`` (not a dunder) where ``x`` is not ``self``/``cls``. It counts as
"lazyckpt touching lazyckpt" when ``_name`` is defined somewhere in lazyckpt (a method, a ``self._name``
assignment, a module-level name) and as a framework internal otherwise. Import cycles: strongly connected
components of the graph of lazyckpt modules importing lazyckpt modules (function-level imports included).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src" / "lazyckpt"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        out[module_name(path)] = (path, ast.parse(path.read_text(), str(path)))
    return out


def defined_private(trees: dict[str, tuple[Path, ast.Module]]) -> set[str]:
    names: set[str] = set()
    for _, tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_reach(trees: dict[str, tuple[Path, ast.Module]]) -> list[tuple[str, int, str, bool]]:
    ours = defined_private(trees)
    hits = []
    for mod, (_, tree) in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            hits.append((mod, node.lineno, f"{ast.unparse(node.value)}.{attr}", attr in ours))
    return hits


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(trees: dict[str, tuple[Path, ast.Module]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, (path, tree) in trees.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = resolve(mod, is_pkg, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in trees else base for a in node.names]
            for t in targets:
                while t and t not in trees:
                    t = t.rpartition(".")[0]
                if t and t != mod and t.startswith("lazyckpt"):
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]], nodes: list[str]) -> list[list[str]]:
    """Tarjan's strongly connected components of size > 1 (``TYPE_CHECKING`` imports included: they are
    dependencies of the design too). ``from pkg import submodule`` is an edge to the submodule only."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def edges(v: str) -> list[str]:
        return sorted(graph.get(v, ()))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in nodes:
        if v not in index:
            visit(v)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every private access across objects")
    args = parser.parse_args()
    trees = sources()
    hits = private_reach(trees)
    ours = [h for h in hits if h[3]]
    if args.list:
        for mod, line, expr, own in hits:
            print(f"{'lazyckpt ' if own else 'framework'} {mod}:{line}: {expr}")
    sizes = sorted(((len(p.read_text().splitlines()), m) for m, (p, _) in trees.items()), reverse=True)
    print(f"private reach across objects: {len(hits)} in all, {len(ours)} lazyckpt touching lazyckpt")
    by_file: dict[str, int] = defaultdict(int)
    for mod, *_ in ours:
        by_file[mod] += 1
    print(
        "  lazyckpt reach by module: " + ", ".join(f"{m} {n}" for m, n in sorted(by_file.items(), key=lambda x: -x[1]))
    )
    found = cycles(import_graph(trees), list(trees))
    print(f"import cycles: {len(found)}" + "".join(f"\n  {' <-> '.join(c)}" for c in found))
    big = [(n, m) for n, m in sizes if n > 500]
    print(f"modules over 500 lines: {len(big)}" + "".join(f"\n  {m} {n}" for n, m in big))
    print("largest: " + ", ".join(f"{m} {n}" for n, m in sizes[:6]))


if __name__ == "__main__":
    main()
