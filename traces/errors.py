"""The one error type of trace reading: it names the file, the line, the field and what was expected."""

from __future__ import annotations


class TraceFormatError(ValueError):
    """Bad trace input, e.g. `trace.csv:17: field 'ContextTokens': expected a non-negative integer, got 'abc'`.

    `line` is 1-based (None when the problem is the whole file); `field` is None for row- or file-level
    problems such as an unknown header.
    """

    def __init__(self, path: str, line: int | None, message: str, field: str | None = None) -> None:
        self.path = str(path)
        self.line = line
        self.field = field
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {message}")


class FieldError(Exception):
    """A bad value inside one row; the reader loop turns it into a TraceFormatError with path and line."""

    def __init__(self, field: str, expected: str, got: object, literal: bool = False) -> None:
        super().__init__(field, expected, got)
        self.field = field
        self.expected = expected
        self.got = got
        self.literal = literal      # got is a description to print as is, not a value to repr

    def describe(self) -> str:
        got_text = str(self.got) if self.literal else repr(self.got)
        if len(got_text) > 60:                      # e.g. a long hash list: show its start only
            got_text = got_text[:57] + "..."
        return f"field '{self.field}': expected {self.expected}, got {got_text}"

    def at(self, path: str, line: int | None) -> TraceFormatError:
        return TraceFormatError(path, line, self.describe(), field=self.field)
