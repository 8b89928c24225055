"""Deferred-queue policies (`server_queue::pop_deferred_task`)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.slot import Slot
from engine.core.tokens import common_prefix
from engine.core.types import Task


class Fifo:
    """Upstream: the first deferred task that named the released slot, else the oldest deferred task."""

    reads_deferred_prompts = False   # see engine.core.protocols.QueueOrder

    def pick_deferred(self, deferred: Sequence[Task], released: Slot, any_named: bool = True) -> int:
        for i, t in enumerate(deferred if any_named else ()):
            if t.id_slot == released.id:
                return i
        return 0


class ShortestPromptFirst:
    """A task naming the released slot first (as upstream), else the deferred task with the shortest prompt."""

    def pick_deferred(self, deferred: Sequence[Task], released: Slot, any_named: bool = True) -> int:
        for i, t in enumerate(deferred if any_named else ()):
            if t.id_slot == released.id:
                return i
        return min(range(len(deferred)), key=lambda i: (len(deferred[i].tokens), i))


class MostCachedFirst:
    """A task naming the released slot first, else the task sharing the longest prefix with the released
    slot's tokens (ties: oldest) — cache-aware admission."""

    def pick_deferred(self, deferred: Sequence[Task], released: Slot, any_named: bool = True) -> int:
        for i, t in enumerate(deferred if any_named else ()):
            if t.id_slot == released.id:
                return i
        return max(range(len(deferred)), key=lambda i: (common_prefix(released.tokens, deferred[i].tokens), -i))
