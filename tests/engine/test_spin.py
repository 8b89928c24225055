"""The polling worker pool of the ggml kernels (`engine.model.spin`, `spinjobs`): pieces partition the outputs,
results are the one-thread results bit for bit, and the caller never waits for a worker that is asleep, slow to
wake or busy with another caller."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from engine.model import ggml as G
from tests.engine.test_ggml_kernels import _activations, _qlinear

K = G.kernels()
pytestmark = pytest.mark.skipif(K is None, reason="numba cannot be loaded")
spin = pytest.importorskip("engine.model.spin") if K is not None else None


@pytest.mark.parametrize("n,align,pieces", [(1, 64, 4), (63, 64, 4), (64, 64, 4), (1000, 64, 4), (49152, 64, 4),
                                             (300, 16, 7), (5, 1, 5), (5, 1, 9)])
def test_cuts_partition_the_range_in_order(n, align, pieces):
    cuts = np.zeros(2 * spin.MAX_PIECES, np.int64)
    k = spin.set_cuts(cuts, n, align, pieces)
    ranges = cuts[:2 * k].reshape(k, 2)
    assert 1 <= k <= pieces
    assert ranges[0, 0] == 0 and ranges[-1, 1] == n
    assert np.all(ranges[:, 1] > ranges[:, 0])                      # no empty piece
    assert np.all(ranges[1:, 0] == ranges[:-1, 1])                  # contiguous
    assert np.all(ranges[:-1, 1] % align == 0)                      # inner bounds aligned


@pytest.mark.parametrize("types,n_out", [(["Q4_1"], [1000]), (["Q5_1"], [700]), (["Q8_0"], [1500]),
                                         (["Q4_1", "Q8_0", "Q5_1"], [1000, 64, 264])])
@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_polling_workers_give_the_one_thread_bits(types, n_out, m):
    lin = _qlinear(types, n_out, 576)
    x = _activations(m, 576)
    one, two = G.GgmlMatmul(1, compiled=True), G.GgmlMatmul(2, compiled=True)
    try:
        assert two._spin is not None
        want = one(lin, x)
        for _ in range(20):                                         # workers awake, asleep, waking up
            assert np.array_equal(two(lin, x), want)
    finally:
        one.close()
        two.close()


def _split_product(mm: G.GgmlMatmul) -> tuple[G.QLinear, np.ndarray, np.ndarray]:
    lin = _qlinear(["Q4_1"], [2048], 576)
    x = _activations(1, 576)
    return lin, x, G.GgmlMatmul(1, compiled=True)(lin, x)


def test_workers_fall_asleep_and_wake_on_the_next_job():
    mm = G.GgmlMatmul(2, compiled=True)
    try:
        lin, x, want = _split_product(mm)
        assert mm._spin.state() == [spin.SLEEPING]                 # nothing posted yet
        assert np.array_equal(mm(lin, x), want)                     # posts a wake-up token
        deadline = time.monotonic() + 10
        while mm._spin.state() != [spin.SLEEPING] and time.monotonic() < deadline:
            time.sleep(0.01)                                        # woke, found nothing for spin_us, slept
        assert mm._spin.state() == [spin.SLEEPING]
        assert np.array_equal(mm(lin, x), want)
    finally:
        mm.close()


def test_a_held_pool_keeps_its_workers_awake_past_the_spin_budget():
    """HOLD set (a compiled caller's step): an awake worker with nothing to claim keeps polling past its spin
    budget, 200 us here; cleared, it falls asleep."""
    from engine.model import spinjobs
    pool = spin.SpinPool(1, spinjobs.piece_c("ggml"), spin_us=200)
    try:
        with pool.lock:
            pool.ctl[spin.HOLD] = 1
            pool.wake()
            deadline = time.monotonic() + 10
            while pool.state() != [spin.AWAKE] and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.1)                                             # 500 spin budgets
            assert pool.state() == [spin.AWAKE]
            pool.ctl[spin.HOLD] = 0
        deadline = time.monotonic() + 10
        while pool.state() != [spin.SLEEPING] and time.monotonic() < deadline:
            time.sleep(0.001)
        assert pool.state() == [spin.SLEEPING]
    finally:
        pool.close()


def test_the_caller_does_every_piece_when_no_worker_comes():
    """A worker marked awake that never runs (descheduled, say): no token is posted, nothing claims a piece
    but the caller, and the call returns with the right bits instead of waiting."""
    mm = G.GgmlMatmul(2, compiled=True)
    try:
        lin, x, want = _split_product(mm)
        pool = mm._spin
        pool.ctl[spin.STATE] = spin.AWAKE                           # the worker's thread stays blocked in its queue
        for _ in range(5):
            assert np.array_equal(mm(lin, x), want)
        assert pool.ctl[spin.CLAIM] & 0xFFF == (pool.ctl[spin.CLAIM] >> 12) & 0xFFF   # all pieces claimed
        assert pool.ctl[spin.DONE] == (pool.ctl[spin.CLAIM] >> 12) & 0xFFF
    finally:
        mm.close()


def test_two_callers_share_one_pool():
    """A second thread that finds the pool taken runs its product unsplit: both get the one-thread bits."""
    mm = G.GgmlMatmul(2, compiled=True)
    try:
        lin, x, want = _split_product(mm)
        errors: list[str] = []

        def caller() -> None:
            for _ in range(200):
                if not np.array_equal(mm(lin, x), want):
                    errors.append("wrong bits")
        threads = [threading.Thread(target=caller) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads) and not errors
    finally:
        mm.close()


def test_closing_stops_the_workers():
    mm = G.GgmlMatmul(2, compiled=True)
    lin, x, want = _split_product(mm)
    assert np.array_equal(mm(lin, x), want)
    threads = mm._spin.threads
    mm.close()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_1", "Q8_0", "F16", "BF16"])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_q_numerics_on_polling_workers_give_the_one_thread_bits(type_name, m):
    """The "q" numerics' fused products split into output ranges on the pool: each output is one range's sum,
    so two threads give one thread's bits."""
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants

    from engine.model import quant
    qtype = GGMLQuantizationType[type_name]
    rng = np.random.default_rng(7)
    n_out, n_in = 1024, 512
    data = gguf_quants.quantize(rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.1, qtype)
    part = (quant.HalfPart if qtype in quant.HALF_TYPES else quant.QPart).from_tensor(data, qtype, (n_out, n_in))
    lin = quant.quant_linear([(None, qtype, part)])
    x = rng.standard_normal((m, n_in)).astype(np.float32)
    one, two = quant.QuantMatmul(1), quant.QuantMatmul(2)
    try:
        assert two._spin is not None
        want = one(lin, x)
        for _ in range(5):
            assert np.array_equal(two(lin, x), want)
        fused = m <= (quant.HALF_ROWS_MAX if qtype in quant.HALF_TYPES
                      else quant.NIB_ROWS_MAX if part.nib else quant.BYTE_ROWS_MAX)
        assert (two._spin.ctl[spin.CLAIM] >> 24 > 0) == fused      # fused products went through the pool
    finally:
        one.close()
        two.close()
