"""Batched one-token attention over the KV pool (`f32.DecodeBatch`) and attending each sequence alone are both
the model, whatever the sequences' lengths, order, gaps between their ids, KV dtype and pool state.

The two paths sum in different orders; after the logits they may differ by more than any tolerance that
follows from the arithmetic, so each decode step is checked op by op (`forward_check.checked_forward`): every
token's attention output within float32's bound of softmax attention over exactly its sequence's cells."""

from __future__ import annotations

import numpy as np
import pytest

from engine.model import BatchChunk
from engine.model import f32
from engine.model import llama as llama_mod
from engine.model.kv import KVStore
from tests.engine.forward_check import checked_forward

PROMPTS = {0: [5, 77, 12], 1: [200, 3, 9, 150, 33, 281, 64], 3: [7, 120, 44, 2, 19, 88, 90, 91, 92, 93, 94],
           4: [31], 6: [8, 16, 24, 32, 40]}


def _filled(model, dtype=np.float32, pool_cells=None, n_ctx_seq=200):
    """8 sequences filled with PROMPTS; pool_cells: cap the pool at that many cells per sequence (through
    pool_max_bytes), so longer sequences go private."""
    hp = model.hparams
    cell_bytes = 2 * hp.n_layer * hp.n_head_kv * hp.head_dim * np.dtype(dtype).itemsize
    kw = {} if pool_cells is None else {"pool_max_bytes": 8 * pool_cells * cell_bytes}
    kv = KVStore(8, n_ctx_seq, hp.n_layer, hp.n_head_kv, hp.head_dim, model.rope, dtype=dtype, **kw)
    for seq, ids in PROMPTS.items():
        model.forward_batch(kv, [(seq, ids, 0, False)])
    return kv


def _decode(model, kv, steps, seqs, monkeypatch, batched):
    """`steps` decode steps of one token for each of `seqs`, each step checked; returns how many steps
    attended a batch of sequences together."""
    monkeypatch.setattr(llama_mod, "_DECODE_BATCH_MIN", 2 if batched else 10 ** 9)
    calls = []
    real = f32.DecodeBatch.attend
    monkeypatch.setattr(f32.DecodeBatch, "attend", lambda self, *a: calls.append(1) or real(self, *a))
    for step in range(steps):
        chunks = [BatchChunk(seq, [(seq * 31 + step * 7) % 250 + 3], kv.pos_max(seq) + 1) for seq in seqs]
        out = checked_forward(model, kv, chunks)
        assert [o.shape for o in out] == [(1, model.hparams.n_vocab)] * len(seqs)
    monkeypatch.setattr(f32.DecodeBatch, "attend", real)
    return len(calls) // model.hparams.n_layer


@pytest.mark.parametrize("seqs", [[0, 1, 3, 4, 6], [6, 3, 0], [3, 4], [0, 1]])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_batched_decode_equals_one_sequence_at_a_time(tiny_model, monkeypatch, seqs, dtype):
    model = tiny_model()
    assert _decode(model, _filled(model, dtype), 4, seqs, monkeypatch, batched=True) == 4
    assert _decode(model, _filled(model, dtype), 4, seqs, monkeypatch, batched=False) == 0


def test_batched_decode_sees_only_its_own_cells(tiny_model, monkeypatch):
    """Guards the mask: a sequence's logits do not change when a neighbour in the pool gets longer."""
    model = tiny_model()
    kv = _filled(model)
    model.forward_batch(kv, [(1, [11, 12, 13, 14, 15, 16, 17, 18, 19], len(PROMPTS[1]), False)])
    assert _decode(model, kv, 2, [0, 1], monkeypatch, batched=True) == 2


def test_sequences_too_long_for_the_pool_get_their_own_arrays(tiny_model, monkeypatch):
    model = tiny_model()
    kv = _filled(model, pool_cells=8)
    assert [kv._seqs[s].pooled for s in (0, 1, 3, 4, 6)] == [True, True, False, True, True]
    assert _decode(model, kv, 5, [0, 1, 3, 4, 6], monkeypatch, batched=True) == 5   # 1 and 6 leave the pool too
    assert not kv._seqs[1].pooled and kv._seqs[0].pooled


def test_the_pool_is_allocated_once_at_full_capacity_and_a_long_prefill_moves_nothing(tiny_model, monkeypatch):
    """The pool has its full capacity (n_ctx_seq) from its first use, as llama.cpp's KV cache: a prefill past 64
    cells while other sequences decode reallocates nothing (a regrowth copied every sequence inside the step)."""
    model = tiny_model()
    kv, ref = _filled(model), _filled(model)
    assert kv.pool_cap == 200
    pool_k = kv.pool_k
    long_ids = [(i * 13) % 250 + 3 for i in range(70)]
    monkeypatch.setattr(llama_mod, "_DECODE_BATCH_MIN", 2)
    chunks = [BatchChunk(0, [9], 3), BatchChunk(3, long_ids, len(PROMPTS[3]), False), BatchChunk(4, [10], 1)]
    before = {seq: (kv._seqs[seq].k[:, :, :len(ids)].copy(), kv._seqs[seq].v[:, :, :len(ids)].copy())
              for seq, ids in PROMPTS.items()}
    checked_forward(model, kv, chunks)
    assert kv.pool_cap == 200 and kv.pool_k is pool_k
    for seq, (k, v) in before.items():                   # and so do the sequences not in the batch
        np.testing.assert_array_equal(kv._seqs[seq].k[:, :, :len(PROMPTS[seq])], k)
        np.testing.assert_array_equal(kv._seqs[seq].v[:, :, :len(PROMPTS[seq])], v)
    monkeypatch.setattr(llama_mod, "_DECODE_BATCH_MIN", 10 ** 9)
    model.forward_batch(ref, chunks)
    for seq in PROMPTS:
        np.testing.assert_array_equal(kv.positions(seq), ref.positions(seq))


def test_kv_operations_on_pooled_sequences_then_batched_decode(tiny_model, monkeypatch):
    model = tiny_model()
    kvs = [_filled(model), _filled(model)]
    for kv in kvs:
        kv.seq_cp(1, 2)                                  # 2 becomes a copy of 1
        kv.seq_rm(3, 6, -1)                              # 3 keeps positions 0..5
        kv.seq_add(6, 2, -1, -2)                         # context shift of 6
        kv.seq_rm(6, 0, 0)
        kv.state_load(5, kv.state_save(0))               # 5 restored from 0's state
    for kv, batched in zip(kvs, (True, False)):
        assert _decode(model, kv, 3, [0, 1, 2, 3, 5], monkeypatch, batched) == (3 if batched else 0)


def test_clear_releases_the_pool(tiny_model):
    model = tiny_model()
    kv = _filled(model)
    assert kv.pool_k is not None
    kv.clear()
    assert kv.pool_k is None and kv.n_cells_used == 0
    model.forward_batch(kv, [(2, [1, 2, 3], 0, False)])
    assert kv.pool_cap == 200 and kv.n_tokens(2) == 3


def test_unified_pool_holds_up_to_twice_the_per_sequence_share(tiny_model, monkeypatch):
    """A unified sequence may use all n_ctx cells; past 2 * n_ctx_seq it leaves the pool (which would
    otherwise grow to n_seq * n_ctx cells), and it still decodes like the others."""
    model = tiny_model()
    hp = model.hparams
    kv = KVStore(4, 64, hp.n_layer, hp.n_head_kv, hp.head_dim, model.rope, unified=True)
    ref = KVStore(4, 64, hp.n_layer, hp.n_head_kv, hp.head_dim, model.rope, unified=True)
    long_ids = [(i * 7) % 250 + 3 for i in range(140)]
    for store in (kv, ref):
        model.forward_batch(store, [(0, long_ids, 0, False), (1, [5, 6, 7], 0, False)])
    assert not kv._seqs[0].pooled and kv._seqs[1].pooled and kv.pool_cap == 128
    assert _decode(model, kv, 3, [0, 1], monkeypatch, batched=True) == 0      # 0 is private: 1 alone is left
    _decode(model, ref, 3, [0, 1], monkeypatch, batched=False)


def test_a_private_sequence_rejoins_the_pool_when_a_state_that_fits_replaces_it(tiny_model, monkeypatch):
    model = tiny_model()
    kv = _filled(model, pool_cells=8)
    ref = _filled(model)
    assert not kv._seqs[3].pooled
    for store in (kv, ref):
        store.state_load(3, store.state_save(0))                     # 3 cells: fits the pool
    assert kv._seqs[3].pooled and kv.positions(3).tolist() == [0, 1, 2]
    assert _decode(model, kv, 2, [0, 3, 4], monkeypatch, batched=True) == 2
    _decode(model, ref, 2, [0, 3, 4], monkeypatch, batched=False)


def test_where_the_system_refuses_the_whole_pool_it_grows_by_doubling(tiny_model, monkeypatch):
    """A machine that will not map the pool's full capacity at once (no overcommit room): the pool and the
    shadows are allocated by doubling instead, and every sequence decodes as in an unrestricted store."""
    from engine.model import kv as kv_mod
    model = tiny_model()
    ref = _filled(model)
    real = kv_mod.lazy_zeros
    cell_bytes = 2 * model.hparams.n_layer * model.hparams.n_head_kv * model.hparams.head_dim * 4

    def refusing(shape, dtype):
        if int(np.prod(shape)) * np.dtype(dtype).itemsize > 8 * 150 * cell_bytes // 2:   # K or V of 8 x 150 cells
            raise OSError(12, "Cannot allocate memory")
        return real(shape, dtype)
    monkeypatch.setattr(kv_mod, "lazy_zeros", refusing)
    kv = _filled(model)
    assert kv.pool_cap == 64
    long_ids = [(i * 13) % 250 + 3 for i in range(70)]
    for store in (kv, ref):
        model.forward_batch(store, [BatchChunk(3, long_ids, len(PROMPTS[3]), False)])
    assert kv.pool_cap == 128 and ref.pool_cap == 200
    for step in range(2):
        chunks = [BatchChunk(seq, [(seq * 31 + step * 7) % 250 + 3], ref.pos_max(seq) + 1) for seq in PROMPTS]
        for got, want in zip(model.forward_batch(kv, chunks), model.forward_batch(ref, chunks)):
            np.testing.assert_array_equal(got, want)
