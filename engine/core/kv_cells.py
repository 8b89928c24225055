"""KV cell accounting: how many cells of llama.cpp's KV memory each slot holds, and whether a batch fits.

llama-server never counts cells itself: `llama_decode` finds room for a batch's tokens (`llama_kv_cache::
find_slot`, src/llama-kv-cache.cpp) or returns 1 ("no KV slot"), and `server_context::update_slots`
(tools/server/server-context.cpp) reacts. The serving core must make the same decisions without any KV
memory (the simulator has none), so it counts cells here, from what every slot's tokens say:

- Per-slot KV (`-no-kvu`): each slot owns a buffer of `n_ctx_slot` cells; a call fits if no sequence in it
  grows past that.
- Unified KV (`-kvu`): one pool of `n_ctx` cells. `llama_memory_seq_cp` shares cells rather than copying
  them, so an n_cmpl child that copied its parent's prompt adds no cells until either side drops them
  (`shared`); a call fits if the pool holds every sequence's cells after it.
- A batch larger than `n_batch` tokens is cut into calls ("views") of at most n_batch tokens. A view that
  does not fit first frees one idle slot's cells (unified KV only: `server_context::update_slots` asks
  `try_clear_idle_slots`), otherwise halves n_batch and retries; a one-token view that does not fit is fatal
  (every running task fails with "Context size has been exceeded.").

The class reads the slots' token lists (the core's record of what each sequence holds) and keeps the one
piece of state the token lists cannot show: which leading cells are shared by seq_cp. The choices that
have side effects (which idle slot to clear, what a call emits) stay with the core, through `ViewSink`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from engine.core.slot import Slot
from engine.core.types import Chunk


class ViewSink(Protocol):
    """What the core does while `KVCells.split` cuts a batch into llama_decode calls."""

    def emit(self, view: list[Chunk], n_tokens: int) -> list[int]:
        """One call that fits: emit it; return the slots whose cells it changed besides its own tokens
        (n_cmpl children that copied their parent's prompt after it)."""

    def purge_idle(self) -> int:
        """Free one idle slot's cells (unified KV); its id, or -1 when none holds any."""

    def halved(self, off: int, n_batch: int, used: int, cap: int) -> None:
        """n_batch was halved at token offset `off` (record it)."""


class KVCells:
    """Cell counts of every slot's KV, per slot or in one unified pool; the n_cmpl cells shared by seq_cp."""

    __slots__ = ("slots", "unified", "n_ctx", "capacity", "shared", "pending")

    def __init__(self, slots: Sequence[Slot], unified: bool, n_ctx: int, n_ctx_slot: int) -> None:
        self.slots = slots
        self.unified = unified
        self.n_ctx = n_ctx
        # what one call is checked against: the whole pool, or one slot's own buffer
        self.capacity = n_ctx if unified else n_ctx_slot
        # child slot -> [parent slot, leading cells still shared with it]
        self.shared: dict[int, list[int]] = {}
        # a lazy core's count of generated tokens not yet written into its slots' tokens (None: eager)
        self.pending: Callable[[], int] | None = None

    # --- counts ---------------------------------------------------------------------------------------------
    def n_shared(self) -> int:
        return sum(v[1] for v in self.shared.values()) if self.shared else 0

    def used(self) -> int:
        """Cells in use: every slot's tokens, counting cells shared by seq_cp once."""
        n = sum([len(s.tokens) for s in self.slots]) - self.n_shared()
        return n if self.pending is None else n + self.pending()

    def room_to_restore(self, slot: Slot) -> int:
        """Unified KV: cells a prompt-cache entry restored into `slot` may take (restoring first drops the
        slot's own cells)."""
        return self.n_ctx - (self.used() - len(slot.tokens))

    def decode_steps_left(self, n_generating: int) -> int:
        """Unified KV: plain decode steps of `n_generating` slots (one cell each) before the pool is full;
        per-slot KV has no shared limit (each slot's own context bounds it)."""
        if not self.unified:
            return 1 << 62
        return (self.n_ctx - self.used()) // n_generating

    # --- changes --------------------------------------------------------------------------------------------
    def truncated(self, slot_id: int, keep: int) -> None:
        """A slot's tokens were cut to `keep`: cells beyond it are no longer shared with anyone."""
        if not self.shared:
            return
        for child, v in list(self.shared.items()):
            if child == slot_id or v[0] == slot_id:
                v[1] = min(v[1], keep)
                if v[1] == 0:
                    del self.shared[child]

    def copied(self, child: int, parent: int, n: int) -> None:
        """seq_cp of a parent's `n` cells to a child slot: in a unified pool the cells are shared."""
        if self.unified:
            self.shared[child] = [parent, n]

    # --- one batch ------------------------------------------------------------------------------------------
    def fits_as_is(self, n_bound: int = -1) -> bool:
        """The batch already appended to the slots' tokens fits in one call. `n_bound`: an upper bound of every
        slot's tokens the caller knows (-1: none); per-slot KV fits when it is within one slot's buffer."""
        if 0 <= n_bound <= self.capacity and not self.unified:
            return True
        lens = [len(s.tokens) for s in self.slots]
        return (sum(lens) - self.n_shared() if self.unified else max(lens)) <= self.capacity

    def split(self, chunks: list[Chunk], added: list[int], n_batch_max: int, sink: ViewSink) -> tuple[bool, int]:
        """Cut a batch (its tokens already appended to the slots, `added[slot]` of them) into calls of at
        most n_batch tokens that fit, as `llama_decode`'s callers do; `sink` emits each call. Returns
        (True, used) when every token went into a call, (False, used) when a one-token call does not fit."""
        slots = self.slots
        unified = self.unified
        cap = self.capacity
        n_total = sum(added)
        cells = [len(s.tokens) - added[s.id] for s in slots]
        used = sum(cells) - self.n_shared()
        n_batch = n_batch_max
        queue = deque(chunks)
        off = 0
        while off < n_total:
            n = min(n_batch, n_total - off)
            # take n tokens' worth of chunks (splitting the last one if needed)
            view: list[Chunk] = []
            need = n
            for c in queue:
                if need == 0:
                    break
                k = min(need, len(c.tokens))
                view.append(c if k == len(c.tokens) else Chunk(c.seq, c.task_id, c.tokens[:k], c.pos0, (), c.is_prompt))
                need -= k
            if unified:
                fits = used + n <= cap
            else:
                fits = all(cells[c.seq] + len(c.tokens) <= cap for c in view)
            if fits:
                for c in view:
                    cells[c.seq] += len(c.tokens)
                    head = queue[0]
                    if len(c.tokens) == len(head.tokens):
                        queue.popleft()
                    else:
                        k = len(c.tokens)
                        queue[0] = Chunk(head.seq, head.task_id, head.tokens[k:], head.pos0 + k, head.sample_for,
                                         head.is_prompt)
                used += n
                off += n
                n_batch = n_batch_max
                changed = sink.emit(view, n)
                if changed:
                    for sid in changed:
                        cells[sid] = len(slots[sid].tokens)
                    used = sum(cells) - self.n_shared()
                continue
            if n_batch == 1:
                return False, used
            purged = sink.purge_idle() if unified else -1
            if purged >= 0:
                cells[purged] = 0
                used = sum(cells) - self.n_shared()
            else:
                n_batch //= 2
                sink.halved(off, n_batch, used, cap)
        return True, used
