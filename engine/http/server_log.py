"""The serving core's decisions as llama-server logs them, for people who grep server logs.

`ServerLog` is a `Recorder` the server hands its core: each decision event becomes one log line in
upstream's wording and layout (the `SLT_*` / `SRV_*` macros of tools/server/server-common.h:
`slot <function>: id <slot> | task <task> | <message>` and `srv  <function>: <message>`), for the events
users look for: slot selection (`get_available_slot`), prompt-cache save, load and eviction
(`server_slot::prompt_save`, `server_prompt_cache::alloc` / `load` / `update`), idle-slot purges
(`try_clear_idle_slots`), context shift and n_batch halving (`update_slots`). Lines at upstream's INFO
level go to INFO, its WRN to WARNING, its TRC (trace) lines to DEBUG. Deliberate difference: the
similarity line omits upstream's `f_keep` (the core's selection event does not carry it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engine.core.recorder import Recorder

log = logging.getLogger("slotlab.server")
MIB = 1024.0 * 1024.0


def _fn(name: str) -> str:
    """`%12.*s` of the function name: at most 12 characters, right-aligned."""
    return f"{name[:12]:>12}"


class ServerLog(Recorder):
    """Logs core events in llama-server's wording; keeps nothing."""

    __slots__ = ("size_of", "slots", "thold", "limit_mib", "_sizes")

    def __init__(self, size_of: Callable[[int], int], similarity: float, limit_bytes: int) -> None:
        super().__init__()
        self.size_of = size_of                  # state bytes of a prompt of n tokens
        self.slots: list = []                   # the core's slots (`bind`), for a slot's last use
        self.thold = similarity
        self.limit_mib = limit_bytes / MIB if limit_bytes > 0 else float("inf")
        self._sizes: dict[int, int] = {}        # cache entry -> bytes

    enabled = True

    def bind(self, slots: list) -> None:
        self.slots = slots

    def record(self, now_s: float, kind: str, **f: Any) -> None:
        handler = getattr(self, "_" + kind, None)
        if handler is not None:
            handler(f)

    @staticmethod
    def _slot(level: int, fn: str, slot: int, task: int, msg: str) -> None:
        log.log(level, "slot %s: id %2d | task %d | %s", _fn(fn), slot, task, msg)

    @staticmethod
    def _srv(level: int, fn: str, msg: str) -> None:
        log.log(level, "srv  %s: %s", _fn(fn), msg)

    # --- events ---------------------------------------------------------------------------------------------
    def _select(self, f: dict) -> None:
        reason, slot, task = f["reason"], f["slot"], f["task"]
        if reason == "id_slot":
            msg = f"selected slot by id ({slot})"
        elif reason == "similarity":
            msg = f"selected slot by LCP similarity, f_sim_best = {f['f_sim']:.3f} (> {self.thold:.3f} thold)"
        elif reason == "lru":
            t = self.slots[slot].t_last_used_s if slot < len(self.slots) else -1.0
            msg = f"selected slot by LRU, t_last = {int(t * 1e6) if t >= 0 else -1}"
        else:
            msg = f"selected slot by {reason}"
        self._slot(logging.INFO, "get_availabl", slot, task, msg)

    def _cache_save(self, f: dict) -> None:
        size = self.size_of(f["n_tokens"])
        self._sizes[f["entry"]] = size
        self._srv(logging.DEBUG, "prompt_save", f" - saving prompt with length {f['n_tokens']}, total state size = "
                  f"{size / MIB:.3f} MiB")
        self._srv(logging.DEBUG, "update", f" - cache state: {f['n_entries']} prompts, "
                  f"{f['cache_bytes'] / MIB:.3f} MiB (limits: {self.limit_mib:.3f} MiB)")

    def _cache_skip(self, f: dict) -> None:
        if f.get("reason") == "exceeds_limit":
            self._srv(logging.WARNING, "alloc", f" - prompt state size {f['size_bytes'] / MIB:.3f} MiB exceeds "
                      f"cache size limit {self.limit_mib:.3f} MiB, skipping")

    def _cache_drop(self, f: dict) -> None:
        size = self._sizes.pop(f["entry"], self.size_of(f["n_tokens"])) / MIB
        reason = f.get("reason", "")
        if reason == "evict_make_room":
            self._srv(logging.WARNING, "alloc", f" - making room for prompt cache entry, removing oldest entry "
                      f"(size = {size:.3f} MiB)")
        elif reason == "evict_size_limit":
            self._srv(logging.WARNING, "update", f" - cache size limit reached, removing oldest entry "
                      f"(size = {size:.3f} MiB)")
        elif reason == "evict_token_limit":
            self._srv(logging.WARNING, "update", f" - cache token limit reached, removing oldest entry "
                      f"(size = {size:.3f} MiB)")

    def _cache_hit(self, f: dict) -> None:
        if f.get("mode") == "move":
            self._sizes.pop(f["entry"], None)
        self._srv(logging.DEBUG, "load", f" - found better prompt with f_keep = {f['f_keep']:.3f}, "
                  f"sim = {f['f_sim']:.3f}")

    def _cache_load_failed(self, f: dict) -> None:
        log.warning("slot %s: %s", _fn("prompt_load"), "failed to load prompt from cache")

    def _purge_idle_slot(self, f: dict) -> None:
        self._srv(logging.WARNING, "try_clear_id", f"purging slot {f['slot']} with {f['n_tokens']} tokens")

    def _context_shift(self, f: dict) -> None:
        self._slot(logging.WARNING, "update_slots", f["slot"], f["task"],
                   f"slot context shift, n_keep = {f['n_keep']}, n_discard = {f['n_discard']}")

    def _batch_halved(self, f: dict) -> None:
        self._srv(logging.WARNING, "update_slots", "failed to find free space in the KV cache, retrying with "
                  f"smaller batch size, off = {f['off']}, n_batch = {f['n_batch']}, ret = 1")

    def _launch(self, f: dict) -> None:
        self._slot(logging.INFO, "launch_slot_", f["slot"], f["task"],
                   f"processing task, is_child = {int(f['state'] == 'WAIT_OTHER')}")
