"""Structure figures of src/lazyckpt: private reach, import cycles (modules, packages), class names, module sizes.

    python scripts/structure.py            # summary
    python scripts/structure.py --list     # every private access across objects, by file

Private reach: an attribute ``x._name`` (not a dunder) where ``x`` is not ``self``/``cls``. Whether it is
"lazyckpt touching lazyckpt" or a framework internal depends on what ``x`` is:

- a module imported by name (``_guard``, ``torch``, ``dist.distributed_c10d``): lazyckpt when the module is
  lazyckpt's, a framework internal otherwise (``torch._C``, ``sys._getframe``);
- any other object: lazyckpt when ``_name`` is an attribute some lazyckpt object has (a method or a name in a
  lazyckpt class body, or a ``<anything>._name = ...`` assignment), a framework internal otherwise.

A local variable or an argument that happens to be called ``_name`` makes no object have that attribute
(Lightning's ``cb._fs`` is not lazyckpt's just because a function here unpacks ``_fs, path = ...``). A
framework attribute that shares a name with one of ours still counts as lazyckpt: the error goes towards
showing more reach, never less. Import cycles: strongly connected components of the graph of lazyckpt
modules importing lazyckpt modules (function-level imports included).
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


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def attribute_names(trees: dict[str, tuple[Path, ast.Module]]) -> set[str]:
    """Private names that some lazyckpt object has as an attribute: defined in a class body (methods,
    class attributes, dataclass fields) or assigned as ``<anything>._name``."""
    names: set[str] = set()
    for _, tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(stmt.name)
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if _private(n)}


def module_names(tree: ast.Module) -> set[str]:
    """Private names a module has: top-level definitions, assignments and imports (not inside functions
    or classes), and names functions declare ``global``."""
    names: set[str] = set()

    def top(stmts: list[ast.stmt]) -> None:
        for stmt in stmts:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
                continue
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
                continue
            for node in ast.walk(stmt):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
            for field in ("body", "orelse", "finalbody", "handlers"):
                top([s for s in getattr(stmt, field, []) if isinstance(s, ast.stmt)])

    top(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            names.update(node.names)
    return {n for n in names if _private(n)}


def imported_modules(mod: str, is_pkg: bool, tree: ast.Module, trees: dict) -> dict[str, str]:
    """Local name -> module for every name a file binds to a module (``import a.b as c``, ``import torch``,
    ``from lazyckpt.core import guard as _guard``). A ``from`` import of something outside lazyckpt is not
    known to be a module and is left out (its receiver then counts as an object: more lazyckpt, not less)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = resolve(mod, is_pkg, node)
            for a in node.names:
                if f"{base}.{a.name}" in trees:
                    out[a.asname or a.name] = f"{base}.{a.name}"
    return out


def receiver_module(value: ast.expr, modules: dict[str, str], trees: dict) -> str | None:
    """The module ``value`` names (``_guard``, ``dist.distributed_c10d``, ``lazyckpt.core.guard``), or None
    when it is an object. A chain rooted at a module outside lazyckpt stays outside it."""
    chain: list[str] = []
    while isinstance(value, ast.Attribute):
        chain.append(value.attr)
        value = value.value
    if not isinstance(value, ast.Name) or value.id not in modules:
        return None
    name = modules[value.id]
    for part in reversed(chain):
        if not name.startswith("lazyckpt") or f"{name}.{part}" not in trees:
            break  # an external module's attribute or submodule; or a lazyckpt module's object
        name = f"{name}.{part}"
    else:
        return name
    return name if not name.startswith("lazyckpt") else None


def private_reach(trees: dict[str, tuple[Path, ast.Module]]) -> list[tuple[str, int, str, bool]]:
    attrs = attribute_names(trees)
    globals_of = {mod: module_names(tree) for mod, (_, tree) in trees.items()}
    hits = []
    for mod, (path, tree) in trees.items():
        modules = imported_modules(mod, path.name == "__init__.py", tree, trees)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            attr = node.attr
            if not _private(attr):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            target = receiver_module(node.value, modules, trees)
            if target is None:
                ours = attr in attrs
            else:
                ours = target in trees and (attr in globals_of[target] or attr in attrs)
            hits.append((mod, node.lineno, f"{ast.unparse(node.value)}.{attr}", ours))
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


def docstring_lines(trees: dict[str, tuple[Path, ast.Module]]) -> int:
    """Lines of string statements (module, class and function docstrings, attribute docstrings)."""
    total = 0
    for _, tree in trees.values():
        for node in ast.walk(tree):
            for stmt in getattr(node, "body", []) if isinstance(getattr(node, "body", None), list) else []:
                if (
                    isinstance(stmt, ast.Expr)
                    and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)
                ):
                    total += (stmt.end_lineno or stmt.lineno) - stmt.lineno + 1
    return total


def package_of(mod: str, trees: dict[str, tuple[Path, ast.Module]]) -> str:
    """``lazyckpt.core.job`` -> ``lazyckpt.core``; a top-level module (``lazyckpt.errors``) is its own node."""
    parts = mod.split(".")
    path = trees[mod][0]
    if path.name == "__init__.py":
        return mod
    return ".".join(parts[:-1]) if path.parent != ROOT else mod


def package_graph(graph: dict[str, set[str]], trees: dict[str, tuple[Path, ast.Module]]) -> dict[str, set[str]]:
    """Imports between packages (a package's ``__init__`` is the package); edges within a package dropped."""
    out: dict[str, set[str]] = defaultdict(set)
    for mod, targets in graph.items():
        src = package_of(mod, trees)
        out[src]
        for target in targets:
            dst = package_of(target, trees)
            if dst != src:
                out[src].add(dst)
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
        "  lazyckpt reach by module: "
        + (", ".join(f"{m} {n}" for m, n in sorted(by_file.items(), key=lambda x: -x[1])) or "none")
    )
    graph = import_graph(trees)
    found = cycles(graph, list(trees))
    print(f"import cycles between modules: {len(found)}" + "".join(f"\n  {' <-> '.join(c)}" for c in found))
    packages = package_graph(graph, trees)
    found = cycles(packages, sorted(packages))
    print(f"import cycles between packages: {len(found)}" + "".join(f"\n  {' <-> '.join(c)}" for c in found))
    classes: dict[str, list[str]] = defaultdict(list)
    for mod, (_, tree) in trees.items():
        classes.update({})
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes[node.name].append(mod)
    twice = {name: mods for name, mods in classes.items() if len(mods) > 1}
    print(
        f"class names defined in two modules: {len(twice)}"
        + "".join(f"\n  {n}: {', '.join(m)}" for n, m in twice.items())
    )
    print(f"lines: {sum(n for n, _ in sizes)} in src/lazyckpt, {docstring_lines(trees)} of them docstrings")
    big = [(n, m) for n, m in sizes if n > 500]
    print(f"modules over 500 lines: {len(big)}" + "".join(f"\n  {m} {n}" for n, m in big))
    print("largest: " + ", ".join(f"{m} {n}" for n, m in sizes[:6]))


if __name__ == "__main__":
    main()
