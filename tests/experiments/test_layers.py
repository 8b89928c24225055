"""experiments/: imports point one way (no module imports the `slotlab` parser, no cycle, no function-level
project import except the commented lazy ones for matplotlib and the HTTP stack), and the flag table declares
each flag once per command, llama-server's flags once for the simulator's commands and `serve`."""

from __future__ import annotations

import ast
from pathlib import Path

from experiments.flags import FLAGS, OPTIONS, RUNS, SERVE, flags_of

PKG = Path(__file__).resolve().parents[2] / "experiments"
PROJECT = ("engine", "sim", "policies", "traces", "experiments")
LAZY = {"experiments.plots", "engine.http.app", "engine.http.state"}   # matplotlib; starlette / uvicorn


def project_imports(path: Path) -> tuple[set[str], set[str]]:
    """(module-level, function-level) project modules imported by a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            top.add(node.module)
            top.update(f"{node.module}.{a.name}" for a in node.names if node.module == "experiments")
        elif isinstance(node, ast.Import):
            top.update(a.name for a in node.names)
    every = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            every.add(node.module)
            every.update(f"{node.module}.{a.name}" for a in node.names if node.module == "experiments")
        elif isinstance(node, ast.Import):
            every.update(a.name for a in node.names)
    keep = {m for m in every if m.split(".")[0] in PROJECT}
    return {m for m in top if m in keep}, keep - top


def test_no_module_imports_the_cli_and_the_graph_has_no_cycle():
    graph = {}
    for f in PKG.glob("*.py"):
        top, _ = project_imports(f)
        graph[f"experiments.{f.stem}"] = {m for m in top if m.startswith("experiments.")}
    assert not [m for m, deps in graph.items() if "experiments.cli" in deps]
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, " -> ".join((*path, m))
        if m not in done:
            for d in graph.get(m, ()):
                visit(d, (*path, m))
            done.add(m)

    for m in graph:
        visit(m, ())


def test_function_level_project_imports_are_only_the_lazy_heavy_ones():
    late = {f.name: sorted(project_imports(f)[1] - LAZY) for f in PKG.glob("*.py")}
    assert not {k: v for k, v in late.items() if v}


def test_each_command_declares_a_flag_once():
    for command in {c for f in FLAGS for c in f.commands}:
        names = [n for f in flags_of(command) for n in (*f.flags, *f.off_flags)]
        assert len(names) == len(set(names)), command


def test_llama_server_flags_are_one_declaration_for_the_simulator_and_serve():
    serve = set(flags_of(SERVE))
    shared = [f for f in OPTIONS if f.field is not None]
    assert len(shared) == 20   # 14 server flags and 6 policy flags
    for f in shared:
        assert f in serve and set(RUNS) <= set(f.commands), f.flags
