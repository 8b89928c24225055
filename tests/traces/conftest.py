"""Fixtures for trace tests: small files written on the fly, and the public traces when present."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


@pytest.fixture
def write(tmp_path):
    """write(name, text) -> path of a new file in the test's temp dir."""

    def _write(name: str, text: str) -> Path:
        p = tmp_path / name
        p.write_text(text, encoding="utf-8")
        return p

    return _write


@pytest.fixture
def shared_trace():
    """shared_trace(name) -> path of a public trace, or skip the test when the file is absent."""

    def _get(name: str) -> Path:
        p = SHARED_TRACES / name
        if not p.exists():
            pytest.skip(f"public trace {p} not present")
        return p

    return _get
