"""Readers for public trace formats and `read_trace`, which detects the format from the first line."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Callable

from traces.errors import TraceFormatError
from traces.readers._common import open_text
from traces.readers.azure import read_azure
from traces.readers.burstgpt import read_burstgpt
from traces.readers.mooncake import read_mooncake
from traces.readers.native import read_native, write_native_jsonl
from traces.readers.sharegpt_stats import read_sharegpt_stats
from traces.readers.vidur import read_vidur
from traces.schema import Trace

# Format name -> reader. SIGNATURES: the columns (CSV) or keys (JSONL) that identify a format, tried in
# this order (vidur before sharegpt_stats: a Vidur header also has the two length columns).
READERS: dict[str, Callable[..., Trace]] = {
    "azure": read_azure,
    "burstgpt": read_burstgpt,
    "vidur": read_vidur,
    "sharegpt_stats": read_sharegpt_stats,
    "mooncake": read_mooncake,
    "native": read_native,
}
SIGNATURES: dict[str, tuple[str, ...]] = {
    "azure": ("timestamp", "contexttokens", "generatedtokens"),
    "burstgpt": ("timestamp", "request tokens", "response tokens"),
    "vidur": ("arrived_at", "num_prefill_tokens", "num_decode_tokens"),
    "sharegpt_stats": ("num_prefill_tokens", "num_decode_tokens"),
    "mooncake": ("timestamp", "input_length", "output_length"),
    "native": ("arrival_s",),
}
ALIASES = {"splitwise": "vidur", "sharegpt": "sharegpt_stats", "slotlab": "native", "jsonl": "native"}
JSONL_FORMATS = frozenset({"mooncake", "native"})
FORMATS = tuple(READERS)


def _known() -> str:
    return "; ".join(f"{name} ({', '.join(cols)})" for name, cols in SIGNATURES.items())


def detect_format(path: str | Path) -> str:
    """The format name of a trace file, decided from its first non-blank line.

    A JSON object line means Mooncake (timestamp + input_length) or native (arrival_s or a
    `slotlab_native` header); otherwise the line is a CSV header matched by column names.
    """
    path = str(path)
    with open_text(path) as f:
        first = ""
        for text in f:
            if text.strip():
                first = text.strip()
                break
    if not first:
        raise TraceFormatError(path, None, "file is empty (no header line to detect the format from)")
    if first.startswith("{"):
        try:
            keys = {k.lower() for k in json.loads(first)}
        except (ValueError, AttributeError):
            raise TraceFormatError(path, 1, "the first line looks like JSON but does not parse as an object") \
                from None
        if "slotlab_native" in keys:
            return "native"
        seen = "JSON keys " + ", ".join(sorted(keys))
    else:
        keys = {c.strip().lower() for c in next(csv.reader([first]))}
        seen = first
    is_json = first.startswith("{")
    for name, cols in SIGNATURES.items():
        if (name in JSONL_FORMATS) == is_json and all(c in keys for c in cols):
            return name
    raise TraceFormatError(path, 1, f"unknown trace format: saw {seen[:200]!r}; known formats (name: "
                                    f"identifying columns/keys): {_known()}")


def canonical_format(name: str) -> str:
    key = name.strip().lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in READERS:
        raise ValueError(f"unknown trace format {name!r}; choose one of {', '.join(FORMATS)} "
                         f"(aliases: {', '.join(f'{a}={b}' for a, b in ALIASES.items())})")
    return key


def read_trace(path: str | Path, format: str | None = None, skip_bad_rows: bool = False, *,
               model: str | None = None) -> Trace:
    """Read any supported trace into the common schema.

    `format` overrides detection (`--trace-format` names: azure, burstgpt, vidur/splitwise, mooncake,
    sharegpt_stats, native). Bad rows raise TraceFormatError naming file, line and field, unless
    `skip_bad_rows`, which drops them and counts them in `Trace.n_skipped`. `model` filters BurstGPT rows.
    """
    fmt = canonical_format(format) if format is not None else detect_format(path)
    if model is not None:
        if fmt != "burstgpt":
            raise ValueError(f"the model filter applies to burstgpt traces only, not {fmt!r}")
        return read_burstgpt(path, skip_bad_rows, model=model)
    return READERS[fmt](path, skip_bad_rows)


__all__ = ["FORMATS", "READERS", "canonical_format", "detect_format", "read_azure", "read_burstgpt",
           "read_mooncake", "read_native", "read_sharegpt_stats", "read_trace", "read_vidur",
           "write_native_jsonl"]
