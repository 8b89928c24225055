"""GGUF loading: hyperparameters, dequantized weights, tied embeddings, and every way a file can be unusable."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf import quants as gguf_quants

from engine.model.gguf_loader import GGUFError, load_gguf, open_reader
from engine.model.tiny import TENSOR_TYPES, tiny_tensors, tiny_vocab

K_QUANT_DIMS = dict(n_embd=256, n_head=4, n_head_kv=2, n_ff=512)   # K-quant rows need multiples of 256
# Relative Frobenius error between loaded and written (pre-quantization) weights: the quantizer's fidelity on
# these random weights, not a float32 summation bound. gguf's quantize/dequantize are element-wise numpy
# arithmetic (no reductions, no BLAS), so the error is the same number on every machine. F16 and BF16 follow
# from their unit roundoffs (2^-11 and 2^-8 per element, so at most that in the norm); the block types are
# the quantizers' resolution (Q8_0 ~ amax/254, Q4 ~ amax/30 per element). Loading itself is exact (below).
TOLERANCE = {"F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q5_0": 0.06, "Q5_1": 0.06,
             "Q4_0": 0.12, "Q4_1": 0.12, "Q2_K": 0.0, "Q3_K": 0.0, "Q4_K": 0.0, "Q5_K": 0.0, "Q6_K": 0.0}


def _dims(tensor_type: str) -> dict:
    return K_QUANT_DIMS if tensor_type.endswith("_K") else {}


def _damaged_copy(src: str, tmp_path: Path) -> str:
    dst = tmp_path / "damaged.gguf"
    shutil.copyfile(src, dst)
    return str(dst)


def _edit(path: str, edit) -> None:
    """Apply `edit(reader)` to a GGUF in place through gguf's writable memmap."""
    reader = GGUFReader(path, "r+")
    edit(reader)
    reader.data.flush()
    del reader


def _tensor(reader: GGUFReader, name: str):
    return next(t for t in reader.tensors if t.name == name)


@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
def test_tiny_file_of_each_supported_type_loads_with_its_hparams(tiny_gguf, tensor_type):
    dims = _dims(tensor_type)
    loaded = load_gguf(tiny_gguf(tensor_type=tensor_type, **dims))
    hp = loaded.hparams
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv) == ("llama", 2, dims.get("n_embd", 64), 4, 2)
    assert hp.n_vocab == len(tiny_vocab()[0])
    assert loaded.summary.tensor_types["blk.0.ffn_up.weight"] == tensor_type
    assert loaded.summary.type_counts == ({"F32": 20} if tensor_type == "F32" else {"F32": 5, tensor_type: 15})
    assert all(a.dtype == np.float32 for a in (loaded.weights.tok_embd, loaded.weights.layers[0].wqkv.t))


@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
def test_dequantized_weights_match_written_values(tiny_gguf, tensor_type):
    dims = _dims(tensor_type)
    w = load_gguf(tiny_gguf(tensor_type=tensor_type, **dims)).weights
    written = tiny_tensors(tensor_type=tensor_type, **dims)
    pairs = [
        (w.layers[1].w_down.weight, written["blk.1.ffn_down.weight"].values),
        (w.layers[0].w_gate_up.weight[dims.get("n_ff", 128):], written["blk.0.ffn_up.weight"].values),
        (w.tok_embd, written["token_embd.weight"].values),
    ]
    for got, want in pairs:
        assert got.shape == want.shape
        assert np.linalg.norm(got - want) <= TOLERANCE[tensor_type] * np.linalg.norm(want) + 1e-7
    # the loader's float32 weights are gguf's dequantization of what was written, bit for bit
    written_up = written["blk.0.ffn_up.weight"]
    dq = (gguf_quants.dequantize(written_up.data, written_up.ggml_type) if written_up.data.dtype == np.uint8
          else written_up.data)
    np.testing.assert_array_equal(w.layers[0].w_gate_up.weight[dims.get("n_ff", 128):], np.asarray(dq, np.float32))


def test_qkv_is_fused_with_q_prescaled_by_inverse_sqrt_head_dim(tiny_gguf):
    w = load_gguf(tiny_gguf()).weights
    t = tiny_tensors()
    head_dim = 64 // 4
    wq, wk, wv = np.split(w.layers[0].wqkv.weight, [64, 64 + 32])
    # the same float32 product, element by element, as the loader's: exact
    np.testing.assert_array_equal(wq, t["blk.0.attn_q.weight"].values * np.float32(1.0 / np.sqrt(head_dim)))
    np.testing.assert_array_equal(wk, t["blk.0.attn_k.weight"].values)
    np.testing.assert_array_equal(wv, t["blk.0.attn_v.weight"].values)


def test_tied_embeddings_reuse_token_embd_as_output_head(tiny_gguf):
    loaded = load_gguf(tiny_gguf(tied=True))
    assert loaded.hparams.tied_embeddings
    np.testing.assert_array_equal(loaded.weights.output.weight, loaded.weights.tok_embd)


def test_untied_model_reads_its_own_output_head(tiny_gguf):
    loaded = load_gguf(tiny_gguf(tied=False))
    assert not loaded.hparams.tied_embeddings
    np.testing.assert_array_equal(loaded.weights.output.weight, tiny_tensors(tied=False)["output.weight"].values)


def test_qwen2_loads_attention_biases_and_neox_rope(tiny_gguf):
    loaded = load_gguf(tiny_gguf(arch="qwen2"))
    t = tiny_tensors(arch="qwen2")
    assert loaded.hparams.rope_type == "neox" and loaded.hparams.rope_freq_base == 1e6
    bk = loaded.weights.layers[1].bqkv[64:96]
    np.testing.assert_array_equal(bk, t["blk.1.attn_k.bias"].values)


def test_llama_uses_adjacent_pair_rope(tiny_gguf):
    assert load_gguf(tiny_gguf()).hparams.rope_type == "norm"


def test_summary_reports_file_size_ftype_and_params(tiny_gguf):
    path = tiny_gguf(tensor_type="Q8_0")
    s = load_gguf(path).summary
    assert s.file_size_bytes == Path(path).stat().st_size
    assert (s.ftype, s.ftype_name) == (7, "MOSTLY_Q8_0")
    assert s.n_params == sum(t.values.size for t in tiny_tensors(tensor_type="Q8_0").values())


def test_fast_reader_fields_equal_stock_reader(tiny_gguf):
    path = tiny_gguf()
    fast, stock = open_reader(path), GGUFReader(path)
    assert list(fast.fields) == list(stock.fields)
    for key in stock.fields:
        assert fast.fields[key].contents() == stock.fields[key].contents(), key
        assert fast.fields[key].data == stock.fields[key].data, key


# --- error paths: files damaged in the test ----------------------------------------------------------

def test_missing_file_is_a_gguf_error(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        load_gguf(tmp_path / "nope.gguf")


def test_bad_magic_is_a_gguf_error(tiny_gguf, tmp_path):
    path = _damaged_copy(tiny_gguf(), tmp_path)
    with open(path, "r+b") as f:
        f.write(b"GGML")
    with pytest.raises(GGUFError, match="damaged.gguf: not a readable GGUF"):
        load_gguf(path)


@pytest.mark.parametrize("keep_fraction", [0.02, 0.5, 0.999])
def test_truncated_file_is_a_gguf_error(tiny_gguf, tmp_path, keep_fraction):
    path = _damaged_copy(tiny_gguf(), tmp_path)
    size = Path(path).stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep_fraction))
    with pytest.raises(GGUFError, match="damaged.gguf: .*truncated"):
        load_gguf(path)


def test_unsupported_architecture_is_a_gguf_error(tiny_gguf, tmp_path):
    path = _damaged_copy(tiny_gguf(), tmp_path)

    def rename_arch(reader):
        reader.fields["general.architecture"].parts[-1][:] = np.frombuffer(b"mamba", np.uint8)

    _edit(path, rename_arch)
    with pytest.raises(GGUFError, match="unsupported architecture 'mamba'"):
        load_gguf(path)


def test_unsupported_tensor_type_is_a_gguf_error(tiny_gguf, tmp_path):
    path = _damaged_copy(tiny_gguf(), tmp_path)

    def retype(reader):    # I32 has F32's size, so the file stays well-formed
        _tensor(reader, "blk.0.ffn_up.weight").field.parts[4][0] = GGMLQuantizationType.I32

    _edit(path, retype)
    with pytest.raises(GGUFError, match="'blk.0.ffn_up.weight' has unsupported type I32"):
        load_gguf(path)


def test_missing_tensor_is_a_gguf_error(tiny_gguf, tmp_path):
    path = _damaged_copy(tiny_gguf(), tmp_path)

    def rename(reader):
        _tensor(reader, "blk.1.ffn_up.weight").field.parts[1][:] = np.frombuffer(b"blk.1.ffn_xx.weight", np.uint8)

    _edit(path, rename)
    with pytest.raises(GGUFError, match="missing tensor 'blk.1.ffn_up.weight'"):
        load_gguf(path)


def test_wrong_tensor_shape_is_a_gguf_error(tiny_gguf, tmp_path):
    path = _damaged_copy(tiny_gguf(), tmp_path)

    def transpose_dims(reader):    # [64, 32] -> [32, 64]: same byte size, wrong for the hparams
        dims = _tensor(reader, "blk.0.attn_k.weight").field.parts[3]
        dims[:] = dims[::-1].copy()

    _edit(path, transpose_dims)
    with pytest.raises(GGUFError, match=r"'blk.0.attn_k.weight' has shape \[32, 64\], expected \[64, 32\]"):
        load_gguf(path)


def test_missing_metadata_key_is_a_gguf_error(tiny_gguf, tmp_path):
    path = _damaged_copy(tiny_gguf(), tmp_path)

    def rename_key(reader):
        reader.fields["llama.block_count"].parts[1][:] = np.frombuffer(b"llama.block_coumt", np.uint8)

    _edit(path, rename_key)
    with pytest.raises(GGUFError, match="missing metadata key 'llama.block_count'"):
        load_gguf(path)


def test_gguf_error_is_a_value_error_naming_the_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf"):
        load_gguf(path)


# --- the real model ------------------------------------------------------------------------------------

@pytest.mark.realmodel
def test_smollm2_hparams_and_types(smollm2):
    hp, s = smollm2.hparams, smollm2.summary
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_vocab) == ("llama", 30, 576, 9, 3, 49152)
    assert (hp.n_ff, hp.head_dim, hp.n_ctx_train, hp.rope_freq_base) == (1536, 64, 8192, 100000.0)
    assert hp.tied_embeddings and smollm2.weights.output.t.shape == (576, 49152)
    assert s.ftype_name == "MOSTLY_Q4_1" and s.type_counts == {"Q8_0": 1, "F32": 61, "Q4_1": 210}


def test_model_tokenizes_with_the_vocabulary_of_its_gguf(tiny_model):
    pytest.importorskip("engine.model.tokenizer")
    model = tiny_model()
    ids = model.tokenize("<|im_start|>Hello the world<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2                   # control tokens parsed as specials
    assert model.detokenize(ids) == "<|im_start|>Hello the world<|im_end|>"


@pytest.mark.parametrize("tensor_type,warned", [("Q4_K", True), ("Q6_K", True), ("F16", False), ("Q4_1", False)])
def test_ggml_mode_warns_when_it_dequantizes_quantized_layer_matrices(tiny_gguf, tensor_type, warned):
    """ggml numerics keep only Q4_1 / Q5_1 / Q8_0 layer matrices in their blocks (llama.cpp's kernels replayed);
    a quantized matrix of another type is dequantized to float32, with one warning that names the file, the types
    and --numerics q. 16-bit and exact types load silently; the "q" mode never warns."""
    pytest.importorskip("numba")
    path = tiny_gguf(tensor_type=tensor_type, **_dims(tensor_type))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        load_gguf(path, numerics="ggml")
        load_gguf(path, numerics="q")
    texts = [str(w.message) for w in got if "dequantized to float32" in str(w.message)]
    if warned:
        assert len(texts) == 1, texts
        assert path in texts[0] and tensor_type in texts[0] and "--numerics q" in texts[0]
    else:
        assert texts == []
