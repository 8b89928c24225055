"""Errors of the serving core, with llama-server's error types (`error_type` in tools/server/server-common.h,
mapped to type strings and HTTP codes by `format_error_response` in tools/server/server-common.cpp)."""

from __future__ import annotations

from enum import Enum


class ErrorType(str, Enum):
    """llama-server error types; `.http_status` is the status upstream answers with."""

    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    PERMISSION = "permission_error"
    NOT_FOUND = "not_found_error"
    SERVER = "server_error"
    NOT_SUPPORTED = "not_supported_error"
    UNAVAILABLE = "unavailable_error"
    EXCEED_CONTEXT_SIZE = "exceed_context_size_error"

    @property
    def http_status(self) -> int:
        return _STATUS[self]


_STATUS = {
    ErrorType.INVALID_REQUEST: 400,
    ErrorType.AUTHENTICATION: 401,
    ErrorType.PERMISSION: 403,
    ErrorType.NOT_FOUND: 404,
    ErrorType.SERVER: 500,
    ErrorType.NOT_SUPPORTED: 501,
    ErrorType.UNAVAILABLE: 503,
    ErrorType.EXCEED_CONTEXT_SIZE: 400,
}


class ConfigError(ValueError):
    """An invalid server configuration value (upstream rejects it at start-up)."""
