"""slotlab's native JSONL trace: the schema written out, so any trace (or a generated one) can be saved,
edited and replayed. Specification in docs/traces.md; summary:

    {"slotlab_native": 1, ...}                               optional first line (version, free metadata)
    {"arrival_s": 0.0, "n_prompt": 412, "n_output": 96}     one request per line, arrival order
    {"arrival_s": 0.7, "prompt_tokens": [1, 2, 3], "n_output": 8, "session_id": "u1"}
    {"arrival_s": 1.2, "n_prompt": 700, "block_hashes": [5, 6], "block_size": 512, "n_output": 16}
    {"arrival_s": 2.0, "prompt_tokens": [1, 2], "output_tokens": [9, 2], "sampling": {"n_predict": 8},
     "recorded": {"endpoint": "/completion", "end_s": 2.3, "id_slot": 0, "n_cached": 0, ...}}   (slotlab record)

A header with `"line_order": "end"` (what `slotlab record` writes: each line as its request ends) lets
lines come in any time order; the requests are then sorted by arrival.
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
FIELDS = ("arrival_s", "n_prompt", "n_output", "prompt_tokens", "block_hashes", "block_size", "session_id",
          "output_tokens", "sampling", "recorded")
LINE_ORDERS = ("arrival", "end")      # header "line_order": lines sorted by arrival (default) or by request end

# sampling: keys the simulator reads are type-checked; any other generation parameter is kept as given
_INT_MIN = {"n_predict": -1, "id_slot": -1, "n_keep": -1, "n_discard": 0, "n_cache_reuse": 0, "seed": None}
_BOOLS = ("ignore_eos", "cache_prompt", "stream", "return_tokens")
# recorded: every key is known and typed (a typo must not pass)
_REC_STR = ("endpoint", "stop_type", "tokens_source")
_REC_BOOL = ("stream",)
_REC_SECONDS = ("end_s", "first_byte_s")
_REC_INT = {"status": 0, "id_slot": -1, "n_cached": 0, "n_prompt_server": 0, "n_results": 1, "result_index": 0}
RECORDED_FIELDS = (*_REC_STR, *_REC_BOOL, *_REC_SECONDS, *_REC_INT, "timings")


def _is_int(v: object) -> bool:
    return type(v) is int


def _sampling(obj: dict) -> dict:
    s = obj["sampling"]
    if not isinstance(s, dict):
        raise FieldError("sampling", "an object of generation parameters", s)
    for key, v in s.items():
        if key in _BOOLS and type(v) is not bool:
            raise FieldError(f"sampling.{key}", "true or false", v)
        if key in _INT_MIN:
            lo = _INT_MIN[key]
            if not _is_int(v) or (lo is not None and v < lo):
                raise FieldError(f"sampling.{key}", "an integer" + (f" >= {lo}" if lo is not None else ""), v)
        if key == "temperature" and (type(v) not in (int, float)):
            raise FieldError("sampling.temperature", "a number", v)
    return s


def _recorded(obj: dict) -> dict:
    r = obj["recorded"]
    if not isinstance(r, dict):
        raise FieldError("recorded", "an object (what the upstream answered)", r)
    for key, v in r.items():
        f = f"recorded.{key}"
        if key in _REC_STR:
            if not isinstance(v, str):
                raise FieldError(f, "a string", v)
        elif key in _REC_BOOL:
            if type(v) is not bool:
                raise FieldError(f, "true or false", v)
        elif key in _REC_SECONDS:
            if v is not None and (type(v) not in (int, float) or not (0.0 <= v < float("inf"))):
                raise FieldError(f, "a non-negative number of seconds or null", v)
        elif key in _REC_INT:
            if v is not None and (not _is_int(v) or v < _REC_INT[key]):
                raise FieldError(f, f"an integer >= {_REC_INT[key]} or null", v)
        elif key == "timings":
            if v is not None and (not isinstance(v, dict) or not all(
                    isinstance(k, str) and type(x) in (int, float) for k, x in v.items())):
                raise FieldError(f, "an object of numbers (llama-server's timings) or null", v)
        else:
            raise FieldError(f, f"no such field (recorded fields: {', '.join(RECORDED_FIELDS)})", key)
    end = r.get("end_s")
    if end is not None and end < obj["arrival_s"]:
        raise FieldError("recorded.end_s", f"a time not before arrival_s ({obj['arrival_s']})", end)
    return r


def _parse(obj: dict) -> tuple:
    for key in obj:
        if key not in FIELDS:
            # strict: a typo such as "n_ouput" must not silently become a default
            raise FieldError(key, f"no such field (native fields: {', '.join(FIELDS)})", key)
    arrival_s = json_seconds(obj, "arrival_s")
    out_tokens = None
    if "output_tokens" in obj:
        out_tokens = json_int_list(obj, "output_tokens")
        n_output = json_count(obj, "n_output", required=False)
        if n_output is not None and n_output != len(out_tokens):
            raise FieldError("n_output", f"len(output_tokens) = {len(out_tokens)}", n_output)
        n_output = len(out_tokens)
    else:
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
    extra = {}
    if out_tokens is not None:
        extra["output_tokens"] = out_tokens
    if obj.get("sampling") is not None:
        extra["sampling"] = _sampling(obj)
    if obj.get("recorded") is not None:
        extra["recorded"] = _recorded(obj)
    return arrival_s, n_prompt, n_output, session, tokens, hashes, block_size, extra


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
                    order = obj.get("line_order", "arrival")
                    if order not in LINE_ORDERS:
                        raise TraceFormatError(path, line, f"field 'line_order': expected one of "
                                               f"{', '.join(LINE_ORDERS)}, got {order!r}", field=HEADER_KEY)
                    out.ordered = order == "arrival"
                    continue
                first = False
                arrival_s, n_prompt, n_output, session, tokens, hashes, bs, extra = _parse(obj)
                out.add(line, arrival_s, obj["arrival_s"], n_prompt, n_output, session, tokens, hashes, bs,
                        **extra)
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
            if r.output_tokens is not None:
                del obj["n_output"]
                obj["output_tokens"] = list(r.output_tokens)
            if r.sampling is not None:
                obj["sampling"] = r.sampling
            if r.recorded is not None:
                obj["recorded"] = r.recorded
            f.write(json.dumps(obj, separators=(",", ":")) + "\n")
