"""Azure LLM inference traces, 2023 (conv, code) and 2024 (week-long): `TIMESTAMP,ContextTokens,GeneratedTokens`.

Timestamps are absolute (`2023-11-16 18:15:46.6805900`, 7 fractional digits; 2024 files may add a
`+00:00` / `Z` offset); arrivals are made relative to the first row, so the first request is at 0.0.
"""

from __future__ import annotations

from datetime import date
from pathlib import Path

from traces.errors import FieldError
from traces.readers._common import RowCollector, csv_reader, open_text, parse_count, read_csv_header
from traces.schema import Trace

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_EXPECTED_TS = "a timestamp like '2023-11-16 18:15:46.6805900'"


def _minute(prefix: str, text: str) -> tuple[int, int]:
    """(day ordinal, seconds to the minute) of 'YYYY-MM-DD HH:MM:' (a 'T' separator is accepted)."""
    try:
        if len(prefix) != 17 or prefix[10] not in " T" or prefix[13] != ":" or prefix[16] != ":":
            raise ValueError
        day = date.fromisoformat(prefix[:10]).toordinal()
        h, m = int(prefix[11:13]), int(prefix[14:16])
    except ValueError:
        raise FieldError(COLUMNS[0], _EXPECTED_TS, text) from None
    if not (0 <= h < 24 and 0 <= m < 60):
        raise FieldError(COLUMNS[0], _EXPECTED_TS, text)
    return day, h * 3600 + m * 60


def parse_timestamp(text: str, minute_cache: dict[str, tuple[int, int]]) -> tuple[int, float]:
    """(proleptic day ordinal, seconds into that day in UTC) of `YYYY-MM-DD[ T]HH:MM:SS[.f*][Z|±HH:MM]`.

    Hand-parsed: `datetime` is several times slower. `minute_cache` maps the 'YYYY-MM-DD HH:MM:' prefix
    to its parsed value (many rows share a minute). A UTC offset may push the seconds outside
    [0, 86400); callers only use differences, so that is harmless.
    """
    s = text.strip()
    key = s[:17]
    base = minute_cache.get(key)
    if base is None:
        base = minute_cache[key] = _minute(key, text)
    t = s[17:]
    offset_s = 0
    if t.endswith("Z"):
        t = t[:-1]
    elif len(t) > 6 and t[-6] in "+-" and t[-3] == ":":
        try:
            offset_s = int(t[-5:-3]) * 3600 + int(t[-2:]) * 60
        except ValueError:
            raise FieldError(COLUMNS[0], _EXPECTED_TS, text) from None
        if t[-6] == "-":
            offset_s = -offset_s
        t = t[:-6]
    try:
        sec = float(t)
    except ValueError:
        raise FieldError(COLUMNS[0], _EXPECTED_TS, text) from None
    if not (0.0 <= sec < 61.0) or len(t) < 2:            # 61: leap second; rejects nan and 'S'
        raise FieldError(COLUMNS[0], _EXPECTED_TS, text)
    return base[0], base[1] + sec - offset_s


def read_azure(path: str | Path, skip_bad_rows: bool = False) -> Trace:
    path = str(path)
    with open_text(path) as f:
        reader = csv_reader(f)
        (i_ts, i_ctx, i_gen), _, header = read_csv_header(path, reader, "azure", COLUMNS)
        width = max(i_ts, i_ctx, i_gen) + 1
        out = RowCollector(path, skip_bad_rows, COLUMNS[0])
        minute_cache: dict[str, tuple[int, int]] = {}
        day0 = -1
        sod0 = 0.0
        for line, row in out.csv_rows(reader, width, header):
            try:
                day, sod = parse_timestamp(row[i_ts], minute_cache)
                n_prompt = parse_count(row[i_ctx], COLUMNS[1])
                n_output = parse_count(row[i_gen], COLUMNS[2])
                if day0 < 0:
                    day0, sod0 = day, sod
                out.add(line, (day - day0) * 86400.0 + (sod - sod0), row[i_ts], n_prompt, n_output)
            except FieldError as e:
                out.bad(e, line)
    return out.finish("azure")
