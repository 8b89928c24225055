"""Server-sent events as llama-server writes them (`server-http.cpp`, `format_sse`).

Native (/completion) streams are `data: {json}\\n\\n` events with no terminator; OpenAI-compatible streams
end with `data: [DONE]\\n\\n`; an error after the first event is sent as `data: {"error": {...}}\\n\\n`.
"""

from __future__ import annotations

from typing import Any

from engine.http.jsonutil import dumps

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
PING = b":\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj).encode("utf-8") + b"\n\n"
