"""Prompt-cache eviction policies (which `server_prompt_cache` entry leaves when room is needed).

Upstream is FIFO by insertion with hits *moving* entries out of the cache. Under "move" FIFO and LRU pick
the same victims (a hit removes the entry, so recency never refreshes); they differ under "copy" hits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from engine.core.prompt_cache import CacheEntry


class _NoHooks:
    """Policies whose ordering lives in CacheEntry fields the cache maintains (seq, t_used_s, n_hits)."""

    def on_insert(self, entry: CacheEntry, now_s: float) -> None:
        pass

    def on_hit(self, entry: CacheEntry, now_s: float) -> None:
        pass

    def on_remove(self, entry: CacheEntry) -> None:
        pass


class Fifo(_NoHooks):
    """Upstream: the oldest inserted entry leaves first."""

    def victim(self, entries: Mapping[int, CacheEntry]) -> CacheEntry:
        return next(iter(entries.values()))      # insertion order: the front is the oldest


class Lru:
    """The least recently used entry (inserted or hit) leaves first. O(1): entries kept in recency order."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, CacheEntry] = OrderedDict()

    def on_insert(self, entry: CacheEntry, now_s: float) -> None:
        self._order[entry.id] = entry

    def on_hit(self, entry: CacheEntry, now_s: float) -> None:
        self._order.move_to_end(entry.id)

    def on_remove(self, entry: CacheEntry) -> None:
        del self._order[entry.id]

    def victim(self, entries: Mapping[int, CacheEntry]) -> CacheEntry:
        return next(iter(self._order.values()))


class Lfu(_NoHooks):
    """The least frequently hit entry leaves first; ties go to the oldest."""

    def victim(self, entries: Mapping[int, CacheEntry]) -> CacheEntry:
        return min(entries.values(), key=lambda e: (e.n_hits, e.seq))


class Gdsf:
    """Greedy-Dual-Size-Frequency: priority H = L + (1 + hits) * cost / size, the lowest H leaves and L (the
    clock) rises to the victim's H, so entries not hit for long age out.

    cost = recompute work for the entry's tokens, n * (1 + n / 4096): prefill cost per token grows with
    context because of attention. size = bytes. Long prompts cost more to recompute per byte, so the
    policy prefers to keep them over many short ones of the same total size.
    """

    def __init__(self) -> None:
        self.clock = 0.0

    def _h(self, e: CacheEntry) -> float:
        n = len(e.tokens)
        return self.clock + (1 + e.n_hits) * n * (1.0 + n / 4096.0) / max(1, e.size_bytes)

    def on_insert(self, entry: CacheEntry, now_s: float) -> None:
        entry.priority = self._h(entry)

    def on_hit(self, entry: CacheEntry, now_s: float) -> None:
        entry.priority = self._h(entry)

    def on_remove(self, entry: CacheEntry) -> None:
        pass

    def victim(self, entries: Mapping[int, CacheEntry]) -> CacheEntry:
        v = min(entries.values(), key=lambda e: (e.priority, e.seq))
        self.clock = v.priority
        return v


class LargestFirst(_NoHooks):
    """Evict the entry with the most bytes first (ties: oldest): frees room with the fewest evictions."""

    def victim(self, entries: Mapping[int, CacheEntry]) -> CacheEntry:
        return max(entries.values(), key=lambda e: (e.size_bytes, -e.seq))
