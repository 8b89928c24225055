"""Independent, named random streams from one explicit seed."""

from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1

# Stream tags: each component draws from its own stream, so changing one distribution never changes
# the samples of another.
ARRIVALS, PROMPT, OUTPUT, SESSION_START, SESSION_TURNS, SYSTEM_LEN, SYSTEM_PICK, USER_LEN, THINK = range(1, 10)


def stream(seed: int, tag: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed & MASK64, tag])))
