"""Per-request incremental detokenizer with llama-server's text rules for streaming and stop strings.

Mirrors the text half of `server_context::process_token` (tools/server/server-context.cpp) with
`server_slot::find_stopping_strings`, `validate_utf8` and `string_find_partial_stop`: pieces are
accumulated as bytes, incomplete UTF-8 at the end is never sent, a full stop-string match cuts the word
and everything after it, and unsent text whose tail could still become a stop string is held back.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def complete_utf8_prefix_len(data: bytes) -> int:
    """`validate_utf8`: length of `data` without a truncated multi-byte character at its end."""
    n = len(data)
    for i in range(1, min(4, n) + 1):
        c = data[n - i]
        if (c & 0xE0) == 0xC0 and i < 2 or (c & 0xF0) == 0xE0 and i < 3 or (c & 0xF8) == 0xF0 and i < 4:
            return n - i
    return n


def find_partial_stop(text: bytes, stop: bytes) -> int:
    """`string_find_partial_stop`: start of the longest suffix of `text` that is a prefix of `stop`, or -1."""
    if not text or not stop:
        return -1
    last = text[-1]
    for i in range(len(stop) - 1, -1, -1):
        if stop[i] == last and text.endswith(stop[: i + 1]):
            return len(text) - i - 1
    return -1


@dataclass(slots=True)
class TextStream:
    """Turns sampled token ids into the text llama-server would stream, one `push` per token.

    `tokenizer` needs `token_to_piece(id, special) -> bytes` and `is_eog(id)`. Special (control) tokens
    render as empty text unless `special` is true or the id is in `preserved_tokens`.
    """

    tokenizer: object
    stop: tuple[str, ...] = ()
    special: bool = False
    preserved_tokens: frozenset[int] = frozenset()
    generated: bytearray = field(default_factory=bytearray)  # all text so far, cut at a stop word
    n_sent: int = 0  # bytes of `generated` already returned by push/flush
    stopping_word: str = ""
    stopped: bool = False
    _stop_bytes: list[tuple[str, bytes]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._stop_bytes = [(w, w.encode("utf-8")) for w in self.stop if w]

    def push(self, token_id: int) -> tuple[str, str | None]:
        """Add one generated token; return (text to send now, stop word if this token completed one).

        After a stop word the stream is finished and further pushes return ("", None).
        """
        if self.stopped:
            return "", None
        piece = self.tokenizer.token_to_piece(token_id, self.special or token_id in self.preserved_tokens)
        self.generated += piece
        if complete_utf8_prefix_len(self.generated) < len(self.generated):
            return "", None  # wait for the rest of the character

        pos = min(self.n_sent, len(self.generated))
        unsent = bytes(self.generated[pos:])
        stop_pos, word = self._find_full_stop(unsent, len(piece))
        send = True
        if word is not None:
            del self.generated[pos + stop_pos:]
            self.stopping_word, self.stopped = word, True
        elif not self.tokenizer.is_eog(token_id) and self._has_partial_stop(unsent):
            send = False  # the tail might be the start of a stop word: hold all unsent text back
        if not send:
            return "", None
        text = bytes(self.generated[pos:])
        self.n_sent = pos + len(text)
        return text.decode("utf-8", errors="replace"), word

    def flush(self) -> str:
        """Return whatever is still unsent (held partial-stop text, incomplete UTF-8 as U+FFFD).

        Upstream's non-stream `content` is the whole `generated_text` (so it includes this); its stream
        mode ends with an empty final event, so held-back text is never streamed there.
        """
        text = bytes(self.generated[self.n_sent:])
        self.n_sent = len(self.generated)
        return text.decode("utf-8", errors="replace")

    @property
    def generated_text(self) -> str:
        """Everything generated so far, without the stop word and what followed it."""
        return bytes(self.generated).decode("utf-8", errors="replace")

    def _find_full_stop(self, unsent: bytes, last_piece_len: int) -> tuple[int, str | None]:
        """Earliest full stop-word match; only the region the last token could have completed is searched."""
        best, best_word = -1, None
        for word, stop in self._stop_bytes:
            start = max(0, len(unsent) - (len(stop) + last_piece_len))
            found = unsent.find(stop, start)
            if found >= 0 and (best < 0 or found < best):
                best, best_word = found, word
        return best, best_word

    def _has_partial_stop(self, unsent: bytes) -> bool:
        return any(find_partial_stop(unsent, stop) >= 0 for _, stop in self._stop_bytes)
