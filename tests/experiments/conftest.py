"""Shared helpers for the CLI tests: a tiny closed-loop workload with a constant latency model (fast runs)."""

from __future__ import annotations

import pytest

# 4 users x 2 turns with a 10 ms step: a full simulate run takes well under a second.
SMALL = ["--users", "4", "--turns", "2", "--think-time", "1", "--latency", "constant:0.01", "--quiet"]


@pytest.fixture
def small_args():
    return list(SMALL)
