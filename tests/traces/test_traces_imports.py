import ast
from pathlib import Path

TRACES = Path(__file__).resolve().parents[2] / "traces"


def test_traces_never_imports_pandas():
    # readers build plain records with csv/json: pandas would cost seconds of import and load time
    for path in TRACES.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "pandas" for n in names), f"{path.name} imports pandas"
