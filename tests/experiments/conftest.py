"""Shared helpers for the CLI tests: a tiny closed-loop workload with a constant latency model (fast runs),
and a tiny random-weight GGUF for the commands that run the numpy engine."""

from __future__ import annotations

import pytest

from engine.model.tiny import write_tiny_gguf

# 4 users x 2 turns with a 10 ms step: a full simulate run takes well under a second.
SMALL = ["--users", "4", "--turns", "2", "--think-time", "1", "--latency", "constant:0.01", "--quiet"]


@pytest.fixture
def small_args():
    return list(SMALL)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Path of a tiny random-weight GGUF (written once per session; tests only read it)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", n_ctx_train=512)
