"""Prompt-cache eviction policies (which `server_prompt_cache` entry leaves when room is needed).

Upstream is FIFO by insertion with hits *moving* entries out of the cache. Under "move" FIFO and LRU pick
the same victims (a hit removes the entry, so recency never refreshes); they differ under "copy" hits.
So do SLRU, CLOCK and LFU, whose orders only move on hits. GDSF, largest-first and the Belady oracle
differ from FIFO under both.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Protocol

from engine.core.types import CacheEntry


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


class Slru:
    """Segmented LRU (SGLang offers it for its radix cache): new entries enter a probationary segment; a hit
    promotes an entry to the protected segment, which keeps at most `protected_frac` of the cached bytes
    (its least recent entries are demoted back to probation's most recent end). Victims come from the
    least recent end of probation, then of protected. Entries hit once or more survive a scan of one-off
    prompts. Under `move` there are no hits in the cache, so every entry stays probationary: FIFO order.
    """

    def __init__(self, protected_frac: float = 0.8) -> None:
        if not 0.0 < protected_frac < 1.0:
            raise ValueError(f"slru: the protected fraction must be in (0, 1), got {protected_frac}")
        self.protected_frac = float(protected_frac)
        self._probation: OrderedDict[int, CacheEntry] = OrderedDict()
        self._protected: OrderedDict[int, CacheEntry] = OrderedDict()
        self._bytes = 0            # all entries this policy tracks
        self._protected_bytes = 0

    def on_insert(self, entry: CacheEntry, now_s: float) -> None:
        self._probation[entry.id] = entry
        self._bytes += entry.size_bytes

    def on_hit(self, entry: CacheEntry, now_s: float) -> None:
        if entry.id in self._protected:
            self._protected.move_to_end(entry.id)
            return
        del self._probation[entry.id]
        self._protected[entry.id] = entry
        self._protected_bytes += entry.size_bytes
        limit = self.protected_frac * self._bytes
        while self._protected_bytes > limit and len(self._protected) > 1:
            _, old = self._protected.popitem(last=False)
            self._protected_bytes -= old.size_bytes
            self._probation[old.id] = old        # demoted: the most recent end of probation

    def on_remove(self, entry: CacheEntry) -> None:
        self._bytes -= entry.size_bytes
        if self._probation.pop(entry.id, None) is None:
            del self._protected[entry.id]
            self._protected_bytes -= entry.size_bytes

    def victim(self, entries: Mapping[int, CacheEntry]) -> CacheEntry:
        segment = self._probation or self._protected
        return next(iter(segment.values()))


class Clock:
    """CLOCK / second chance: entries on a ring in insertion order with a reference bit that a hit sets.
    The hand passes entries whose bit is set (clearing it: their second chance) and evicts the first whose
    bit is clear. An approximation of LRU that needs one bit per entry; the scoring proposed for
    llama-server's prompt cache. Under `move` no bit is ever set: FIFO order.
    """

    def __init__(self) -> None:
        self._ring: OrderedDict[int, CacheEntry] = OrderedDict()   # the front is under the hand
        self._referenced: set[int] = set()

    def on_insert(self, entry: CacheEntry, now_s: float) -> None:
        self._ring[entry.id] = entry             # just behind the hand: the last to be examined

    def on_hit(self, entry: CacheEntry, now_s: float) -> None:
        self._referenced.add(entry.id)

    def on_remove(self, entry: CacheEntry) -> None:
        del self._ring[entry.id]
        self._referenced.discard(entry.id)

    def victim(self, entries: Mapping[int, CacheEntry]) -> CacheEntry:
        ring, ref = self._ring, self._referenced
        while True:                               # ends: each pass clears bits, at most one full turn
            eid, e = next(iter(ring.items()))
            if eid not in ref:
                return e
            ref.discard(eid)
            ring.move_to_end(eid)


class FutureOracle(Protocol):
    """What the Belady oracle asks: when an entry will next be used (`math.inf`: never), on the oracle's
    own clock (the simulator's), so that "now" needs no argument."""

    def next_use(self, entry: CacheEntry, min_share: float) -> float:
        """The order key of the first future request reusing >= min_share of the entry's tokens."""
        ...

    def forget(self, entry: CacheEntry) -> None: ...


class Belady:
    """Offline optimum for uniform entries (Belady's OPT / MIN): evict the entry whose next use lies
    furthest in the future; entries never used again go first (ties: the oldest).

    It needs the future requests: the simulator binds a `FutureOracle` built from the workload
    (`bind_future`, done by `sim.driver.Simulation.run`; see `sim/future.py` for what "next use" means for
    a prefix cache). With entries of different sizes and prefix matches it is the classic reference, not a
    proven bound: an online policy can beat it on a workload (docs/study.md).
    """

    def __init__(self, min_share: float = 0.9) -> None:
        if not 0.0 < min_share <= 1.0:
            raise ValueError(f"belady: the share of an entry a use must reuse is in (0, 1], got {min_share}")
        self.min_share = float(min_share)
        self.oracle: FutureOracle | None = None

    def bind_future(self, oracle: FutureOracle) -> None:
        self.oracle = oracle

    def on_insert(self, entry: CacheEntry, now_s: float) -> None:
        pass

    def on_hit(self, entry: CacheEntry, now_s: float) -> None:
        pass

    def on_remove(self, entry: CacheEntry) -> None:
        if self.oracle is not None:
            self.oracle.forget(entry)

    def victim(self, entries: Mapping[int, CacheEntry]) -> CacheEntry:
        if self.oracle is None:
            raise RuntimeError("eviction policy 'belady' needs the future requests: it runs only in the "
                               "simulator (slotlab simulate/compare/study), which binds them")
        next_use = self.oracle.next_use
        share = self.min_share
        best, best_t = None, -1.0
        for e in entries.values():               # insertion order, so the first of equal times is the oldest
            t = next_use(e, share)
            if t > best_t:
                best, best_t = e, t
                if t == math.inf:
                    break
        return best  # type: ignore[return-value]
