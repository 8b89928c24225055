"""KVCells on its own: cell counts per slot and in a unified pool, seq_cp sharing, and how a batch is cut
into llama_decode calls (idle-slot purge before n_batch halving, fatal at one token)."""

from __future__ import annotations

from engine.core.kv_cells import KVCells
from engine.core.slot import Slot
from engine.core.types import Chunk


def slots(*lens: int, n_ctx: int = 100) -> list[Slot]:
    out = []
    for i, n in enumerate(lens):
        s = Slot(i, n_ctx)
        s.tokens = list(range(n))
        out.append(s)
    return out


class Sink:
    """Records what split asks of the core; `idle` lists the slots purge_idle may clear, in order."""

    def __init__(self, ss: list[Slot], idle: list[int] = (), copies: dict[int, list[int]] | None = None):
        self.ss = ss
        self.idle = list(idle)
        self.copies = copies or {}
        self.calls: list[tuple[list[tuple[int, int]], int]] = []
        self.halvings: list[tuple[int, int]] = []
        self.purged: list[int] = []

    def emit(self, view, n_tokens):
        self.calls.append(([(c.seq, len(c.tokens)) for c in view], n_tokens))
        return self.copies.pop(len(self.calls), [])

    def purge_idle(self):
        if not self.idle:
            return -1
        sid = self.idle.pop(0)
        self.ss[sid].tokens = []
        self.purged.append(sid)
        return sid

    def halved(self, off, n_batch, used, cap):
        self.halvings.append((off, n_batch))


def add(ss: list[Slot], sid: int, n: int) -> Chunk:
    """Append n batch tokens to slot sid, as the core does before checking capacity."""
    pos0 = len(ss[sid].tokens)
    ss[sid].tokens.extend([7] * n)
    return Chunk(sid, sid, [7] * n, pos0, (sid,))


def test_used_counts_shared_cells_once_and_truncation_unshares():
    ss = slots(10, 10, 0)
    kv = KVCells(ss, unified=True, n_ctx=64, n_ctx_slot=64)
    ss[2].tokens = list(ss[0].tokens)
    kv.copied(2, 0, 10)                      # seq_cp 0 -> 2 shares the 10 cells
    assert kv.used() == 20
    assert kv.room_to_restore(ss[1]) == 64 - 10
    kv.truncated(0, 4)                       # the parent keeps 4: only those stay shared
    assert kv.shared == {2: [0, 4]}
    ss[0].tokens = ss[0].tokens[:4]
    assert kv.used() == 4 + 10 + 10 - 4
    kv.truncated(2, 0)
    assert kv.shared == {}


def test_per_slot_kv_does_not_share_and_has_no_pool_limit():
    ss = slots(10, 0)
    kv = KVCells(ss, unified=False, n_ctx=128, n_ctx_slot=64)
    kv.copied(1, 0, 10)
    assert kv.shared == {}
    assert kv.capacity == 64
    assert kv.decode_steps_left(2) == 1 << 62


def test_decode_steps_left_in_a_unified_pool():
    ss = slots(30, 20)
    kv = KVCells(ss, unified=True, n_ctx=64, n_ctx_slot=64)
    assert kv.decode_steps_left(2) == (64 - 50) // 2


def test_fits_as_is_checks_the_pool_or_the_largest_slot():
    ss = slots(30, 30)
    assert KVCells(ss, unified=True, n_ctx=60, n_ctx_slot=60).fits_as_is()
    ss[0].tokens.append(1)
    assert not KVCells(ss, unified=True, n_ctx=60, n_ctx_slot=60).fits_as_is()
    assert KVCells(ss, unified=False, n_ctx=62, n_ctx_slot=31).fits_as_is()
    ss[0].tokens.append(1)
    assert not KVCells(ss, unified=False, n_ctx=62, n_ctx_slot=31).fits_as_is()


def test_split_cuts_at_n_batch_and_splits_a_chunk():
    ss = slots(0, 0, n_ctx=1000)
    kv = KVCells(ss, unified=True, n_ctx=1000, n_ctx_slot=1000)
    chunks = [add(ss, 0, 5), add(ss, 1, 7)]
    sink = Sink(ss)
    assert kv.split(chunks, [5, 7], 4, sink) == (True, 12)
    assert [n for _, n in sink.calls] == [4, 4, 4]
    assert sink.calls[0][0] == [(0, 4)] and sink.calls[1][0] == [(0, 1), (1, 3)] and sink.calls[2][0] == [(1, 4)]
    assert sink.halvings == [] and sink.purged == []


def test_split_purges_an_idle_slot_before_halving_in_a_unified_pool():
    ss = slots(0, 50, n_ctx=100)             # slot 1 idle with 50 cells
    kv = KVCells(ss, unified=True, n_ctx=60, n_ctx_slot=60)
    chunks = [add(ss, 0, 20)]
    sink = Sink(ss, idle=[1])
    ok, used = kv.split(chunks, [20, 0], 32, sink)
    assert ok and used == 20
    assert sink.purged == [1] and sink.halvings == [] and sink.calls == [([(0, 20)], 20)]


def test_split_halves_n_batch_until_a_view_fits_then_restores_it():
    ss = slots(0, 50, n_ctx=100)
    kv = KVCells(ss, unified=True, n_ctx=60, n_ctx_slot=60)
    chunks = [add(ss, 0, 12)]
    sink = Sink(ss)                          # nothing to purge
    ok, used = kv.split(chunks, [12, 0], 16, sink)
    assert not ok                            # 50 + 10 fill the pool: the 11th token never fits
    # n_batch returns to 16 after each call that fits, and halves again from there
    assert sink.halvings == [(0, 8), (8, 8), (8, 4), (8, 2), (10, 8), (10, 4), (10, 2), (10, 1)]
    assert [n for _, n in sink.calls] == [8, 2]
    assert used == 60


def test_split_per_slot_checks_each_sequence_against_its_own_buffer():
    ss = slots(28, 0, n_ctx=32)
    kv = KVCells(ss, unified=False, n_ctx=64, n_ctx_slot=32)
    chunks = [add(ss, 0, 6), add(ss, 1, 6)]
    sink = Sink(ss, idle=[1])
    ok, _ = kv.split(chunks, [6, 6], 16, sink)
    assert not ok
    assert sink.purged == []                 # per-slot KV never purges idle slots
    assert sink.calls[0][0] == [(0, 4)]      # halved to 8, 4: slot 0 takes its last 4 cells
    assert (0, 8) in sink.halvings


def test_split_recounts_cells_that_a_call_copied_to_children():
    ss = slots(0, 0, 0, n_ctx=100)
    kv = KVCells(ss, unified=True, n_ctx=30, n_ctx_slot=30)
    chunks = [add(ss, 0, 10), add(ss, 1, 10)]

    def copy_after_first_call():
        ss[2].tokens = list(ss[0].tokens)    # child 2 copies parent 0 (shared cells in the pool)
        kv.copied(2, 0, 10)
        return [2]

    sink = Sink(ss)
    sink.emit = lambda view, n, _e=sink.emit: (_e(view, n), copy_after_first_call() if len(sink.calls) == 1 else [])[1]
    ok, used = kv.split(chunks, [10, 10, 0], 10, sink)
    assert ok and used == 20                 # the child's 10 cells are shared: no extra room taken
