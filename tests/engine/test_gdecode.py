"""The compiled layers of numerics "ggml" (`engine.model.gdecode`) against the layer loop of `llama.forward_batch`:
the same logits and KV cells bit for bit, for prompt chunks, one-token steps and batches mixing them, whatever the
thread count, the weight types, the RoPE mode, and whether the pool is free; and the cases where they must not
apply."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine.model import BatchChunk, load
from engine.model import ggml as G

K = G.kernels()
pytestmark = pytest.mark.skipif(K is None, reason="numba cannot be loaded")

if K is not None:
    from engine.model import gdecode, spin

PROMPT = [5, 17, 3, 40, 22, 9, 31, 8, 14, 27, 6, 19]


def _f16_cases() -> np.ndarray:
    """Every fp16 value as float32, its float32 neighbours, the ties halfway to the next fp16 value and either
    side of them, and random float32 bit patterns (no NaN)."""
    hb = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    hb = hb[(hb & 0x7F800000) != 0x7F800000]                            # finite fp16 values
    hb = hb[(hb & 0x7FFFFFFF) != 0].astype(np.int64)                    # (not the zeros: below them is a NaN)
    near = np.concatenate([hb + d for d in (-1, 1, 0xFFF, 0x1000, 0x1001)] + [hb]).astype(np.uint32)
    rand = np.random.default_rng(7).integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([near, rand]).view(np.float32)
    return x[~np.isnan(x)]


def test_f16_bits_are_numpys_float16_bits():
    x = _f16_cases()
    out = np.empty(x.size, np.uint16)
    K.f16_bits_array(x, out)
    with np.errstate(over="ignore"):                                    # |x| >= 65520: inf, as wanted
        want = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(out, want)


def test_f16_bits_of_a_nan_is_a_nan_with_its_sign():
    x = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA00000], np.uint32).view(np.float32)
    out = np.empty(x.size, np.uint16)
    K.f16_bits_array(x, out)
    assert np.all(np.isnan(out.view(np.float16)))
    assert [int(v) >> 15 for v in out] == [0, 1, 0, 0]


def _steps(model, steps, seqs=1, unified=False):
    """Prompt in two chunks per sequence (the layer loop), then `steps` greedy one-token steps, the sequences taking
    turns (one chunk per call); every 4th step all sequences together (one token each). Returns the logits and each
    sequence's saved state."""
    kv = model.new_kv(seqs, len(PROMPT) + steps + 2, unified=unified)
    outs, last = [], []
    for s in range(seqs):
        p = [(t + 7 * s) % 40 + 3 for t in PROMPT]
        [a] = model.forward_batch(kv, [BatchChunk(s, p[:7], 0, True)])
        [b] = model.forward_batch(kv, [BatchChunk(s, p[7:], 7, True)])
        outs += [a, b]
        last.append(int(b[-1].argmax()))
    pos = [len(PROMPT)] * seqs
    for i in range(steps):
        turn = range(seqs) if (i % 4 == 3 and seqs > 1) else [i % seqs]
        res = model.forward_batch(kv, [BatchChunk(s, [last[s]], pos[s], True) for s in turn])
        for s, r in zip(turn, res):
            outs.append(r)
            last[s] = int(r[-1].argmax())
            pos[s] += 1
    return np.concatenate(outs), [kv.state_save(s).tobytes() for s in range(seqs)]


def _counting(monkeypatch):
    calls = []
    real = gdecode.decode_layer

    def counted(*a):
        calls.append(1)
        return real(*a)
    monkeypatch.setattr(gdecode, "decode_layer", counted)
    return calls


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("kw", [
    {"tensor_type": "Q4_1"},
    {"tensor_type": "Q5_1", "arch": "qwen2", "tied": False},            # biases, NEOX RoPE, byte kernel
    {"tensor_type": "Q4_1", "n_embd": 128, "n_head": 2, "n_head_kv": 1, "n_ff": 320},   # head_dim 64, as SmolLM2
    {"tensor_type": "Q8_0", "n_layer": 3},
], ids=["q4_1", "q5_1-qwen2", "q4_1-hd64", "q8_0"])
@pytest.mark.parametrize("seqs,unified", [(1, False), (3, False), (3, True)], ids=["1-seq", "3-seq", "3-seq-unified"])
def test_fused_decode_gives_the_layer_loops_bits(tiny_gguf, monkeypatch, kw, n_threads, seqs, unified):
    model = load(tiny_gguf(**kw), n_threads=n_threads, numerics="ggml")
    monkeypatch.setattr(model.num, "compiled_layers", None)
    want_logits, want_kv = _steps(model, 40, seqs, unified)
    monkeypatch.setattr(model.num, "compiled_layers", G.compiled_layers)
    calls = _counting(monkeypatch)
    got_logits, got_kv = _steps(model, 40, seqs, unified)
    assert len(calls) == (40 + 2 * seqs) * model.hparams.n_layer        # every step, the prompt chunks too
    assert np.array_equal(got_logits, want_logits)
    assert got_kv == want_kv


def test_fused_decode_runs_unsplit_while_another_thread_holds_the_pool(tiny_gguf, monkeypatch):
    model = load(tiny_gguf(tensor_type="Q4_1", n_embd=256, n_head=4, n_head_kv=2, n_ff=1024), n_threads=2,
                 numerics="ggml")
    monkeypatch.setattr(model.num, "compiled_layers", None)
    want = _steps(model, 6)
    monkeypatch.setattr(model.num, "compiled_layers", G.compiled_layers)
    pool = model.matmul._spin
    assert pool is not None
    with pool.lock:                                                     # the products cannot use the workers
        got = _steps(model, 6)
    assert np.array_equal(got[0], want[0]) and got[1] == want[1]


def _asleep(pool) -> list[int]:
    deadline = time.monotonic() + 5
    while pool.state() != [spin.SLEEPING] and time.monotonic() < deadline:
        time.sleep(0.01)                                                # idle past the spin budget: asleep
    return pool.state()


@pytest.mark.parametrize("wake", [True, False], ids=["wake", "no-wake"])
def test_fused_decode_wakes_sleeping_workers_and_publishes_quietly(tiny_gguf, monkeypatch, wake):
    model = load(tiny_gguf(tensor_type="Q4_1", n_embd=256, n_head=4, n_head_kv=2, n_ff=1024), n_threads=2,
                 numerics="ggml")
    pool = model.matmul._spin
    if not wake:
        monkeypatch.setattr(pool, "wake", lambda: None)
    kv = model.new_kv(1, 32)
    model.forward_batch(kv, [BatchChunk(0, PROMPT, 0, True)])
    assert _asleep(pool) == [spin.SLEEPING]
    model.forward_batch(kv, [BatchChunk(0, [4], len(PROMPT), True)])
    if not wake:                                                        # the compiled jobs leave sleepers asleep
        assert pool.state() == [spin.SLEEPING]
        return
    deadline = time.monotonic() + 5                                     # woken: its token is taken, it runs
    while pool.state() == [spin.WAKING] and time.monotonic() < deadline:
        time.sleep(0.001)
    assert pool.state() in ([spin.AWAKE], [spin.SLEEPING])
    assert pool._inboxes[0].empty()


@pytest.mark.parametrize("kw", [{"tensor_type": "F16"}, {"tensor_type": "Q4_0"}],
                         ids=["f16-blas-parts", "q4_0-blas-parts"])
def test_fused_decode_does_not_apply_to_matrices_without_an_exact_kernel(tiny_gguf, monkeypatch, kw):
    model = load(tiny_gguf(**kw), n_threads=1, numerics="ggml")
    calls = _counting(monkeypatch)
    kv = model.new_kv(1, 32)
    model.forward_batch(kv, [BatchChunk(0, PROMPT, 0, True)])
    model.forward_batch(kv, [BatchChunk(0, [4], len(PROMPT), True)])
    assert calls == []


def test_fused_decode_does_not_apply_to_an_f32_kv_store(tiny_gguf, monkeypatch):
    model = load(tiny_gguf(tensor_type="Q4_1"), n_threads=1, numerics="ggml")
    calls = _counting(monkeypatch)
    kv = model.new_kv(1, 32, dtype=np.float32)
    model.forward_batch(kv, [BatchChunk(0, PROMPT, 0, True)])
    model.forward_batch(kv, [BatchChunk(0, [4], len(PROMPT), True)])
    assert calls == []


def test_the_workers_are_held_awake_during_a_compiled_step_only(tiny_gguf, monkeypatch):
    model = load(tiny_gguf(tensor_type="Q4_1", n_embd=256, n_head=4, n_head_kv=2, n_ff=1024), n_threads=2,
                 numerics="ggml")
    pool = model.matmul._spin
    held = []
    real = gdecode.decode_layer

    def recording(*a):
        held.append(int(pool.ctl[spin.HOLD]))
        return real(*a)
    monkeypatch.setattr(gdecode, "decode_layer", recording)
    kv = model.new_kv(1, 32)
    model.forward_batch(kv, [BatchChunk(0, PROMPT, 0, True)])
    assert held == [1] * model.hparams.n_layer and pool.ctl[spin.HOLD] == 0


def test_sched_yield_is_callable_from_compiled_code():
    assert spin.yield_core() == 0


def test_a_kernel_error_in_a_worker_is_raised_by_the_fused_caller(tiny_gguf, monkeypatch):
    model = load(tiny_gguf(tensor_type="Q4_1", n_embd=256, n_head=4, n_head_kv=2, n_ff=1024), n_threads=2,
                 numerics="ggml")
    kv = model.new_kv(1, 32)
    model.forward_batch(kv, [BatchChunk(0, PROMPT, 0, True)])
    pool = model.matmul._spin
    real = gdecode.decode_layer

    def failing(*a):
        real(*a)
        pool.ctl[spin.ERROR] = 1                                        # as a worker's failed piece sets it
    monkeypatch.setattr(gdecode, "decode_layer", failing)
    with pytest.raises(RuntimeError, match="a compiled kernel raised"):
        model.forward_batch(kv, [BatchChunk(0, [4], len(PROMPT), True)])
    assert not pool.lock.locked()                                       # released on the error
    assert pool.ctl[spin.HOLD] == 0                                     # and the workers may sleep again


@pytest.mark.parametrize("kw", [{"tensor_type": "Q4_1"}, {"tensor_type": "Q5_1", "arch": "qwen2", "tied": False}],
                         ids=["q4_1", "q5_1-qwen2"])
def test_attention_split_by_heads_on_the_workers_gives_the_same_bits(tiny_gguf, monkeypatch, kw):
    model = load(tiny_gguf(**kw), n_threads=2, numerics="ggml")
    monkeypatch.setattr(model.num, "compiled_layers", None)
    want = _steps(model, 24, 3)
    monkeypatch.setattr(model.num, "compiled_layers", G.compiled_layers)
    monkeypatch.setattr(gdecode, "ATTEND_SPLIT_MIN", 1)                 # every token's attention split by heads
    got = _steps(model, 24, 3)
    assert np.array_equal(got[0], want[0]) and got[1] == want[1]


def _mixed(model):
    """Batches that mix prompt chunks (of 1, 2, 17 and 40 tokens, from an empty sequence and after cached cells,
    across the 16- and 64-key chunks of the attention) with one-token chunks of other sequences, then two batches
    of one-token chunks only; the logits of every row and each sequence's saved state."""
    kv = model.new_kv(3, 128)
    rng = np.random.default_rng(5)

    def ids(n):
        return rng.integers(3, 40, n).tolist()
    outs = []
    batches = [
        [BatchChunk(0, ids(40), 0, list(range(40)))],
        [BatchChunk(0, ids(1), 40, True), BatchChunk(1, ids(17), 0, True), BatchChunk(2, ids(2), 0, [0, 1])],
        [BatchChunk(1, ids(1), 17, True), BatchChunk(2, ids(40), 2, True), BatchChunk(0, ids(1), 41, True)],
        [BatchChunk(0, ids(17), 42, True), BatchChunk(1, ids(1), 18, True), BatchChunk(2, ids(1), 42, True)],
        # one-token chunks only, twice: split by tokens, each token's shadow is updated by the thread attending it
        [BatchChunk(0, ids(1), 59, True), BatchChunk(1, ids(1), 19, True), BatchChunk(2, ids(1), 43, True)],
        [BatchChunk(0, ids(1), 60, True), BatchChunk(1, ids(1), 20, True), BatchChunk(2, ids(1), 44, True)],
    ]
    for b in batches:
        outs += model.forward_batch(kv, b)
    return np.concatenate(outs), [kv.state_save(s).tobytes() for s in range(3)]


@pytest.mark.parametrize("n_threads,split", [(1, False), (2, False), (2, True)], ids=["1", "2", "2-heads-split"])
@pytest.mark.parametrize("kw", [
    {"tensor_type": "Q4_1", "n_embd": 128, "n_head": 2, "n_head_kv": 1, "n_ff": 320},   # head_dim 64, as SmolLM2
    {"tensor_type": "Q5_1", "arch": "qwen2", "tied": False},
], ids=["q4_1-hd64", "q5_1-qwen2"])
def test_compiled_layers_give_the_layer_loops_bits_for_mixed_batches(tiny_gguf, monkeypatch, kw, n_threads, split):
    """A prompt chunk's token i attends its own and the earlier cells in tinyBLAS's order, which is row i of the
    layer loop's causal block: the same logits of every requested row and the same KV cells, batches mixing chunk
    lengths, with the attention of each token split by heads on the workers or not."""
    model = load(tiny_gguf(**kw), n_threads=n_threads, numerics="ggml")
    monkeypatch.setattr(model.num, "compiled_layers", None)
    want = _mixed(model)
    monkeypatch.setattr(model.num, "compiled_layers", G.compiled_layers)
    if split:
        monkeypatch.setattr(gdecode, "ATTEND_SPLIT_MIN", 1)
    calls = _counting(monkeypatch)
    got = _mixed(model)
    assert len(calls) == 6 * model.hparams.n_layer
    assert np.array_equal(got[0], want[0])
    assert got[1] == want[1]


@pytest.mark.parametrize("numerics, by_token", [("ggml", 1), ("f32", 0)])
def test_the_calibration_layout_says_whether_the_compiled_layers_attend(tiny_gguf, monkeypatch, numerics, by_token):
    """`engine_layout` prices attention by token exactly when `compiled_layers` runs the step."""
    from experiments.calibrate import engine_layout
    model = load(tiny_gguf(tensor_type="Q4_1"), n_threads=2, numerics=numerics)
    layout = engine_layout(model)
    assert layout.attend_by_token == by_token
    calls = _counting(monkeypatch)
    kv = model.new_kv(1, 64)
    model.forward_batch(kv, [BatchChunk(0, PROMPT, 0, True)])
    assert bool(calls) == bool(by_token)
    if by_token:
        assert layout.attend_pieces == 2 * G._SPIN_PIECES_PER_THREAD
        assert layout.attend_split_cells * model.hparams.n_head * model.hparams.head_dim >= gdecode.ATTEND_SPLIT_MIN
