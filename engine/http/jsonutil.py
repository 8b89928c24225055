"""JSON output the way llama-server writes it, and its error bodies (`format_error_response`, server-common.cpp).

Keys keep insertion order; non-finite floats become `null` (nlohmann::json does that); text is UTF-8, not
ASCII-escaped.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.responses import Response

from engine.core.errors import ErrorType

FLT_MAX = 3.4028234663852886e38        # std::numeric_limits<float>::max(): upstream's stand-in for log(0)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:                  # a NaN/inf somewhere: rewrite it as null, as nlohmann does
        return json.dumps(_finite(obj), ensure_ascii=False, separators=(",", ":"))


class JSONResponse(Response):
    media_type = "application/json; charset=utf-8"

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


class HTTPError(Exception):
    """An error answered as `{"error": {"code", "message", "type"}}` with the type's HTTP status."""

    def __init__(self, etype: ErrorType, message: str, extra: dict[str, Any] | None = None,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.etype = etype
        self.message = message
        self.extra = extra or {}
        self.status = status if status is not None else etype.http_status

    def body(self) -> dict[str, Any]:
        return error_body(self.etype, self.message, self.extra, self.status)


def error_body(etype: ErrorType, message: str, extra: dict[str, Any] | None = None,
               code: int | None = None) -> dict[str, Any]:
    err = {"code": code if code is not None else etype.http_status, "message": message, "type": etype.value}
    if extra:
        err.update(extra)
    return {"error": err}


def error_response(etype: ErrorType, message: str, extra: dict[str, Any] | None = None,
                   status: int | None = None) -> JSONResponse:
    status = status if status is not None else etype.http_status
    return JSONResponse(error_body(etype, message, extra, status), status_code=status)


def bad_request(message: str) -> HTTPError:
    return HTTPError(ErrorType.INVALID_REQUEST, message)


def json_type_name(value: Any) -> str:
    """nlohmann::json's type_name() of a parsed JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"
