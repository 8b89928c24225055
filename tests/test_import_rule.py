"""DESIGN §1 dependency rule: imports point one way; the serving core is pure Python with injected time."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("engine", "sim", "policies", "traces", "experiments")

# package -> project packages it may import (prefix match on dotted names)
ALLOWED = {
    "engine/core": ("engine.core",),
    "policies": ("engine.core", "policies"),
    "traces": ("engine.core", "traces"),
    "engine/model": ("engine.core", "engine.model"),
    "sim": ("engine.core", "sim", "traces", "policies"),
}
FORBIDDEN_IN_CORE = ("simpy", "numpy", "time")


def imports_of(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


def files(pkg: str) -> list[Path]:
    return sorted((ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_package_imports_only_what_the_design_allows(pkg):
    bad = []
    for f in files(pkg):
        for name in imports_of(f):
            top = name.split(".")[0]
            if top in PROJECT and not any(name == a or name.startswith(a + ".") for a in ALLOWED[pkg]):
                bad.append(f"{f.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_core_never_imports_simpy_numpy_or_time():
    bad = [f"{f.relative_to(ROOT)} imports {n}" for f in files("engine/core") for n in imports_of(f)
           if n.split(".")[0] in FORBIDDEN_IN_CORE]
    assert not bad, "\n".join(bad)
