"""Write small random-weight GGUF models (llama / qwen2) with a byte-level BPE vocabulary and a ChatML template.

Product code: tests, benchmarks and the HTTP tests use these files instead of a downloaded model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf import quants as gguf_quants
from engine.model.tokenizer import _BYTE_TO_UNICODE

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL = 1, 3
BOS_ID, EOS_ID, UNK_ID, PAD_ID = 1, 2, 0, 2     # as SmolLM2: bos <|im_start|>, eos/pad <|im_end|>

# A handful of GPT-2 style merges ("left right"); each result becomes a token, in this order.
TINY_MERGES = (
    "Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "Ġ w", "o u", "a n", "l l",
    "Ġ i", "Ġ c", "Ġ o", "i s", "Ġ h", "e d", "Ġ b", "Ġ f", "i t", "Ġ m", "o r", "Ġ p", "Ġi s",
    "Ġ Ġ", "ĠĠ ĠĠ", "Ġa n", "Ġan d", "Ġo f", "Ġt o", "n g", "i ng", "H e", "l o", "He ll", "Hell o",
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_FTYPE = {
    "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16, "BF16": LlamaFileType.MOSTLY_BF16,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": LlamaFileType.MOSTLY_Q5_0, "Q5_1": LlamaFileType.MOSTLY_Q5_1,
    "Q2_K": LlamaFileType.MOSTLY_Q2_K, "Q3_K": LlamaFileType.MOSTLY_Q3_K_M, "Q4_K": LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K": LlamaFileType.MOSTLY_Q5_K_M, "Q6_K": LlamaFileType.MOSTLY_Q6_K,
}
TENSOR_TYPES = tuple(_FTYPE)

# K-quants have no quantizer in gguf-py: their weights are random *blocks*. Byte offsets of the f16
# super-block scales (d, and dmin where the type has one) and a d that gives weights of magnitude ~0.05.
_K_SCALE_FIELDS = {
    "Q2_K": ((80, 82), 5e-3), "Q3_K": ((108,), 2e-3), "Q4_K": ((0, 2), 2e-4),
    "Q5_K": ((0, 2), 1e-4), "Q6_K": ((208,), 1e-4),
}
_DEFAULTS = {"llama": (10000.0, 1e-5), "qwen2": (1000000.0, 1e-6)}   # rope freq base, rms eps


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode symbol map (the tokenizer's own table, so the two always agree)."""
    return dict(_BYTE_TO_UNICODE)


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges): 3 control tokens, the 256 byte symbols, then one token per merge."""
    tokens = list(CONTROL_TOKENS) + [bytes_to_unicode()[b] for b in range(256)]
    known = set(tokens)
    for merge in TINY_MERGES:
        left, right = merge.split(" ")
        assert left in known and right in known, merge
        if left + right not in known:
            tokens.append(left + right)
            known.add(left + right)
    types = [TOKEN_TYPE_CONTROL] * len(CONTROL_TOKENS) + [TOKEN_TYPE_NORMAL] * (len(tokens) - len(CONTROL_TOKENS))
    return tokens, types, list(TINY_MERGES)


@dataclass(frozen=True, slots=True)
class TinyTensor:
    values: np.ndarray               # float32 [ne1, ne0] (numpy order): what the file represents, up to quant error
    ggml_type: GGMLQuantizationType
    data: np.ndarray                 # what is written: float array, or uint8 blocks [ne1, n_bytes_per_row]


def _encode(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.F32:
        return values
    if qtype == GGMLQuantizationType.F16:
        return values.astype(np.float16)
    return gguf_quants.quantize(values, qtype)


def _random_k_blocks(shape: tuple[int, int], type_name: str, rng: np.random.Generator) -> np.ndarray:
    qtype = GGMLQuantizationType[type_name]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    offsets, d = _K_SCALE_FIELDS[type_name]
    scale = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    for off in offsets:
        blocks[:, :, off:off + 2] = scale
    return blocks.reshape(rows, -1)


def tiny_tensors(
    arch: str = "llama", n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
    n_ff: int = 128, n_vocab: int | None = None, seed: int = 0, tensor_type: str = "F32", tied: bool = True,
) -> dict[str, TinyTensor]:
    """The tensors `write_tiny_gguf` writes, by GGUF name. 1-D tensors stay F32 (as llama-quantize does);
    a matrix whose row length is not a multiple of the type's block size falls back to F16."""
    if tensor_type not in _FTYPE:
        raise ValueError(f"tensor_type {tensor_type!r} not in {TENSOR_TYPES}")
    if arch not in _DEFAULTS:
        raise ValueError(f"arch {arch!r} not in {tuple(_DEFAULTS)}")
    n_vocab = len(tiny_vocab()[0]) if n_vocab is None else n_vocab
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    qtype = GGMLQuantizationType[tensor_type]
    block_size = GGML_QUANT_SIZES[qtype][0]

    def matrix(n_out: int, n_in: int, std: float) -> TinyTensor:
        if n_in % block_size != 0:
            values = rng.normal(0.0, std, size=(n_out, n_in)).astype(np.float32)
            return TinyTensor(values, GGMLQuantizationType.F16, values.astype(np.float16))
        if tensor_type in _K_SCALE_FIELDS:
            data = _random_k_blocks((n_out, n_in), tensor_type, rng)
            return TinyTensor(gguf_quants.dequantize(data, qtype).astype(np.float32), qtype, data)
        values = rng.normal(0.0, std, size=(n_out, n_in)).astype(np.float32)
        return TinyTensor(values, qtype, _encode(values, qtype))

    def vector(n: int, mean: float, std: float) -> TinyTensor:
        values = (mean + rng.normal(0.0, std, size=n)).astype(np.float32)
        return TinyTensor(values, GGMLQuantizationType.F32, values)

    out = {"token_embd.weight": matrix(n_vocab, n_embd, 0.3)}
    for i in range(n_layer):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = vector(n_embd, 1.0, 0.1)
        out[b + "attn_q.weight"] = matrix(n_head * head_dim, n_embd, n_embd ** -0.5)
        out[b + "attn_k.weight"] = matrix(n_head_kv * head_dim, n_embd, n_embd ** -0.5)
        out[b + "attn_v.weight"] = matrix(n_head_kv * head_dim, n_embd, n_embd ** -0.5)
        if arch == "qwen2":
            out[b + "attn_q.bias"] = vector(n_head * head_dim, 0.0, 0.5)
            out[b + "attn_k.bias"] = vector(n_head_kv * head_dim, 0.0, 0.5)
            out[b + "attn_v.bias"] = vector(n_head_kv * head_dim, 0.0, 0.5)
        out[b + "attn_output.weight"] = matrix(n_embd, n_head * head_dim, (n_head * head_dim) ** -0.5)
        out[b + "ffn_norm.weight"] = vector(n_embd, 1.0, 0.1)
        out[b + "ffn_gate.weight"] = matrix(n_ff, n_embd, n_embd ** -0.5)
        out[b + "ffn_up.weight"] = matrix(n_ff, n_embd, n_embd ** -0.5)
        out[b + "ffn_down.weight"] = matrix(n_embd, n_ff, n_ff ** -0.5)
    out["output_norm.weight"] = vector(n_embd, 1.0, 0.1)
    if not tied:
        out["output.weight"] = matrix(n_vocab, n_embd, n_embd ** -0.5)
    return out


def write_tiny_gguf(
    path: str | os.PathLike[str], arch: str = "llama", n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
    n_head_kv: int = 2, n_ff: int = 128, n_ctx_train: int = 512, seed: int = 0, tensor_type: str = "F32",
    tied: bool = True,
) -> str:
    """Write a random-weight model with the tiny vocabulary (n_vocab = len(tokens)); returns the path."""
    path = os.fspath(path)
    tokens, token_types, merges = tiny_vocab()
    tensors = tiny_tensors(arch, n_layer, n_embd, n_head, n_head_kv, n_ff, len(tokens), seed, tensor_type, tied)
    freq_base, eps = _DEFAULTS[arch]
    w = GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}-{tensor_type}-seed{seed}")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(freq_base)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_vocab_size(len(tokens))
    w.add_file_type(int(_FTYPE[tensor_type]))
    if tensor_type not in ("F32", "F16", "BF16"):
        w.add_quantization_version(2)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_pad_token_id(PAD_ID)
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(CHATML_TEMPLATE)
    for name, t in tensors.items():
        if t.data.dtype == np.uint8:
            w.add_tensor(name, t.data, raw_shape=t.data.shape, raw_dtype=t.ggml_type)
        else:
            w.add_tensor(name, t.data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
