"""sarathi-serve length statistics (e.g. ShareGPT): `num_prefill_tokens,num_decode_tokens,...`.

Lengths only, no timestamps: every request arrives at 0.0 (a burst). Give it arrival times with
`traces.synthetic.retime(trace, PoissonArrivals(rate_rps), seed)`.
"""

from __future__ import annotations

from pathlib import Path

from traces.errors import FieldError
from traces.readers._common import RowCollector, csv_reader, open_text, parse_count, read_csv_header
from traces.schema import Trace

COLUMNS = ("num_prefill_tokens", "num_decode_tokens")


def read_sharegpt_stats(path: str | Path, skip_bad_rows: bool = False) -> Trace:
    path = str(path)
    with open_text(path) as f:
        reader = csv_reader(f)
        (i_p, i_d), _, header = read_csv_header(path, reader, "sharegpt_stats", COLUMNS)
        width = max(i_p, i_d) + 1
        out = RowCollector(path, skip_bad_rows, "arrival")
        for line, row in out.csv_rows(reader, width, header):
            try:
                out.add(line, 0.0, "", parse_count(row[i_p], COLUMNS[0]), parse_count(row[i_d], COLUMNS[1]))
            except FieldError as e:
                out.bad(e, line)
    return out.finish("sharegpt_stats")
