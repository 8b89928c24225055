"""Read a GGUF model into hyperparameters and weights: tensors dequantized to float32 once at load, then
fused and laid out by the numerics (`engine.model.numerics`).

Mirrors `llama_model_loader` + `llama_model::load_hparams` / `load_tensors` of llama.cpp for the
`llama` and `qwen2` architectures.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, LlamaFileType
from gguf import quants as gguf_quants

from engine.model.numerics import Numerics, Piece, resolve
from engine.model.types import FileSummary, HParams, LayerWeights, Weights

SUPPORTED_ARCHS = ("llama", "qwen2")
# GGML rope modes: llama rotates ADJACENT pairs (x[2i], x[2i+1]) — GGUF conversion permuted Q/K rows for
# that; qwen2 rotates NEOX pairs (x[i], x[i + n_rot/2]).
ROPE_TYPE = {"llama": "norm", "qwen2": "neox"}
SUPPORTED_TENSOR_TYPES = frozenset({
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
})
# not quantized: a float32 copy of these is no loss of their blocks (the dequantized-matrices warning skips them)
FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


class GGUFError(ValueError):
    """A GGUF file this engine cannot use; the message names the file and what is wrong."""

    def __init__(self, path: str | os.PathLike[str], what: str):
        super().__init__(f"{os.fspath(path)}: {what}")
        self.path = os.fspath(path)
        self.what = what


class _Truncated(Exception):
    pass


class FastGGUFReader(GGUFReader):
    """`GGUFReader` that parses metadata arrays in bulk, over a plain ndarray view of its memmap.

    The stock reader builds each array element with several `np.memmap` slices (~20 µs each): the SmolLM2
    vocabulary (49k tokens + 49k merges) takes 6 s. Here array elements are sliced from a plain ndarray
    with the same `ReaderField` layout (parts / data indices), so `field.contents()` and code reading
    `field.parts[field.data[i]]` work unchanged. Every read is bounds-checked: a truncated file fails with
    a clear message instead of a reshape error.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)   # the view keeps the memmap (and the file mapping) alive

    def _check(self, end: int) -> None:
        if end > self._plain_data.size:
            raise _Truncated(f"file is truncated: needs at least {end} bytes, has {self._plain_data.size}")

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        self._check(int(offset) + int(count) * np.dtype(dtype).itemsize)
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n = GGUFValueType(int(raw_itype[0])), int(alen[0])
        nptype = self.gguf_scalar_to_np.get(itype)
        if itype != GGUFValueType.STRING and nptype is None:
            return super()._get_field_parts(orig_offs, raw_type)    # nested arrays: rare, stock path
        types = [GGUFValueType.ARRAY] + ([itype] if n else [])
        parts: list[np.ndarray] = [raw_itype, alen]
        offs, buf = orig_offs + 12, self._plain_data
        if itype == GGUFValueType.STRING:
            raw = memoryview(buf)
            for _ in range(n):
                self._check(offs + 8)
                end = offs + 8 + int.from_bytes(raw[offs:offs + 8], "little")
                self._check(end)
                parts.append(buf[offs:offs + 8].view(np.uint64))
                parts.append(buf[offs + 8:end])
                offs = end
            return offs - orig_offs, parts, list(range(3, 3 + 2 * n, 2)), types
        values = self._get(offs, nptype, n)
        parts += [values[i:i + 1] for i in range(n)]
        return 12 + int(values.nbytes), parts, list(range(2, 2 + n)), types


@dataclass(frozen=True, slots=True)
class LoadedGGUF:
    hparams: HParams
    weights: Weights
    summary: FileSummary
    reader: GGUFReader              # kept for the tokenizer (metadata arrays); tensors are no longer needed


def open_reader(path: str | os.PathLike[str]) -> GGUFReader:
    """Parse a GGUF header; any failure becomes a GGUFError naming the file."""
    if not os.path.isfile(path):
        raise GGUFError(path, "no such file")
    try:
        return FastGGUFReader(path)
    except _Truncated as e:
        raise GGUFError(path, str(e)) from None
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError) as e:
        raise GGUFError(path, f"not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader: GGUFReader, path: str, key: str, default: Any = None, *, required: bool = False) -> Any:
    field = reader.get_field(key)
    if field is None:
        if required:
            raise GGUFError(path, f"missing metadata key {key!r}")
        return default
    return field.contents()


def read_hparams(reader: GGUFReader, path: str, tensors: dict[str, Any]) -> HParams:
    """`load_hparams`: metadata keys `{arch}.*`, vocabulary size from token_embd."""
    arch = _field(reader, path, "general.architecture", required=True)
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(path, f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = _field(reader, path, f"{arch}.{key}", default, required=required)
        if isinstance(value, list):
            raise GGUFError(path, f"per-layer metadata array {arch}.{key} is not supported")
        return value

    n_embd = int(get("embedding_length", required=True))
    n_head = int(get("attention.head_count", required=True))
    n_head_kv = int(get("attention.head_count_kv", n_head))
    head_dim = int(get("attention.key_length", n_embd // max(n_head, 1)))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise GGUFError(path, "attention.key_length != attention.value_length is not supported")
    if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv != 0:
        raise GGUFError(path, f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    n_rot = int(get("rope.dimension_count", head_dim))
    if n_rot % 2 or n_rot > head_dim:
        raise GGUFError(path, f"rope.dimension_count {n_rot} must be even and <= head dim {head_dim}")
    scaling = get("rope.scaling.type", "none")
    factor = float(get("rope.scaling.factor", get("rope.scale_linear", 1.0)) or 1.0)
    if scaling not in ("none", "linear"):
        raise GGUFError(path, f"rope scaling {scaling!r} is not supported (only none/linear)")
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFError(path, "missing tensor 'token_embd.weight'")
    return HParams(
        arch=arch,
        n_vocab=int(embd.shape[1]) if len(embd.shape) == 2 else 0,
        n_ctx_train=int(get("context_length", required=True)),
        n_embd=n_embd,
        n_layer=int(get("block_count", required=True)),
        n_ff=int(get("feed_forward_length", required=True)),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_rot=n_rot,
        rope_type=ROPE_TYPE[arch],
        rope_freq_base=float(get("rope.freq_base", 10000.0)),
        rope_freq_scale=1.0 / factor if scaling == "linear" else 1.0,
        f_norm_rms_eps=float(get("attention.layer_norm_rms_epsilon", required=True)),
        tied_embeddings="output.weight" not in tensors,
    )


def _expected_shapes(hp: HParams) -> dict[str, tuple[int, ...]]:
    """Tensor name -> GGUF shape (ne0, ne1: ne0 = input/row length), llama.cpp's create_tensor checks."""
    d, hd, ff = hp.n_embd, hp.head_dim, hp.n_ff
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (d, hp.n_vocab),
        "output_norm.weight": (d,),
    }
    if not hp.tied_embeddings:
        shapes["output.weight"] = (d, hp.n_vocab)
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": (d,),
            b + "attn_q.weight": (d, hp.n_head * hd),
            b + "attn_k.weight": (d, hp.n_head_kv * hd),
            b + "attn_v.weight": (d, hp.n_head_kv * hd),
            b + "attn_output.weight": (hp.n_head * hd, d),
            b + "ffn_norm.weight": (d,),
            b + "ffn_gate.weight": (d, ff),
            b + "ffn_up.weight": (d, ff),
            b + "ffn_down.weight": (ff, d),
        }
        if hp.arch == "qwen2":
            shapes |= {
                b + "attn_q.bias": (hp.n_head * hd,),
                b + "attn_k.bias": (hp.n_head_kv * hd,),
                b + "attn_v.bias": (hp.n_head_kv * hd,),
            }
    return shapes


def _summary(reader: GGUFReader, path: str) -> FileSummary:
    ftype = int(_field(reader, path, "general.file_type", -1))
    try:
        ftype_name = LlamaFileType(ftype).name if ftype >= 0 else "unknown"
    except ValueError:
        ftype_name = f"unknown({ftype})"
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    return FileSummary(
        path=path,
        file_size_bytes=os.path.getsize(path),
        ftype=ftype,
        ftype_name=ftype_name,
        tensor_types=types,
        type_counts=dict(Counter(types.values())),
        n_params=sum(int(t.n_elements) for t in reader.tensors),
        n_tensor_bytes=sum(int(t.n_bytes) for t in reader.tensors),
    )


def _dequantize(t: Any) -> np.ndarray:
    """One tensor to C-contiguous float32 in numpy order [ne1, ne0], copied out of the file mapping."""
    if t.tensor_type == GGMLQuantizationType.F32:
        out = np.array(t.data, dtype=np.float32, copy=True)
    else:
        out = np.ascontiguousarray(gguf_quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    return out.reshape(tuple(int(n) for n in reversed(t.shape)))


def load_gguf(path: str | os.PathLike[str], n_workers: int = 2, numerics: str | Numerics = "f32") -> LoadedGGUF:
    """Read, validate and dequantize a GGUF model (`n_workers` threads dequantize: numpy frees the GIL), and
    prepare the weights as `numerics` computes with them (f32: float32 matrices, Q pre-scaled; ggml:
    Q4_1/Q5_1 matrices also kept as integer quants + block scales + block minimums)."""
    path = os.fspath(path)
    num = resolve(numerics)
    reader = open_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    hp = read_hparams(reader, path, tensors)
    expected = _expected_shapes(hp)
    optional = {"rope_freqs.weight"}
    for i in range(hp.n_layer):
        optional |= {f"blk.{i}.attn_q.bias", f"blk.{i}.attn_k.bias", f"blk.{i}.attn_v.bias"}
    size = os.path.getsize(path)
    for name, shape in expected.items():
        if name not in tensors:
            raise GGUFError(path, f"missing tensor {name!r}")
    for name in sorted(set(expected) | (optional & set(tensors))):
        t = tensors[name]
        got = tuple(int(n) for n in t.shape)
        if name in expected and got != expected[name]:
            raise GGUFError(path, f"tensor {name!r} has shape {list(got)}, expected {list(expected[name])}")
        if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise GGUFError(path, f"tensor {name!r} has unsupported type {t.tensor_type.name}")
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise GGUFError(path, f"file is truncated: tensor {name!r} ends past byte {size}")
    names = sorted(set(expected) | (optional & set(tensors)))

    def read(name: str) -> tuple[np.ndarray | None, Any]:
        """The tensor in float32 (None when the numerics keeps it quantized), and what else the numerics reads
        of it (ggml: Q4_1/Q5_1 block params; q: the quant blocks repacked)."""
        t = tensors[name]
        extra = num.tensor_extra(t)
        return (None if num.keeps_quantized(extra) else _dequantize(t)), extra

    with ThreadPoolExecutor(max_workers=max(1, n_workers)) as pool:
        pairs = dict(zip(names, pool.map(read, names)))
    dequantized = {n: (tensors[n].tensor_type, w.nbytes) for n, (w, _) in pairs.items()   # layer matrices only
                   if w is not None and w.ndim == 2 and n.startswith("blk.") and tensors[n].tensor_type not in FLOAT_TYPES}
    note = num.dequantized_warning(path, dequantized)
    if note:
        warnings.warn(note, RuntimeWarning, stacklevel=2)
    arrays = {n: w for n, (w, _) in pairs.items()}
    extras = {n: e for n, (_, e) in pairs.items() if e is not None}
    types = {n: tensors[n].tensor_type for n in names}
    weights = _build_weights(hp, arrays, types, extras, path, num)
    return LoadedGGUF(hparams=hp, weights=weights, summary=_summary(reader, path), reader=reader)


def _build_weights(hp: HParams, a: dict[str, np.ndarray], types: dict[str, GGMLQuantizationType],
                   extras: dict[str, Any], path: str, num: Numerics) -> Weights:
    """Fuse per-layer matrices (QKV, gate/up) and lay them out as `num` computes with them (`num.linear`);
    `num.q_scale` (f32: the attention scale 1/sqrt(head_dim)) is folded into the Q rows and the Q bias."""
    q_scale = num.q_scale(hp)

    def piece(name: str, scale: np.float32 | None = None) -> Piece:
        p = a.pop(name), types[name], extras.pop(name, None)
        return p if scale is None else num.scale_piece(p, scale)

    layers = []
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        qkv = [piece(b + "attn_q.weight", q_scale), piece(b + "attn_k.weight"), piece(b + "attn_v.weight")]
        layers.append(LayerWeights(
            attn_norm=a.pop(b + "attn_norm.weight"),                      # [n_embd]
            wqkv=num.linear(qkv),                                         # W [(n_head + 2*n_head_kv)*head_dim, n_embd]
            bqkv=_fused_bias(hp, a, b, q_scale),
            wo=num.linear([piece(b + "attn_output.weight")]),            # W [n_embd, n_head * head_dim]
            ffn_norm=a.pop(b + "ffn_norm.weight"),                        # [n_embd]
            w_gate_up=num.linear([piece(b + "ffn_gate.weight"), piece(b + "ffn_up.weight")]),   # W [2 * n_ff, n_embd]
            w_down=num.linear([piece(b + "ffn_down.weight")]),           # W [n_embd, n_ff]
        ))
    name = "token_embd.weight"
    tok_embd, embd_extra = a.pop(name), extras.pop(name, None)           # [n_vocab, n_embd]
    if "output.weight" in a:
        output = num.output(a.pop("output.weight"), types["output.weight"], extras.pop("output.weight", None))
    else:
        output = num.output(tok_embd, types[name], embd_extra)            # tied: [n_vocab, n_embd]
    return Weights(tok_embd=num.embedding(tok_embd, embd_extra), output_norm=a.pop("output_norm.weight"), output=output,
                   layers=tuple(layers), rope_freqs=_rope_freqs(hp, a, path))


def _fused_bias(hp: HParams, a: dict[str, np.ndarray], b: str, q_scale: np.float32 | None) -> np.ndarray | None:
    """Q/K/V biases of layer prefix `b` concatenated (absent parts zero), the Q part times q_scale if given."""
    biases = [a.pop(b + f"attn_{p}.bias", None) for p in "qkv"]
    if all(x is None for x in biases):
        return None
    sizes = (hp.n_head * hp.head_dim, hp.n_embd_k_gqa, hp.n_embd_k_gqa)
    full = [np.zeros(n, np.float32) if x is None else x for x, n in zip(biases, sizes)]
    if q_scale is not None:
        full[0] = full[0] * q_scale
    return np.concatenate(full)                                           # [(n_head + 2*n_head_kv) * head_dim]


def _rope_freqs(hp: HParams, a: dict[str, np.ndarray], path: str) -> np.ndarray | None:
    rope_freqs = a.pop("rope_freqs.weight", None)                         # [n_rot // 2]
    if rope_freqs is not None and rope_freqs.shape != (hp.n_rot // 2,):
        raise GGUFError(path, f"tensor 'rope_freqs.weight' has shape {list(rope_freqs.shape)}, "
                              f"expected [{hp.n_rot // 2}]")
    return rope_freqs
