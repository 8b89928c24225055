"""Host-RAM prompt cache (`server_prompt_cache` in tools/server/server-task.cpp: alloc / load / update).

The cache keeps token lists and sizes; the KV bytes live in the backend, keyed by entry id (the core emits
`cache_save` / `cache_load` / `cache_drop` operations). Which entry leaves when room is needed is an
eviction policy (upstream: FIFO by insertion). What a hit does is a setting: "move" (upstream: the entry is
moved into the slot and leaves the cache) or "copy" (the entry stays and its recency/frequency refresh).
Under "move" a hit removes the entry, so recency never refreshes and FIFO and LRU evict alike; they only
differ under "copy".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from engine.core.protocols import EvictionPolicy
from engine.core.recorder import Recorder
from engine.core.tokens import common_prefix
from engine.core.types import CacheEntry


class CacheLoadFailed(Exception):
    """The chosen entry cannot be restored into the slot (`llama_state_seq_set_data` fails): it stays."""


class PromptCache:
    """Entries in insertion order; byte limit hard, token limit raised to bytes / bytes-per-token."""

    def __init__(self, limit_bytes: int, limit_tokens: int, policy: EvictionPolicy, hit_mode: str,
                 recorder: Recorder, emit_drop: Callable[[int], None]) -> None:
        self.limit_bytes = limit_bytes      # 0 = no byte limit
        self.limit_tokens = limit_tokens    # 0 = no token limit (upstream: n_ctx, the total context)
        self.policy = policy
        self.hit_mode = hit_mode
        self.recorder = recorder
        self._emit_drop = emit_drop
        # insertion order; an OrderedDict because FIFO eviction takes the front: a plain dict whose front was
        # deleted again and again walks the deleted slots on every next(iter()) (O(entries) per eviction)
        self.entries: OrderedDict[int, CacheEntry] = OrderedDict()
        # entries by first token: any entry with a non-zero common prefix with a prompt starts with the same
        # token, so alloc/load only need to look at one bucket (exact, and O(bucket) instead of O(entries))
        self._by_first: dict[int, dict[int, CacheEntry]] = {}
        self._next_id = 0
        self._size_bytes = 0
        self._n_tokens = 0
        self.n_evictions = 0
        self.n_hits = 0
        self.n_saves = 0
        self.n_load_failures = 0
        self.n_misses = 0          # loads that found no entry to restore
        self.bytes_saved = 0       # Σ size of entries saved into the cache (slot -> host RAM)
        self.bytes_loaded = 0      # Σ size of entries restored from it (host RAM -> slot)

    # --- bookkeeping -------------------------------------------------------------------------------
    def size_bytes(self) -> int:
        return self._size_bytes

    def n_tokens(self) -> int:
        return self._n_tokens

    def __len__(self) -> int:
        return len(self.entries)

    def _remove(self, e: CacheEntry, now_s: float, reason: str) -> None:
        del self.entries[e.id]
        bucket = self._by_first[e.tokens[0]]
        del bucket[e.id]
        if not bucket:
            del self._by_first[e.tokens[0]]
        self._size_bytes -= e.size_bytes
        self._n_tokens -= len(e.tokens)
        self.policy.on_remove(e)
        if reason != "hit":  # a moved entry is freed by the cache_load operation itself
            self._emit_drop(e.id)
            if reason[0] == "e":             # evict_*
                self.n_evictions += 1
            if self.recorder.enabled:
                self.recorder.record(now_s, "cache_drop", entry=e.id, n_tokens=len(e.tokens), reason=reason)

    def _evict_one(self, now_s: float, reason: str) -> None:
        self._remove(self.policy.victim(self.entries), now_s, reason)

    # --- upstream operations -----------------------------------------------------------------------
    def alloc(self, tokens: list[int], size_bytes: int, now_s: float) -> CacheEntry | None:
        """Reserve an entry for `tokens` (non-empty; the caller then saves the KV into it); None when skipped."""
        n = len(tokens)
        bucket = self._by_first.get(tokens[0])
        prefixes = None                      # entries that are a prefix of the new tokens (replaced by it)
        if bucket:
            for e in bucket.values():
                lcp = common_prefix(e.tokens, tokens)
                if lcp == n:
                    if self.recorder.enabled:
                        self.recorder.record(now_s, "cache_skip", n_tokens=n, reason="contained", entry=e.id)
                    return None
                if lcp == len(e.tokens):
                    if prefixes is None:
                        prefixes = []
                    prefixes.append(e)
        if self.limit_bytes > 0 and size_bytes > self.limit_bytes:
            if self.recorder.enabled:
                self.recorder.record(now_s, "cache_skip", n_tokens=n, reason="exceeds_limit", size_bytes=size_bytes)
            return None
        if prefixes:
            for e in prefixes:
                self._remove(e, now_s, "prefix_of_new")
        if self.limit_bytes > 0:
            while self.entries and self._size_bytes + size_bytes > self.limit_bytes:
                self._evict_one(now_s, "evict_make_room")
        e = CacheEntry(self._next_id, tokens[:], size_bytes, now_s, now_s, 0, 0.0, self._next_id)
        self._next_id += 1
        self.entries[e.id] = e
        bucket = self._by_first.get(tokens[0])
        if bucket is None:
            self._by_first[tokens[0]] = {e.id: e}
        else:
            bucket[e.id] = e
        self._size_bytes += size_bytes
        self._n_tokens += n
        self.policy.on_insert(e, now_s)
        self.n_saves += 1
        self.bytes_saved += size_bytes
        return e

    def load(self, slot_tokens: list[int], new_tokens: list[int], now_s: float,
             can_restore: Callable[[CacheEntry], bool] | None = None) -> CacheEntry | None:
        """Pick the entry to restore for `new_tokens`, or None to keep the slot's own context.

        An entry wins only if both f_keep (share of the entry kept) and f_sim (share of the new prompt
        covered) are strictly better than the slot's own; entries keeping < 25% are never used. If
        `can_restore(entry)` is false (no room in a unified KV buffer) the entry stays in the cache and
        CacheLoadFailed is raised, as upstream's failed `llama_state_seq_set_data`.
        """
        lcp_best = common_prefix(slot_tokens, new_tokens)
        f_keep_best = lcp_best / len(slot_tokens) if slot_tokens else -1.0
        n_new = len(new_tokens)
        f_sim_best = lcp_best / n_new if n_new else 0.0
        best = None
        for e in (self._by_first.get(new_tokens[0], {}) if new_tokens else {}).values():
            lcp = common_prefix(e.tokens, new_tokens)
            f_keep = lcp / len(e.tokens) if e.tokens else 0.0
            f_sim = lcp / n_new if n_new else 0.0
            if f_keep < 0.25:
                continue
            if f_keep_best < f_keep and f_sim_best < f_sim:
                f_keep_best, f_sim_best, best = f_keep, f_sim, e
        if best is None:
            self.n_misses += 1
            if self.recorder.enabled:
                self.recorder.record(now_s, "cache_miss", n_tokens=n_new, n_entries=len(self.entries))
            return None
        if can_restore is not None and not can_restore(best):
            self.n_load_failures += 1
            self.recorder.record(now_s, "cache_load_failed", entry=best.id, n_tokens=len(best.tokens))
            raise CacheLoadFailed(best.id)
        self.n_hits += 1
        self.bytes_loaded += best.size_bytes
        if self.recorder.enabled:
            self.recorder.record(now_s, "cache_hit", entry=best.id, n_tokens=len(best.tokens),
                                 f_keep=f_keep_best, f_sim=f_sim_best, mode=self.hit_mode)
        if self.hit_mode == "move":
            self._remove(best, now_s, "hit")
        else:
            best.n_hits += 1
            best.t_used_s = now_s
            self.policy.on_hit(best, now_s)
        return best

    def update(self, now_s: float) -> None:
        """Enforce the byte limit, then the token limit raised to limit_bytes / bytes-per-token."""
        if self.limit_bytes > 0:
            while self.entries and self._size_bytes > self.limit_bytes:
                self._evict_one(now_s, "evict_size_limit")
        size_per_token = max(1.0, self._size_bytes / max(1, self._n_tokens))
        limit_tokens_cur = (max(self.limit_tokens, self.limit_bytes / size_per_token)
                            if self.limit_bytes > 0 else self.limit_tokens)
        if self.limit_tokens > 0:
            while self.entries and self._n_tokens > limit_tokens_cur:
                self._evict_one(now_s, "evict_token_limit")
