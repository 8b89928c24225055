"""Mooncake JSONL traces (FAST'25 release: synthetic, conversation, tool-agent):
`{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}`.

`timestamp` is milliseconds from the trace start (kept, converted to seconds). `hash_ids` are prefix-block
hashes over blocks of 512 tokens: equal ids = identical block; a prompt is its blocks in order, the last
one partial. The reader does not insist that len(hash_ids) == ceil(input_length / 512) (it holds for the
public synthetic trace); materialisation cuts extra blocks and pads missing ones with unique tokens.
"""

from __future__ import annotations

from pathlib import Path

from traces.errors import FieldError, TraceFormatError
from traces.readers._common import RowCollector, json_count, json_int_list, json_seconds, load_json_line, open_text
from traces.schema import Trace

BLOCK_SIZE = 512
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def read_mooncake(path: str | Path, skip_bad_rows: bool = False, block_size: int = BLOCK_SIZE) -> Trace:
    path = str(path)
    out = RowCollector(path, skip_bad_rows, "timestamp")
    seen_any = False
    with open_text(path) as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            seen_any = True
            try:
                obj = load_json_line(path, line, text)
                arrival_s = json_seconds(obj, "timestamp", 1e-3)
                n_prompt = json_count(obj, "input_length")
                n_output = json_count(obj, "output_length")
                hashes = json_int_list(obj, "hash_ids") if "hash_ids" in obj else ()
                out.add(line, arrival_s, obj["timestamp"], n_prompt, n_output,
                        block_hashes=hashes, block_size=block_size if hashes else 0)
            except (FieldError, TraceFormatError) as e:
                out.bad(e, line)
    if not seen_any:
        raise TraceFormatError(path, None, "file is empty (expected Mooncake JSONL: one object per line "
                                           "with timestamp, input_length, output_length, hash_ids)")
    return out.finish("mooncake")
