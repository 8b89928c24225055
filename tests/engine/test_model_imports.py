"""engine/model's module graph: no import cycle (imports inside functions count too), the data types import no
compute module, and only `numerics` maps a numerics name to its arithmetic."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "engine" / "model"
NAME = "engine.model"


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), filename=str(p)) for p in sorted(PKG.glob("*.py"))}


def _graph() -> dict[str, set[str]]:
    """module -> engine.model modules it imports anywhere in its body ("__init__" is the package)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, tree in mods.items():
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if name == NAME:
                    if not (isinstance(node, ast.ImportFrom) and all(a.name in mods for a in node.names)):
                        graph[m].add("__init__")       # `from engine.model import load`: the package itself
                elif name.startswith(NAME + "."):
                    sub = name[len(NAME) + 1:].split(".")[0]
                    if sub in mods:
                        graph[m].add(sub)
        graph[m].discard(m)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}                 # 1 on the current path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_engine_model_has_no_import_cycle():
    graph = _graph()
    assert {"types", "numerics", "llama", "ggml", "f32", "matmul", "gguf_loader"} <= set(graph)
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_check_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_data_types_import_no_compute_module():
    assert _graph()["types"] == set()


def _mentions_numerics(node: ast.AST) -> bool:
    """A comparison involving a name like `numerics` / `opts.numerics`, or the constant "ggml" ("f32" is also
    an activation type of ggml.py, so it alone does not count)."""
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and "numerics" in n.id.lower():
            return True
        if isinstance(n, ast.Attribute) and "numerics" in n.attr.lower():
            return True
        if isinstance(n, ast.Constant) and n.value == "ggml":
            return True
    return False


def test_only_numerics_compares_against_a_numerics_name():
    bad = [f"{m}.py:{node.lineno}" for m, tree in _modules().items() if m != "numerics"
           for node in ast.walk(tree) if isinstance(node, ast.Compare) and _mentions_numerics(node)]
    assert not bad, bad
