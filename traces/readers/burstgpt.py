"""BurstGPT CSV: `Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type`.

`Timestamp` is already seconds from the trace start and is kept as is. `Session ID` (absent in the v1
release, empty for API rows) becomes `session_id`. Rows with 0 response tokens are failed requests in
the original logs; they are kept as given (n_output = 0). `Elapsed time`, `Total tokens` and `Log Type`
are not used.
"""

from __future__ import annotations

from pathlib import Path

from traces.errors import FieldError
from traces.readers._common import (RowCollector, csv_reader, open_text, parse_count, parse_seconds,
                                    read_csv_header)
from traces.schema import Trace

COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
OPTIONAL = ("Session ID", "Model")


def read_burstgpt(path: str | Path, skip_bad_rows: bool = False, model: str | None = None) -> Trace:
    """Read a BurstGPT file; `model` (e.g. 'ChatGPT', 'GPT-4') keeps only that model's rows.

    Rows dropped by the model filter are not bad rows: they do not count in `n_skipped`.
    """
    path = str(path)
    with open_text(path) as f:
        reader = csv_reader(f)
        (i_ts, i_req, i_resp), (i_sess, i_model), header = read_csv_header(path, reader, "burstgpt", COLUMNS,
                                                                          OPTIONAL)
        if model is not None and i_model is None:
            raise ValueError(f"{path}: model filter {model!r} given but the file has no 'Model' column")
        width = max(i for i in (i_ts, i_req, i_resp, i_sess, i_model) if i is not None) + 1
        out = RowCollector(path, skip_bad_rows, COLUMNS[0])
        for line, row in out.csv_rows(reader, width, header):
            try:
                if model is not None and row[i_model].strip() != model:
                    continue
                arrival_s = parse_seconds(row[i_ts], COLUMNS[0])
                n_prompt = parse_count(row[i_req], COLUMNS[1])
                n_output = parse_count(row[i_resp], COLUMNS[2])
                session = row[i_sess].strip() if i_sess is not None else ""
                out.add(line, arrival_s, row[i_ts], n_prompt, n_output, session or None)
            except FieldError as e:
                out.bad(e, line)
    return out.finish("burstgpt")
