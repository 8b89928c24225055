"""slotlab's native JSONL trace: the schema written out, so any trace (or a generated one) can be saved,
edited and replayed. Specification in docs/traces.md; summary:

    {"slotlab_native": 1, ...}                               optional first line (version, free metadata)
    {"arrival_s": 0.0, "n_prompt": 412, "n_output": 96}     one request per line, arrival order
    {"arrival_s": 0.7, "prompt_tokens": [1, 2, 3], "n_output": 8, "session_id": "u1"}
    {"arrival_s": 1.2, "n_prompt": 700, "block_hashes": [5, 6], "block_size": 512, "n_output": 16}
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from traces.errors import FieldError, TraceFormatError
from traces.readers._common import RowCollector, json_count, json_int_list, json_seconds, load_json_line, open_text
from traces.schema import Trace

VERSION = 1
HEADER_KEY = "slotlab_native"
FIELDS = ("arrival_s", "n_prompt", "n_output", "prompt_tokens", "block_hashes", "block_size", "session_id")


def _parse(obj: dict) -> tuple:
    for key in obj:
        if key not in FIELDS:
            # strict: a typo such as "n_ouput" must not silently become a default
            raise FieldError(key, f"no such field (native fields: {', '.join(FIELDS)})", key)
    arrival_s = json_seconds(obj, "arrival_s")
    n_output = json_count(obj, "n_output")
    n_prompt = json_count(obj, "n_prompt", required=False)
    tokens = None
    if "prompt_tokens" in obj:
        tokens = json_int_list(obj, "prompt_tokens")
        if n_prompt is not None and n_prompt != len(tokens):
            raise FieldError("n_prompt", f"len(prompt_tokens) = {len(tokens)}", n_prompt)
        n_prompt = len(tokens)
    elif n_prompt is None:
        raise FieldError("n_prompt", "a non-negative integer (or a prompt_tokens list)", "<missing>", literal=True)
    hashes: tuple[int, ...] = ()
    block_size = 0
    if "block_hashes" in obj:
        hashes = json_int_list(obj, "block_hashes")
        block_size = json_count(obj, "block_size")
        if hashes and block_size == 0:
            raise FieldError("block_size", "a positive integer when block_hashes is given", 0)
    elif "block_size" in obj:
        raise FieldError("block_size", "to come with block_hashes", obj["block_size"])
    session = obj.get("session_id")
    if session is not None and not isinstance(session, str):
        raise FieldError("session_id", "a string or null", session)
    return arrival_s, n_prompt, n_output, session, tokens, hashes, block_size


def read_native(path: str | Path, skip_bad_rows: bool = False) -> Trace:
    path = str(path)
    out = RowCollector(path, skip_bad_rows, "arrival_s")
    first = True
    with open_text(path) as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                obj = load_json_line(path, line, text)
                if first and HEADER_KEY in obj:
                    first = False
                    if obj[HEADER_KEY] != VERSION:
                        raise TraceFormatError(path, line, f"field '{HEADER_KEY}': expected version {VERSION}, "
                                                           f"got {obj[HEADER_KEY]!r}", field=HEADER_KEY)
                    continue
                first = False
                arrival_s, n_prompt, n_output, session, tokens, hashes, bs = _parse(obj)
                out.add(line, arrival_s, obj["arrival_s"], n_prompt, n_output, session, tokens, hashes, bs)
            except FieldError as e:
                out.bad(e, line)
            except TraceFormatError as e:
                if e.field == HEADER_KEY:
                    raise                       # a wrong version is a file-level error, never skipped
                out.bad(e, line)
    if first:
        raise TraceFormatError(path, None, "file is empty (expected native JSONL: one object per line "
                                           "with arrival_s, n_prompt or prompt_tokens, n_output)")
    return out.finish("native")


def write_native_jsonl(trace: Trace, path: str | Path) -> None:
    """Write `trace` as native JSONL (header line with its origin, then one request per line).

    Floats are written with repr precision, so reading the file back gives equal requests (except
    `source_line`, which becomes the line in the new file).
    """
    path = str(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps({HEADER_KEY: VERSION, "origin_format": trace.format, "origin_source": trace.source})
                + "\n")
        for r in trace.requests:
            obj: dict = {"arrival_s": r.arrival_s, "n_prompt": r.n_prompt, "n_output": r.n_output}
            if r.prompt_tokens is not None:
                obj["prompt_tokens"] = list(r.prompt_tokens)
            if r.block_hashes:
                obj["block_hashes"] = list(r.block_hashes)
                obj["block_size"] = r.block_size
            if r.session_id is not None:
                obj["session_id"] = r.session_id
            f.write(json.dumps(obj, separators=(",", ":")) + "\n")
