"""The decision log: every scheduling decision, with the time it was taken.

One `Recorder` per core. Events are plain tuples `(now_s, kind, fields_dict)` so logging stays cheap; the
parity tests compare two logs, metrics and plots read them. `NullRecorder` turns logging off for sweeps.
"""

from __future__ import annotations

from typing import Any


class Recorder:
    """Collects decision events in order. `kinds` restricts what is kept (None = everything)."""

    __slots__ = ("events", "kinds")

    def __init__(self, kinds: frozenset[str] | None = None) -> None:
        self.events: list[tuple[float, str, dict[str, Any]]] = []
        self.kinds = kinds

    enabled = True

    def record(self, now_s: float, kind: str, **fields: Any) -> None:
        if self.kinds is None or kind in self.kinds:
            self.events.append((now_s, kind, fields))

    def of_kind(self, kind: str) -> list[tuple[float, str, dict[str, Any]]]:
        return [e for e in self.events if e[1] == kind]


class NullRecorder(Recorder):
    """Records nothing (callers check `.enabled` before building event fields on hot paths)."""

    __slots__ = ()
    enabled = False

    def record(self, now_s: float, kind: str, **fields: Any) -> None:
        return None
