"""Save and load a ChatWorkload as JSON (one object) or JSONL (a header line, then one session per line)."""

from __future__ import annotations

import json
from pathlib import Path

from traces.errors import FieldError, TraceFormatError
from traces.readers._common import json_count, json_seconds, load_json_line, open_text
from traces.synthetic.chat import ChatSession, ChatWorkload, Turn

HEADER_KEY = "slotlab_chat_workload"
VERSION = 1


def _session_obj(s: ChatSession) -> dict:
    return {"session_id": s.session_id, "start_s": s.start_s, "system_prompt_id": s.system_prompt_id,
            "turns": [_turn_obj(t) for t in s.turns]}


def _turn_obj(t: Turn) -> dict:
    obj = {"n_user": t.n_user, "n_output": t.n_output, "think_s": t.think_s}
    if t.send_at_s is not None:
        obj["send_at_s"] = t.send_at_s
    return obj


def save_chat_workload(workload: ChatWorkload, path: str | Path) -> None:
    """`.json` -> one object with a `sessions` list; any other name -> JSONL (header, then sessions)."""
    header = {HEADER_KEY: VERSION, "seed": workload.seed,
              "system_prompt_lengths": list(workload.system_prompt_lengths)}
    with open(path, "w", encoding="utf-8") as f:
        if str(path).endswith(".json"):
            json.dump({**header, "sessions": [_session_obj(s) for s in workload.sessions]}, f, indent=1)
            f.write("\n")
            return
        f.write(json.dumps(header) + "\n")
        for s in workload.sessions:
            f.write(json.dumps(_session_obj(s), separators=(",", ":")) + "\n")


def _session(obj: object) -> ChatSession:
    if not isinstance(obj, dict):
        raise FieldError("session", "a JSON object", obj)
    sid = obj.get("session_id")
    if not isinstance(sid, str):
        raise FieldError("session_id", "a string", sid)
    turns_obj = obj.get("turns")
    if not isinstance(turns_obj, list) or not turns_obj:
        raise FieldError("turns", "a non-empty list of {n_user, n_output, think_s}", turns_obj)
    turns = []
    for t in turns_obj:
        if not isinstance(t, dict):
            raise FieldError("turns", "objects with n_user, n_output, think_s", t)
        send_at = json_seconds(t, "send_at_s") if t.get("send_at_s") is not None else None
        turns.append(Turn(json_count(t, "n_user"), json_count(t, "n_output"), json_seconds(t, "think_s"), send_at))
    return ChatSession(sid, json_seconds(obj, "start_s"), json_count(obj, "system_prompt_id"), tuple(turns))


def _header(path: str, obj: dict, line: int | None) -> tuple[int, tuple[int, ...]]:
    if obj.get(HEADER_KEY) != VERSION:
        raise TraceFormatError(path, line, f"field '{HEADER_KEY}': expected {VERSION} (a chat workload file), "
                                           f"got {obj.get(HEADER_KEY)!r}", field=HEADER_KEY)
    seed = obj.get("seed")
    lengths = obj.get("system_prompt_lengths")
    if type(seed) is not int:
        raise FieldError("seed", "an integer", seed).at(path, line)
    if not isinstance(lengths, list) or not all(type(n) is int and n >= 0 for n in lengths):
        raise FieldError("system_prompt_lengths", "a list of non-negative integers", lengths).at(path, line)
    return seed, tuple(lengths)


def _workload(path: str, sessions: list[ChatSession], lengths: tuple[int, ...], seed: int) -> ChatWorkload:
    try:
        return ChatWorkload(tuple(sessions), lengths, seed)
    except ValueError as e:
        raise TraceFormatError(path, None, str(e)) from None


def load_chat_workload(path: str | Path) -> ChatWorkload:
    path = str(path)
    with open_text(path) as f:
        text = f.read()
    if not text.strip():
        raise TraceFormatError(path, None, "file is empty (expected a chat workload, JSON or JSONL)")
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, dict) and "sessions" in whole:
        seed, lengths = _header(path, whole, None)
        sessions = []
        for i, obj in enumerate(whole["sessions"] if isinstance(whole["sessions"], list) else [None]):
            try:
                sessions.append(_session(obj))
            except FieldError as e:
                raise TraceFormatError(path, None, f"sessions[{i}]: {e.describe()}", field=e.field) from None
        return _workload(path, sessions, lengths, seed)
    header = None
    sessions = []
    for line, row in enumerate(text.splitlines(), 1):
        if not row.strip():
            continue
        obj = load_json_line(path, line, row)
        if header is None:
            header = _header(path, obj, line)
            continue
        try:
            sessions.append(_session(obj))
        except FieldError as e:
            raise e.at(path, line) from None
    seed, lengths = header  # type: ignore[misc]
    return _workload(path, sessions, lengths, seed)
