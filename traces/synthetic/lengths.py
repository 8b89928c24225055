"""Token-length distributions: constant, uniform, bounded Zipf and empirical (a CSV column of lengths,
e.g. the ShareGPT stats file, sampled with replacement)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Union

import numpy as np

from traces.errors import FieldError, TraceFormatError
from traces.readers._common import csv_reader, open_text, parse_count, read_csv_header


class LengthDist(Protocol):
    @property
    def mean(self) -> float: ...

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """`n` non-negative int64 lengths."""
        ...


@dataclass(frozen=True, slots=True)
class ConstantLength:
    value: int

    def __post_init__(self) -> None:
        if self.value < 0:
            raise ValueError(f"ConstantLength: value must be >= 0, got {self.value}")

    @property
    def mean(self) -> float:
        return float(self.value)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class UniformLength:
    """Integers in [lo, hi], both inclusive."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 0 <= self.lo <= self.hi:
            raise ValueError(f"UniformLength: need 0 <= lo <= hi, got lo={self.lo}, hi={self.hi}")

    @property
    def mean(self) -> float:
        return (self.lo + self.hi) / 2.0

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(self.lo, self.hi, size=n, endpoint=True, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class ZipfLength:
    """Bounded Zipf: P(k) proportional to k**-exponent for integers k in [lo, hi] (lo >= 1).

    Many short requests, a heavy tail of long ones; the bound keeps the mean finite for any exponent.
    """

    lo: int
    hi: int
    exponent: float = 1.2

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"ZipfLength: need 1 <= lo <= hi, got lo={self.lo}, hi={self.hi}")
        if not self.exponent > 0:
            raise ValueError(f"ZipfLength: exponent must be > 0, got {self.exponent}")

    def _pmf(self) -> tuple[np.ndarray, np.ndarray]:
        k = np.arange(self.lo, self.hi + 1, dtype=np.float64)   # [hi - lo + 1]
        w = k ** -self.exponent
        return k, w / w.sum()

    @property
    def mean(self) -> float:
        k, p = self._pmf()
        return float((k * p).sum())

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        _, p = self._pmf()
        cdf = np.cumsum(p)
        idx = np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right")
        return np.minimum(idx, len(p) - 1).astype(np.int64) + self.lo


@dataclass(frozen=True, slots=True)
class EmpiricalLength:
    """Lengths drawn with replacement from observed values (`label` says where they came from)."""

    values: tuple[int, ...] = field(repr=False)
    label: str = ""

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError("EmpiricalLength: no values")
        if min(self.values) < 0:
            raise ValueError("EmpiricalLength: lengths must be >= 0")

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        values = np.asarray(self.values, dtype=np.int64)
        return values[rng.integers(0, len(values), size=n)]

    @classmethod
    def from_csv(cls, path: str | Path, column: str | None = None) -> EmpiricalLength:
        """Read one column of a CSV with a header (the first column if `column` is None)."""
        path = str(path)
        with open_text(path) as f:
            reader = csv_reader(f)
            if column is None:
                header = next(reader, None)
                if not header:
                    raise TraceFormatError(path, None, "file is empty (expected a CSV header)")
                col, name = 0, header[0].strip()
            else:
                (col,), _, _ = read_csv_header(path, reader, "lengths", (column,))
                name = column
            values = []
            for row in reader:
                if not row:
                    continue
                try:
                    if len(row) <= col:
                        raise FieldError(name, "a value", f"a row of {len(row)} columns", literal=True)
                    values.append(parse_count(row[col], name))
                except FieldError as e:
                    raise e.at(path, reader.line_num) from None
        if not values:
            raise TraceFormatError(path, None, f"no values in column {name!r}")
        return cls(tuple(values), f"{Path(path).name}:{name}")


LengthLike = Union[int, tuple[int, int], LengthDist]


def as_length_dist(x: LengthLike) -> LengthDist:
    """int -> ConstantLength, (lo, hi) -> UniformLength, a distribution -> itself."""
    if isinstance(x, bool):
        raise TypeError("a length must be an int, a (lo, hi) pair or a LengthDist, not a bool")
    if isinstance(x, (int, np.integer)):
        return ConstantLength(int(x))
    if isinstance(x, tuple) and len(x) == 2:
        return UniformLength(int(x[0]), int(x[1]))
    if hasattr(x, "sample") and hasattr(x, "mean"):
        return x
    raise TypeError(f"a length must be an int, a (lo, hi) pair or a LengthDist, got {x!r}")
