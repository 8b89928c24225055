"""numerics "q": weights kept in their quant blocks, numba kernels (engine.model.quant / qkernels).

Tolerances follow from the arithmetic: the blocks decode to exactly what gguf's dequantizer gives (d*q is exact
in float32, one rounding for + m), and a kernel's float32 product differs from the float64 one by at most
gamma_K * sum_i (|d q_i| + |m|) |x_i| (K = the number of float32 operations in a chain, any summation order),
whatever kernel, BLAS or vector width the machine has."""

from __future__ import annotations

import numpy as np
import pytest

from engine.model import load
from engine.model import quant
from engine.model.numerics import resolve
from tests.engine.forward_check import checked_forward

pytestmark = pytest.mark.skipif(not quant.available(), reason="numba cannot be loaded")

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
U = np.finfo(np.float32).eps / 2


def _bound(part: quant.QPart, x: np.ndarray) -> np.ndarray:
    """gamma_K * sum_i (|d q_i| + |m|) |x_i| per output, K = n_in + 8 (float64)."""
    nb = part.q.shape[0]
    q = (np.concatenate([part.q & 15, part.q >> 4], axis=1) if part.nib else part.q).astype(np.float64)
    dq = np.abs(q * part.d[:, None, :].astype(np.float64)).reshape(nb * 32, -1)     # [n_in, n_out]
    mm = np.repeat(np.abs(part.m.astype(np.float64)) if part.has_m else 0 * part.d, 32, axis=0)
    k = part.n_in + 8
    return k * U / (1 - k * U) * (np.abs(x.astype(np.float64)) @ (dq + mm))


@pytest.mark.parametrize("tensor_type", TYPES)
def test_blocks_decode_exactly_as_gguf(tiny_model, tiny_gguf, tensor_type):
    """Every matrix kept quantized equals the f32 mode's dequantized one bit for bit (Q rows scaled by 1/8 in
    both: a power of two)."""
    path = tiny_gguf(tensor_type=tensor_type)
    f, q = load(path, n_threads=1), load(path, n_threads=1, numerics="q")
    assert q.numerics == "q"
    for lf, lq in zip(f.weights.layers[0].linears, q.weights.layers[0].linears):
        assert all(isinstance(p, quant.QPart) for p in lq.parts)
        np.testing.assert_array_equal(lq.weight, lf.weight)
    ids = [3, 7, 200]
    np.testing.assert_array_equal(q.weights.tok_embd[ids], f.weights.tok_embd[ids])


@pytest.mark.parametrize("tensor_type", ("Q4_1", "Q8_0", "Q5_0"))
@pytest.mark.parametrize("n_threads", (1, 2))
def test_product_within_float32_bound(tiny_gguf, tensor_type, n_threads):
    """Fused kernels (1..16 rows, odd counts) and the tile + BLAS path (more rows) against the float64 product."""
    q = load(tiny_gguf(tensor_type=tensor_type), n_threads=n_threads, numerics="q")
    rng = np.random.default_rng(3)
    for lin in q.weights.layers[0].linears:
        [part] = lin.parts
        w = part.dense().astype(np.float64)                                         # [n_out, n_in]
        for m in (1, 3, 7, 16, 33):
            x = rng.standard_normal((m, lin.n_in)).astype(np.float32)
            y = q.matmul(lin, x)
            err = np.abs(y - x.astype(np.float64) @ w.T)
            assert (err <= _bound(part, x)).all(), (tensor_type, m, err.max())


def test_q_mode_forward_invariants(tiny_model, tiny_gguf):
    """The q forward (one chunk; a prefill then cached one-token steps: the fused kernels) and the f32
    forward of the same file are each the model, every op within its float32 bound (`forward_check`)."""
    path = tiny_gguf(tensor_type="Q4_1")
    f, q = load(path, n_threads=1), load(path, n_threads=2, numerics="q")
    ids = list(range(3, 30))
    for model in (q, f):
        checked_forward(model, model.new_kv(1, 64), [(0, ids, 0, range(len(ids)))])
    kv = q.new_kv(1, 64)
    checked_forward(q, kv, [(0, ids[:20], 0, range(20))])
    for i, t in enumerate(ids[20:]):
        checked_forward(q, kv, [(0, [t], 20 + i, True)])


def test_falls_back_to_f32_with_one_warning(monkeypatch):
    monkeypatch.setattr(quant, "_kernels", None)
    monkeypatch.setattr(quant, "_kernels_error", "ImportError: no numba")
    monkeypatch.setattr(quant, "_warned", False)
    with pytest.warns(RuntimeWarning, match="numba"):
        assert resolve("q").name == "f32"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve("q").name == "f32"                                            # once per process
