"""The project's module import graph: `python -m tests.import_graph [--cycles] [--packages]`.

Reads every module of the project packages with `ast` (nothing is imported or run) and prints one edge per
line, `importer -> imported`, for imports of other project modules. Imports inside functions are marked
`(lazy)`: they are the usual way to hide a circle. Imports under `if TYPE_CHECKING:` count too: they never
run, but a circle among type-only imports is still a circle in the design. `--cycles` prints the strongly connected components of
more than one module (import circles), `--packages` the edges between packages instead of modules.
`tests/test_import_rule.py` uses the same functions.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("engine", "sim", "policies", "traces", "experiments")


@dataclass(frozen=True, slots=True)
class Edge:
    src: str          # importing module, dotted
    dst: str          # imported project module, dotted
    lazy: bool        # the import statement is inside a function
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    out = {}
    for pkg in PROJECT:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            out[module_name(f)] = f
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an imported dotted name refers to (a name inside a module maps to the module)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(tree: ast.AST, this: str, is_pkg: bool) -> Iterator[tuple[str, bool, int]]:
    """(dotted name, lazy, line) of every import; relative imports resolved against `this`."""
    def visit(node: ast.AST, in_func: bool) -> Iterator[tuple[str, bool, int]]:
        for child in ast.iter_child_nodes(node):
            func = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for a in child.names:
                    yield a.name, in_func, child.lineno
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = this.split(".") if is_pkg else this.split(".")[:-1]
                    pkg = pkg[:len(pkg) - (child.level - 1)]
                    base = ".".join([*pkg, base] if base else pkg)
                for a in child.names:       # `from pkg import module` names a module
                    yield f"{base}.{a.name}", in_func, child.lineno
            else:
                yield from visit(child, func)
    yield from visit(tree, False)


def edges(modules: dict[str, Path] | None = None) -> list[Edge]:
    modules = project_modules() if modules is None else modules
    out = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        seen = set()
        for imported, lazy, line in _imports(tree, name, path.name == "__init__.py"):
            dst = _resolve(imported, modules)
            if dst is None or dst == name or (dst, lazy) in seen:
                continue
            # `from engine.core import X` from inside engine.core.* names the package itself: skip parents
            if name.startswith(dst + "."):
                continue
            seen.add((dst, lazy))
            out.append(Edge(name, dst, lazy, line))
    return out


def cycles(es: list[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in es:
        graph.setdefault(e.src, set()).add(e.dst)
        graph.setdefault(e.dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def package_of(module: str, modules: dict[str, Path]) -> str:
    """The package (folder) a module lives in: engine.core.server -> engine.core, engine.backend -> engine."""
    return ".".join(modules[module].parent.relative_to(ROOT).parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.import_graph", description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", action="store_true", help="print import circles only")
    ap.add_argument("--packages", action="store_true", help="edges between packages, not modules")
    args = ap.parse_args(argv)
    modules = project_modules()
    es = edges(modules)
    if args.cycles:
        found = cycles(es)
        for comp in found:
            print("circle: " + " <-> ".join(comp))
        print(f"{len(found)} import circle(s); {sum(e.lazy for e in es)} function-level project imports")
        return 0
    if args.packages:
        pk = sorted({(package_of(e.src, modules), package_of(e.dst, modules)) for e in es}
                    - {(p, p) for p in map(lambda m: package_of(m, modules), modules)})
        for a, b in pk:
            print(f"{a} -> {b}")
        return 0
    for e in sorted(es, key=lambda e: (e.src, e.dst, e.lazy)):
        print(f"{e.src} -> {e.dst}{' (lazy)' if e.lazy else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
