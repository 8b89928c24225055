"""`checked_forward(model, kv, chunks)`: a forward pass whose every op is held to its float32 bound.

Why per op: a bound carried through a whole transformer multiplies by |W| (about sqrt(n) x the typical
gain) at every product and is meaningless after one layer, while two correct float32 runs (batched and
alone, chunked and whole, 1 and 2 threads, OpenBLAS's AVX2 and AVX-512 kernels) may differ by far more than
one rounding at the logits. So instead of comparing two runs' logits with a hand-set tolerance, the test
records what the engine computed at each op of the forward (the inputs and outputs of every rms_norm and
product, the KV cells it wrote, what attention returned) and checks

- each op against the float64 op on the engine's own float32 inputs, within the bound of
  `tests/numerics_bounds.py` (any summation order, kernel, thread split or vector width);
- the glue between ops: layer 0's input is the embedding rows bit for bit, a norm's input is the previous
  residual sum (one rounding), each product reads the norm it follows (the same array), the returned
  logits are the head's rows for the rows asked, in chunk order;
- the routing: a step leaves every earlier cell as it was, each chunk's new K/V cells are RoPE(K) at its positions and V of its own rows, and each
  token's attention output is softmax attention over exactly its sequence's cells up to itself.

The weights are the GGUF file's (dequantized, float64), not the engine's copies, so loading (fusion of
Q/K/V and gate/up, the attention scale folded into Q) is checked too. Numerics "f32" and "q" (whose fused
products are bounded with (|d q| + |m|) |x| and 8 more operations per chain, `numerics_bounds.matmul`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from engine.model import BatchChunk
from engine.model.llama import _logit_rows
from tests import numerics_bounds as nb

_TENSORS: dict[str, dict[str, np.ndarray]] = {}
_CACHE_MAX_BYTES = 64 << 20       # tiny models are kept per file; a real model's float64 copy is not


def _tensors(path: str) -> dict[str, np.ndarray]:
    if path in _TENSORS:
        return _TENSORS[path]
    t = nb.gguf_tensors(path)
    if sum(a.nbytes for a in t.values()) <= _CACHE_MAX_BYTES:
        _TENSORS[path] = t
    return t


class _Recorder:
    """Stands in for a model's Matmul and its numerics' rms_norm during one forward; logs copies of every
    operand (the forward updates x, qkv and attention outputs in place)."""

    def __init__(self, mm, norm):
        self._mm, self._norm = mm, norm
        self.events: list[tuple] = []

    def __getattr__(self, name):                      # n_threads, parallel, split: the real Matmul's
        return getattr(self._mm, name)

    def __call__(self, lin, x):
        y = self._mm(lin, x)
        self.events.append(("mm", lin, x.copy(), y.copy()))
        return y

    def ffn(self, gate_up, down, x, act):
        y = self._mm.ffn(gate_up, down, x, act)
        self.events.append(("ffn", gate_up, down, x.copy(), y.copy()))
        return y

    def rms_norm(self, x, w, eps):
        y = self._norm(x, w, eps)
        self.events.append(("norm", w, x.copy(), y.copy()))
        return y


def _abs_weight(lin, w: np.ndarray | None) -> tuple[np.ndarray | None, int]:
    """|W| to bound a product with, and the extra operations per chain: for "q" numerics' quantized parts
    (|d q| + |m|) and 8 (the kernels' per-block d and m steps), else None (|W|) and 0."""
    parts = getattr(lin, "parts", None)
    if parts is None or not any(hasattr(p, "has_m") for p in parts):
        return None, 0
    rows = []
    for p in parts:
        if hasattr(p, "has_m"):
            nb_ = p.q.shape[0]
            q = (np.concatenate([p.q & 15, p.q >> 4], axis=1) if p.nib else p.q).astype(np.float64)
            dq = np.abs(q * p.d[:, None, :].astype(np.float64)).reshape(nb_ * p.block, -1)     # [n_in, n_out]
            m = np.repeat(np.abs(p.m.astype(np.float64)), p.block, axis=0) if p.has_m else 0.0
            rows.append((dq + m).T)
        elif hasattr(p, "t"):
            rows.append(np.abs(p.t.T.astype(np.float64)))
        else:                                                   # "q" numerics' F16 / BF16 parts
            rows.append(np.abs(p.dense().astype(np.float64)))
    return np.concatenate(rows), 8


class _Weights:
    """The matrices as the engine's fused products see them (float64), per layer: the GGUF file's
    (dequantized; checks loading too), or with `from_engine` the engine's own float32 copies (a real
    model: no second dequantization; the Q/K/V and gate/up fusion and the Q scale are then taken as given)."""

    def __init__(self, model, from_engine: bool = False):
        hp = self.hp = model.hparams
        self.abs: dict[int, np.ndarray] = {}
        s = 1.0 / np.sqrt(hp.head_dim)
        n_q, n_kv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        t = None if from_engine else _tensors(model.path)
        self.nbytes = 0 if t is None else sum(a.nbytes for a in t.values())
        self.layers = []
        for il, lw in enumerate(model.weights.layers):
            b = f"blk.{il}."
            if from_engine:
                wqkv, fold = _dense(lw.wqkv), None
                bqkv = None if lw.bqkv is None else lw.bqkv.astype(np.float64)
                gate_up = _dense(lw.w_gate_up)
                gate, up = gate_up[:hp.n_ff], gate_up[hp.n_ff:]
                norms = lw.attn_norm.astype(np.float64), lw.ffn_norm.astype(np.float64)
                wo, down = _dense(lw.wo), _dense(lw.w_down)
            else:
                wqkv = np.concatenate([t[b + "attn_q.weight"] * s, t[b + "attn_k.weight"], t[b + "attn_v.weight"]])
                # Q rows (and bias) folded at load: fl(w fl(s)) is within 2u |w s| of w s
                fold = np.concatenate([np.full(n_q, 2 * nb.U), np.zeros(2 * n_kv)])
                bias = [t.get(b + f"attn_{n}.bias") for n in "qkv"]
                bqkv = None
                if any(x is not None for x in bias):
                    bqkv = np.concatenate([(x if x is not None else np.zeros(n)) * (s if i == 0 else 1.0)
                                           for i, (x, n) in enumerate(zip(bias, [n_q, n_kv, n_kv]))])
                gate, up = t[b + "ffn_gate.weight"], t[b + "ffn_up.weight"]
                norms = t[b + "attn_norm.weight"], t[b + "ffn_norm.weight"]
                wo, down = t[b + "attn_output.weight"], t[b + "ffn_down.weight"]
            self.layers.append({
                "attn_norm": norms[0], "ffn_norm": norms[1], "wqkv": (lw.wqkv, wqkv, fold), "bqkv": bqkv,
                "wo": (lw.wo, wo, None), "gate": gate, "up": up, "down": down,
                "w_gate_up": lw.w_gate_up, "w_down": lw.w_down})
        if from_engine:
            self.output_norm = model.weights.output_norm.astype(np.float64)
            self.head = (model.weights.output, _dense(model.weights.output), None)
            self.embd = model.weights.tok_embd
        else:
            self.output_norm = t["output_norm.weight"]
            self.head = (model.weights.output, t.get("output.weight", t["token_embd.weight"]), None)
            self.embd = t["token_embd.weight"]

    def abs_of(self, w: np.ndarray) -> np.ndarray:
        """|w|, computed once per matrix."""
        a = self.abs.get(id(w))
        if a is None:
            a = self.abs[id(w)] = np.abs(w)
        return a


def _dense(lin) -> np.ndarray:
    """The engine's float32 matrix W [n_out, n_in] of a `Linear`, as float64."""
    return lin.t.astype(np.float64).T                      # a contiguous copy, then its transposed view


_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()     # model -> _Weights


def _product(W, rec_lin, spec, x: np.ndarray, y: np.ndarray, what: str, bias=None) -> nb.Ball:
    """Check y (the engine's x @ W.T) against float64 on the engine's x; return the exact value (+ bias)."""
    lin, w, fold = spec
    assert rec_lin is lin, f"{what}: the forward multiplied by another matrix"
    aw, extra = _abs_weight(lin, w)
    aw = W.abs_of(w) if aw is None else aw
    if fold is not None:
        aw = aw * (1 + fold[:, None])
    want = nb.matmul(nb.exact(x), w, aw, None, extra)
    nb.check_within(y, want.v, want.r, what)
    if bias is None:
        return nb.exact(y)
    v = y.astype(np.float64) + bias
    return nb.Ball(v, nb.U * np.abs(v) + (0 if fold is None else fold * np.abs(bias)))


def _norm(event, w: np.ndarray, eps: float, what: str) -> tuple[np.ndarray, np.ndarray]:
    kind, _, x, y = event
    assert kind == "norm", f"{what}: expected rms_norm, the forward did {kind}"
    want = nb.rms_norm(nb.exact(x), w, eps)
    nb.check_within(y, want.v, want.r, what)
    return x, y


def _sum_is(x_next: np.ndarray, a: np.ndarray, b: np.ndarray, what: str) -> None:
    """x_next is the float32 sum a + b (the residual): one rounding."""
    s = nb.add(nb.exact(a), nb.exact(b))
    nb.check_within(x_next, s.v, s.r, what)


def reference_weights(model, from_engine: bool = False) -> _Weights:
    """What `checked_forward` compares with; pass it to check several forwards of a large model."""
    return _Weights(model, from_engine)


def checked_forward(model, kv, chunks: Sequence[BatchChunk | tuple], weights: _Weights | None = None
                    ) -> list[np.ndarray]:
    """model.forward_batch(kv, chunks), every op checked (see the module doc); returns its logits.
    `weights`: `reference_weights(model)` (built here, and kept for a tiny model, when not given)."""
    chunks = [BatchChunk(*c) for c in chunks]
    hp = model.hparams
    W = weights or _WEIGHTS.get(model)
    if W is None:
        W = _Weights(model)
        if W.nbytes <= _CACHE_MAX_BYTES:
            _WEIGHTS[model] = W
    n_old = [kv.n_tokens(c.seq_id) for c in chunks]
    before = [(kv._seqs[c.seq_id].k[:, :, :n].copy(), kv._seqs[c.seq_id].v[:, :, :n].copy(), kv.positions(c.seq_id))
              for c, n in zip(chunks, n_old)]
    rec = _Recorder(model.matmul, model.num.rms_norm)
    model.matmul, model.num.rms_norm = rec, rec.rms_norm
    try:
        out = model.forward_batch(kv, chunks)
    finally:
        model.matmul = rec._mm
        del model.num.rms_norm
    ev = list(rec.events)
    for c, n, (k0, v0, p0) in zip(chunks, n_old, before):        # a step moves no earlier cell (pool growth too)
        s = kv._seqs[c.seq_id]
        assert np.array_equal(s.k[:, :, :n], k0) and np.array_equal(s.v[:, :, :n], v0), "earlier cells changed"
        np.testing.assert_array_equal(kv.positions(c.seq_id), np.concatenate([p0, c.pos0 + np.arange(
            len(np.asarray(c.token_ids).reshape(-1)))]))
    eps = hp.f_norm_rms_eps
    n_head, n_kv, hd = hp.n_head, hp.n_head_kv, hp.head_dim
    n_q, n_k = n_head * hd, n_kv * hd
    tokens = np.concatenate([np.asarray(c.token_ids, np.int64).reshape(-1) for c in chunks])
    sizes = [len(np.asarray(c.token_ids).reshape(-1)) for c in chunks]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    pos = np.concatenate([np.arange(c.pos0, c.pos0 + n) for c, n in zip(chunks, sizes)])
    x_prev = None
    for il, L in enumerate(W.layers):
        x, xn = _norm(ev.pop(0), L["attn_norm"], eps, f"layer {il} attn_norm")
        if il == 0:
            np.testing.assert_array_equal(x, W.embd[tokens], "layer 0 input is not the token embeddings")
        else:
            _sum_is(x, *x_prev, f"layer {il} input = residual + FFN")
        kind, lin, xq, y = ev.pop(0)
        assert kind == "mm" and np.array_equal(xq, xn), f"layer {il}: QKV reads its norm"
        qkv = _product(W, lin, L["wqkv"], xq, y, f"layer {il} QKV", L["bqkv"])
        q = nb.rope(nb.Ball(qkv.v[:, :n_q].reshape(-1, n_head, hd), qkv.r[:, :n_q].reshape(-1, n_head, hd)), pos, hp)
        k = nb.rope(nb.Ball(qkv.v[:, n_q:n_q + n_k].reshape(-1, n_kv, hd),
                                 qkv.r[:, n_q:n_q + n_k].reshape(-1, n_kv, hd)), pos, hp)
        v = nb.Ball(qkv.v[:, n_q + n_k:].reshape(-1, n_kv, hd), qkv.r[:, n_q + n_k:].reshape(-1, n_kv, hd))
        if kv.dtype == np.float16:
            k, v = nb.to_f16(k), nb.to_f16(v)
        kind, lin, attn, y_o = ev.pop(0)
        assert kind == "mm", f"layer {il}: expected the output projection"
        for ic, c in enumerate(chunks):
            s = kv._seqs[c.seq_id]
            a, m = starts[ic], sizes[ic]
            cells_k = s.k[il, :, :n_old[ic] + m].astype(np.float64)              # [n_kv, n, hd]
            cells_v = s.v[il, :, :n_old[ic] + m].astype(np.float64)
            new = slice(n_old[ic], n_old[ic] + m)
            what = f"layer {il} seq {c.seq_id}"
            nb.check_within(cells_k[:, new].transpose(1, 0, 2), k.v[a:a + m], k.r[a:a + m], what + " new K cells")
            nb.check_within(cells_v[:, new].transpose(1, 0, 2), v.v[a:a + m], v.r[a:a + m], what + " new V cells")
            for i in range(m):
                n_vis = n_old[ic] + i + 1
                for h in range(n_head):
                    g = h // (n_head // n_kv)
                    want = nb.softmax_attend(q[a + i, h], nb.exact(cells_k[g, :n_vis]), nb.exact(cells_v[g, :n_vis]))
                    nb.check_within(attn[a + i, h * hd:(h + 1) * hd], want.v, want.r,
                                    f"{what} token {i} head {h} attention")
        _product(W, lin, L["wo"], attn, y_o, f"layer {il} output projection")
        x_mid, xn2 = _norm(ev.pop(0), L["ffn_norm"], eps, f"layer {il} ffn_norm")
        _sum_is(x_mid, x, y_o, f"layer {il} residual after attention")
        kind, gate_up, down, xf, y_f = ev.pop(0)
        assert kind == "ffn" and gate_up is L["w_gate_up"] and down is L["w_down"] and np.array_equal(xf, xn2), \
            f"layer {il}: the FFN reads its norm"
        _ffn(W, L, gate_up, down, xf, y_f, f"layer {il} FFN")
        x_prev = (x_mid, y_f)
    rows = [_logit_rows(c.want_logits, n) for c, n in zip(chunks, sizes)]
    sel = [starts[ic] + r for ic, rr in enumerate(rows) for r in rr]
    if not sel:
        assert not ev and all(o.shape == (0, hp.n_vocab) for o in out)
        return out
    xs, xsn = _norm(ev.pop(0), W.output_norm, eps, "output_norm")
    _sum_is(xs, x_prev[0][sel], x_prev[1][sel], "head input = last residual of the rows asked")
    kind, lin, xh, logits = ev.pop(0)
    assert kind == "mm" and np.array_equal(xh, xsn) and not ev
    _product(W, lin, W.head, xh, logits, "output head")
    bounds = np.cumsum([0] + [len(r) for r in rows])
    for ic, o in enumerate(out):
        np.testing.assert_array_equal(o, logits[bounds[ic]:bounds[ic + 1]], f"logits of chunk {ic}")
    return out


def _ffn(W, L, gate_up, down, x: np.ndarray, y: np.ndarray, what: str) -> None:
    """down(silu(x Wg^T) * (x Wu^T)) from the engine's FFN input x: two products, SwiGLU, one product."""
    aw_gu, extra_gu = _abs_weight(gate_up, None)
    aw_d, extra_d = _abs_weight(down, L["down"])
    aw_d = W.abs_of(L["down"]) if aw_d is None else aw_d
    n_ff = L["gate"].shape[0]
    xb = nb.exact(x)
    g = nb.matmul(xb, L["gate"], W.abs_of(L["gate"]) if aw_gu is None else aw_gu[:n_ff], None, extra_gu)
    u = nb.matmul(xb, L["up"], W.abs_of(L["up"]) if aw_gu is None else aw_gu[n_ff:], None, extra_gu)
    with np.errstate(over="ignore"):
        h = nb.silu_mul(g, u)
    want = nb.matmul(h, L["down"], aw_d, None, extra_d)
    nb.check_within(y, want.v, want.r, what)
