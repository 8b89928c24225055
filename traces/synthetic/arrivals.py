"""Arrival processes for open-loop workloads: Poisson and gamma (burstiness set by the coefficient of
variation of inter-arrival gaps)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


class ArrivalProcess(Protocol):
    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """`n` non-decreasing arrival times in seconds, the first at 0.0 (float64 array)."""
        ...


def _from_gaps(gaps: np.ndarray) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(gaps)))          # [n]


@dataclass(frozen=True, slots=True)
class PoissonArrivals:
    """Exponential gaps with mean 1 / rate_rps."""

    rate_rps: float

    def __post_init__(self) -> None:
        if not self.rate_rps > 0:
            raise ValueError(f"PoissonArrivals: rate_rps must be > 0, got {self.rate_rps}")

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if n <= 0:
            return np.zeros(0)
        return _from_gaps(rng.exponential(1.0 / self.rate_rps, n - 1))


@dataclass(frozen=True, slots=True)
class GammaArrivals:
    """Gamma gaps with mean 1 / rate_rps and coefficient of variation `cv` (cv = 1 is Poisson, > 1 bursty,
    < 1 regular): shape k = 1 / cv**2, scale = 1 / (rate_rps * k)."""

    rate_rps: float
    cv: float = 1.0

    def __post_init__(self) -> None:
        if not self.rate_rps > 0 or not self.cv > 0:
            raise ValueError(f"GammaArrivals: rate_rps and cv must be > 0, got {self.rate_rps}, {self.cv}")

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if n <= 0:
            return np.zeros(0)
        shape = 1.0 / (self.cv * self.cv)
        return _from_gaps(rng.gamma(shape, 1.0 / (self.rate_rps * shape), n - 1))


@dataclass(frozen=True, slots=True)
class BurstArrivals:
    """Everything at 0.0 (a burst: throughput measurements, or a length-only trace as given)."""

    def times(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.zeros(max(n, 0))
