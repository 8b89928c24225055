"""The matmul thread pool: pieces shared with the caller, errors re-raised, no waiting for a busy worker."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from engine.model.matmul import Matmul, _Workers
from tests import numerics_bounds as nb
from tests.engine.forward_check import checked_forward


def test_every_task_runs_exactly_once():
    workers = _Workers(3)
    hits = [0] * 50
    lock = threading.Lock()

    def task(i):
        with lock:
            hits[i] += 1
    for _ in range(20):
        workers.run([lambda i=i: task(i) for i in range(50)])
    assert hits == [20] * 50
    workers.close()


def test_a_worker_that_is_busy_elsewhere_is_not_waited_for():
    """The caller takes every piece a stalled worker has not started: the run finishes without it."""
    workers = _Workers(1)
    release = threading.Event()
    stuck = threading.Thread(target=workers.run, args=([lambda: release.wait(10), lambda: release.wait(10)],))
    stuck.start()                       # one piece blocks the worker, the other blocks that caller
    try:
        done = []
        finished = threading.Event()

        def caller():
            workers.run([lambda i=i: done.append(i) for i in range(8)])
            finished.set()
        threading.Thread(target=caller).start()
        assert finished.wait(5), "run() waited for a worker that never took a piece"
        assert sorted(done) == list(range(8))
    finally:
        release.set()
        stuck.join()
    workers.close()


def test_an_exception_in_any_piece_reaches_the_caller():
    workers = _Workers(1)

    def boom():
        raise ZeroDivisionError("piece failed")
    for _ in range(5):
        with pytest.raises(ZeroDivisionError, match="piece failed"):
            workers.run([lambda: None, boom, lambda: None, lambda: None])
    ran = []
    workers.run([lambda: ran.append(1), lambda: ran.append(2)])      # still usable afterwards
    assert sorted(ran) == [1, 2]
    workers.close()


@pytest.mark.parametrize("n_threads", [2, 3])
def test_one_row_product_split_over_input_bands_equals_the_plain_product(tiny_model, monkeypatch, n_threads):
    import engine.model.matmul as matmul_mod
    monkeypatch.setattr(matmul_mod, "_SPLIT_MIN_MACS", 0)
    for lin in tiny_model().weights.layers[0].linears:
        x = np.random.default_rng(1).standard_normal((1, lin.t.shape[0])).astype(np.float32)
        mm = Matmul(n_threads)
        x64, t64 = x.astype(np.float64), lin.t.astype(np.float64)
        # partial products of input bands, added: still one dot product of length n_in in some order
        nb.check_within(mm(lin, x), x64 @ t64, nb.dot_bound(np.abs(x64), np.abs(t64)), f"{n_threads} threads")
        mm.close()


def test_ffn_split_over_threads_equals_the_plain_ffn(tiny_gguf, monkeypatch):
    """2..64 tokens with 2 threads run the FFN as one piece per thread (gate/up blocks, SwiGLU, a band of
    the down projection); that forward, the one-thread forward and the unfused two-thread forward are each
    the model (every op checked, `forward_check`)."""
    import engine.model.matmul as matmul_mod
    from engine.model import load
    one, two = load(tiny_gguf(), n_threads=1), load(tiny_gguf(), n_threads=2)
    lw = two.weights.layers[0]
    assert matmul_mod._ffn_splittable(lw.w_gate_up, lw.w_down, two.hparams.n_ff)
    calls = []
    real = matmul_mod._ffn_split
    monkeypatch.setattr(matmul_mod, "_ffn_split", lambda *a: calls.append(1) or real(*a))
    ids = [int(i) for i in np.random.default_rng(3).integers(0, one.hparams.n_vocab, 12)]
    def fresh(model):
        return checked_forward(model, model.new_kv(1, len(ids)), [(0, ids, 0, range(len(ids)))])
    fresh(two)
    assert len(calls) == two.hparams.n_layer
    fresh(one)
    monkeypatch.setattr(matmul_mod, "_FUSED_FFN", False)
    fresh(two)
    assert len(calls) == two.hparams.n_layer


def test_one_token_ffn_split_over_hidden_units_equals_the_plain_ffn(tiny_gguf, monkeypatch):
    """A one-token decode step with 2 threads runs each FFN as one piece per thread over a range of hidden
    units (strided gate/up columns, SwiGLU, an input band of down); that step and 1 thread's are each the
    model (every op checked)."""
    import engine.model.matmul as matmul_mod
    from engine.model import load
    one, two = load(tiny_gguf(), n_threads=1), load(tiny_gguf(), n_threads=2)
    calls = []
    real = matmul_mod._ffn_split_row
    monkeypatch.setattr(matmul_mod, "_ffn_split_row", lambda *a: calls.append(a[2].shape) or real(*a))
    ids = [int(i) for i in np.random.default_rng(4).integers(0, one.hparams.n_vocab, 9)]
    for model in (one, two):
        kv = model.new_kv(1, 16)
        model.forward_batch(kv, [(0, ids[:-1], 0, False)])
        checked_forward(model, kv, [(0, ids[-1:], len(ids) - 1, True)])
    assert calls == [(1, one.hparams.n_embd)] * two.hparams.n_layer


def test_worker_threads_exit_when_the_pool_is_collected_or_closed():
    import gc
    import time

    def ours():
        return {t for t in threading.enumerate() if t.name.startswith("slotlab-matmul")}
    before = ours()
    mms = [Matmul(3) for _ in range(4)]
    mine = ours() - before                  # other tests' pools may exit meanwhile: follow these 8 only
    assert len(mine) == 8
    mms[0].close()
    del mms
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in mine) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.is_alive() for t in mine)
