"""Slot selection policies (`get_available_slot`, tools/server/server-context.cpp)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.protocols import Selection
from engine.core.slot import Slot
from engine.core.tokens import common_prefix
from engine.core.types import Task


def _lru(slots: Sequence[Slot]) -> Slot | None:
    """Least recently used idle slot; `<=` so ties go to the LAST idle slot, as upstream."""
    ret = None
    t_last = -1.0
    for s in slots:
        if s.state:                      # processing (IDLE is 0); the test `is_processing` makes, inlined
            continue
        if ret is None or s.t_last_used_s <= t_last:
            t_last = s.t_last_used_s
            ret = s
    return ret


def _by_id(task: Task, slots: Sequence[Slot]) -> Slot | None:
    # upstream get_slot_by_id wraps modulo the slot count; negative ids never reach here (-1 = any)
    return slots[task.id_slot % len(slots)] if task.id_slot >= 0 else None


class LcpLru:
    """Upstream: `id_slot`; else the idle slot whose tokens share the largest prefix with the prompt, if that
    share is strictly above the similarity threshold; else LRU. The RAM cache is updated on an LRU pick or
    when the similarity pick keeps less than half of the slot's context (f_keep < 0.5)."""

    busy_tokens_read = False         # see engine.core.protocols.SlotSelector

    def select(self, task: Task, slots: Sequence[Slot], similarity: float) -> Selection | None:
        ret = _by_id(task, slots)
        reason = "id_slot"
        update_cache = False
        f_sim_best = 0.0
        lru = None                       # _lru(slots), found in the same pass when similarity matching is on
        if similarity != 0.0:
            tokens = task.tokens
            n = len(tokens)
            id_slot = task.id_slot
            t_last = -1.0
            for s in slots:
                if s.state:                                      # processing (IDLE is 0)
                    continue
                if lru is None or s.t_last_used_s <= t_last:     # as _lru: ties go to the last idle slot
                    t_last = s.t_last_used_s
                    lru = s
                if not s.tokens:
                    continue
                if id_slot != -1 and s.id != id_slot:            # raw id, as upstream
                    continue
                f_sim = common_prefix(s.tokens, tokens) / n if n else 0.0
                if f_sim > f_sim_best and f_sim > similarity:
                    f_sim_best, ret, reason = f_sim, s, "similarity"
            if ret is not None:
                # an id_slot pick that no similarity match confirmed has f_sim_best 0, so f_keep 0 ->
                # update_cache, as in upstream's get_available_slot (tools/server/server-context.cpp)
                f_keep = f_sim_best * n / len(ret.tokens) if ret.tokens else 0.0
                update_cache = f_keep < 0.5
        if ret is None:
            ret = lru if similarity != 0.0 else _lru(slots)
            if ret is None:
                return None
            reason, update_cache = "lru", True
        return Selection(ret, update_cache, reason, f_sim_best)


class LruOnly:
    """`id_slot`, else LRU (similarity matching off whatever -sps says); the cache is updated on every LRU pick."""

    busy_tokens_read = False         # see engine.core.protocols.SlotSelector

    def select(self, task: Task, slots: Sequence[Slot], similarity: float) -> Selection | None:
        ret = _by_id(task, slots)
        if ret is not None:
            return Selection(ret, False, "id_slot")
        ret = _lru(slots)
        return None if ret is None else Selection(ret, True, "lru")


class RoundRobin:
    """`id_slot`, else the next idle slot after the one chosen last (cyclic)."""

    busy_tokens_read = False         # see engine.core.protocols.SlotSelector

    def __init__(self) -> None:
        self._last = -1

    def select(self, task: Task, slots: Sequence[Slot], similarity: float) -> Selection | None:
        ret = _by_id(task, slots)
        if ret is not None:
            return Selection(ret, False, "id_slot")
        n = len(slots)
        for k in range(1, n + 1):
            s = slots[(self._last + k) % n]
            if not s.is_processing:
                self._last = s.id
                return Selection(s, True, "round_robin")
        return None


class SessionAffinity:
    """`id_slot`, else the idle slot that last served the same session (task.user.session_id), else upstream's
    LCP/LRU choice. Models a router that pins conversations to slots."""

    busy_tokens_read = False         # see engine.core.protocols.SlotSelector

    def __init__(self) -> None:
        self._slot_of: dict[object, int] = {}
        self._fallback = LcpLru()

    def select(self, task: Task, slots: Sequence[Slot], similarity: float) -> Selection | None:
        session = getattr(task.user, "session_id", None)
        sel = None
        if task.id_slot < 0 and session is not None and session in self._slot_of:
            s = slots[self._slot_of[session]]
            if not s.is_processing:
                sel = Selection(s, False, "session")
        if sel is None:
            sel = self._fallback.select(task, slots, similarity)
        if sel is not None and session is not None and not sel.slot.is_processing:
            self._slot_of[session] = sel.slot.id
        return sel
