"""Shared reader machinery: opening files, CSV headers, field parsing, and the row collector that
enforces arrival order and implements `skip_bad_rows`."""

from __future__ import annotations

import csv
import gzip
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, Iterator

from traces.errors import FieldError, TraceFormatError
from traces.schema import Trace, TraceRequest

MAX_KEPT_ERRORS = 10     # messages of skipped rows kept in Trace.errors


def open_text(path: str | Path) -> IO[str]:
    """Open a trace as text; `.gz` files are decompressed on the fly, a UTF-8 BOM is dropped."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


def csv_reader(f: IO[str]) -> "csv._reader":
    return csv.reader(f, skipinitialspace=True)


def parse_count(text: str, field: str) -> int:
    """A non-negative integer; integral floats such as '374.0' (pandas output) are accepted."""
    try:
        value = int(text)
    except ValueError:
        try:
            f = float(text)
        except ValueError:
            raise FieldError(field, "a non-negative integer", text) from None
        if not f.is_integer():
            raise FieldError(field, "a non-negative integer", text) from None
        value = int(f)
    if value < 0:
        raise FieldError(field, "a non-negative integer", text)
    return value


def parse_seconds(text: str, field: str, scale: float = 1.0) -> float:
    """A finite non-negative time, multiplied by `scale` (e.g. 1e-3 for milliseconds)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise FieldError(field, "a non-negative number of seconds", text) from None
    if not (0.0 <= value < math.inf):            # also rejects nan
        raise FieldError(field, "a non-negative number of seconds", text)
    return value * scale


def json_count(obj: dict, field: str, required: bool = True) -> int | None:
    """An integer field of a JSON object (bools rejected; integral floats accepted)."""
    if field not in obj:
        if required:
            raise FieldError(field, "a non-negative integer", "<missing>", literal=True)
        return None
    v = obj[field]
    if type(v) is int and v >= 0:
        return v
    if type(v) is float and v.is_integer() and v >= 0:
        return int(v)
    raise FieldError(field, "a non-negative integer", v)


def json_seconds(obj: dict, field: str, scale: float = 1.0) -> float:
    """A finite non-negative JSON number (bools rejected), multiplied by `scale`."""
    if field not in obj:
        raise FieldError(field, "a non-negative number", "<missing>", literal=True)
    v = obj[field]
    if type(v) not in (int, float) or not (0.0 <= v < math.inf):
        raise FieldError(field, "a non-negative number", v)
    return float(v) * scale


def load_json_line(path: str, line: int, text: str) -> dict:
    """One JSONL line as an object; TraceFormatError (row level, skippable) otherwise."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise TraceFormatError(path, line, f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(path, line, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def json_int_list(obj: dict, field: str) -> tuple[int, ...]:
    v = obj[field]
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise FieldError(field, "a list of integers", v)
    return tuple(v)


def read_csv_header(path: str, reader: Iterator[list[str]], fmt: str, required: tuple[str, ...],
                    optional: tuple[str, ...] = ()) -> tuple[list[int], list[int | None], list[str]]:
    """Column indices of `required` and `optional` names (matched case-insensitively, spaces stripped).

    Raises TraceFormatError for an empty file or a missing required column.
    """
    header = next(reader, None)
    while header is not None and not any(c.strip() for c in header):
        header = next(reader, None)
    if header is None:
        raise TraceFormatError(path, None, f"file is empty (expected a '{fmt}' CSV header: {','.join(required)})")
    where = {}
    for i, name in enumerate(header):
        where.setdefault(name.strip().lower(), i)
    missing = [n for n in required if n.lower() not in where]
    if missing:
        line = getattr(reader, "line_num", 1)
        raise TraceFormatError(
            path, line,
            f"missing column(s) {', '.join(repr(m) for m in missing)} for format '{fmt}' "
            f"(expected {','.join(required)}); header is {','.join(header)!r}",
            field=missing[0],
        )
    return ([where[n.lower()] for n in required], [where.get(n.lower()) for n in optional],
            [h.strip() for h in header])


def short_row(row: list[str], needed: int, header: list[str]) -> FieldError:
    field = header[len(row)] if len(row) < len(header) else f"column {len(row) + 1}"
    return FieldError(field, f"a value (the row needs {needed} columns)", f"a row of {len(row)}", literal=True)


class RowCollector:
    """Builds the request list: numbers rows in order, rejects arrivals that go back in time, and either
    raises on a bad row or (skip_bad_rows) counts it and keeps its message."""

    __slots__ = ("path", "skip_bad_rows", "time_field", "requests", "n_skipped", "errors", "_last", "ordered")

    def __init__(self, path: str, skip_bad_rows: bool, time_field: str, ordered: bool = True) -> None:
        """`ordered=False`: rows may come in any time order (a recorded trace is written as requests end);
        `finish` sorts them by arrival (stable), so `index` is the arrival rank."""
        self.path = path
        self.ordered = ordered
        self.skip_bad_rows = skip_bad_rows
        self.time_field = time_field
        self.requests: list[TraceRequest] = []
        self.n_skipped = 0
        self.errors: list[str] = []
        self._last = -math.inf

    def csv_rows(self, reader, width: int, header: list[str]):
        """(line number, row) for every non-blank data row of a csv reader that has at least `width`
        columns; a shorter row goes to `bad` (raised, or counted with skip_bad_rows)."""
        for row in reader:
            if not row:
                continue                                   # blank line
            if len(row) < width:
                self.bad(short_row(row, width, header), reader.line_num)
                continue
            yield reader.line_num, row

    def bad(self, err: FieldError | TraceFormatError, line: int) -> None:
        exc = err.at(self.path, line) if isinstance(err, FieldError) else err
        if not self.skip_bad_rows:
            raise exc
        self.n_skipped += 1
        if len(self.errors) < MAX_KEPT_ERRORS:
            self.errors.append(str(exc))

    def add(self, line: int, arrival_s: float, raw_time: object, n_prompt: int, n_output: int,
            session_id: str | None = None, prompt_tokens: tuple[int, ...] | None = None,
            block_hashes: tuple[int, ...] = (), block_size: int = 0, **extra: Any) -> None:
        if self.ordered and arrival_s < self._last:
            # Upstream traces are sorted; a step back in time means a broken or concatenated file.
            raise FieldError(self.time_field, f"a time not before the previous row's "
                             f"({self._last:.6f} s from the start)", raw_time)
        self._last = arrival_s
        self.requests.append(TraceRequest(len(self.requests), arrival_s, n_prompt, n_output, session_id,
                                          prompt_tokens, block_hashes, block_size, line, **extra))

    def finish(self, fmt: str) -> Trace:
        if not self.requests:
            if self.n_skipped:
                raise TraceFormatError(self.path, None, f"all {self.n_skipped} rows were bad; first: "
                                       f"{self.errors[0]}")
            raise TraceFormatError(self.path, None, "no requests (the file has no data rows)")
        reqs = self.requests
        if not self.ordered:
            reqs = sorted(reqs, key=lambda r: (r.arrival_s, r.index))
            reqs = [r if r.index == i else replace(r, index=i) for i, r in enumerate(reqs)]
        return Trace(reqs, fmt, self.path, self.n_skipped, tuple(self.errors))
