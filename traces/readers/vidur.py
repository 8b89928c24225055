"""Vidur / Splitwise processed traces: `arrived_at,num_prefill_tokens,num_decode_tokens` (extra columns
ignored). `arrived_at` is seconds from the trace start and is kept as is."""

from __future__ import annotations

from pathlib import Path

from traces.errors import FieldError
from traces.readers._common import (RowCollector, csv_reader, open_text, parse_count, parse_seconds,
                                    read_csv_header)
from traces.schema import Trace

COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")


def read_vidur(path: str | Path, skip_bad_rows: bool = False) -> Trace:
    path = str(path)
    with open_text(path) as f:
        reader = csv_reader(f)
        (i_t, i_p, i_d), _, header = read_csv_header(path, reader, "vidur", COLUMNS)
        width = max(i_t, i_p, i_d) + 1
        out = RowCollector(path, skip_bad_rows, COLUMNS[0])
        for line, row in out.csv_rows(reader, width, header):
            try:
                out.add(line, parse_seconds(row[i_t], COLUMNS[0]), row[i_t],
                        parse_count(row[i_p], COLUMNS[1]), parse_count(row[i_d], COLUMNS[2]))
            except FieldError as e:
                out.bad(e, line)
    return out.finish("vidur")
