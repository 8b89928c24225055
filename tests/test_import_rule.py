"""The dependency rule (docs/architecture.md): imports point one way, with no circle anywhere, and the serving
core is pure Python with injected time. Edges come from `tests/import_graph.py` (ast, nothing imported)."""

import pytest

from tests.import_graph import ROOT, cycles, edges, package_of, project_modules

MODULES = project_modules()
EDGES = edges(MODULES)

# package (folder) -> project packages its modules may import; every package of the project is listed
ALLOWED = {
    "engine.core": {"engine.core"},
    "policies": {"engine.core", "policies"},
    "traces": {"engine.core", "traces", "traces.readers", "traces.synthetic"},
    "traces.readers": {"engine.core", "traces", "traces.readers"},
    "traces.synthetic": {"engine.core", "traces", "traces.readers", "traces.synthetic"},
    "engine.model": {"engine.core", "engine.model"},
    "engine": {"engine", "engine.core", "engine.model"},                      # engine/backend.py
    "engine.http": {"engine", "engine.core", "engine.model", "engine.http", "policies"},
    "sim": {"engine.core", "sim", "traces", "traces.readers", "traces.synthetic", "policies"},
    "experiments": {"engine", "engine.core", "engine.model", "engine.http", "sim", "traces", "traces.readers",
                    "traces.synthetic", "policies", "experiments", "experiments.study"},
    "experiments.study": {"engine.core", "sim", "traces", "traces.synthetic", "policies", "experiments",
                          "experiments.study"},
}
FORBIDDEN_IN_CORE = ("simpy", "numpy", "time")


def test_every_package_has_a_rule():
    assert {package_of(m, MODULES) for m in MODULES} <= set(ALLOWED)


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_package_imports_only_what_the_rule_allows(pkg):
    bad = [f"{e.src} imports {e.dst} (line {e.line})" for e in EDGES
           if package_of(e.src, MODULES) == pkg and package_of(e.dst, MODULES) not in ALLOWED[pkg]]
    assert not bad, "\n".join(bad)


def test_no_import_circle_between_modules():
    found = cycles(EDGES)
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_core_never_imports_simpy_numpy_or_time():
    import ast
    bad = []
    for name, path in MODULES.items():
        if package_of(name, MODULES) != "engine.core":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            bad += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[0] in FORBIDDEN_IN_CORE]
    assert not bad, "\n".join(bad)


def test_the_graph_sees_lazy_imports_and_circles(tmp_path):
    """The checker itself: a function-level import is an edge, and a two-module circle is found."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "a.py").write_text("def f():\n    from engine import b\n")
    (tmp_path / "engine" / "b.py").write_text("import engine.a\n")
    mods = {"engine.a": tmp_path / "engine" / "a.py", "engine.b": tmp_path / "engine" / "b.py"}
    es = edges(mods)
    assert {(e.src, e.dst, e.lazy) for e in es} == {("engine.a", "engine.b", True), ("engine.b", "engine.a", False)}
    assert cycles(es) == [["engine.a", "engine.b"]]
