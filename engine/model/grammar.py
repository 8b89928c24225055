r"""Grammar-constrained sampling (`grammar`, `json_schema`, `response_format`) with llguidance.

llama-server constrains sampling with a grammar sampler (`llama_sampler_init_grammar`, src/llama-grammar.cpp,
set up in `common_sampler_init`, common/sampling.cpp): a GBNF grammar given as `grammar`, or a JSON schema
given as `json_schema` that it converts to GBNF (`json_schema_to_grammar`). This engine uses llguidance, the
grammar library llama.cpp itself can build with (`LLAMA_LLGUIDANCE`) and vLLM uses, instead of a parser of
its own: llguidance reads GBNF (converted to its Lark dialect) and JSON schemas directly, and computes the
set of allowed tokens for the model's vocabulary in microseconds.

Deliberate differences: a JSON schema is compiled by llguidance rather than through llama.cpp's GBNF
conversion (the accepted strings are the schema's in both; token boundaries may differ), and GBNF features
llguidance's converter does not take are refused as invalid grammars.

Sampling follows `common_sampler_sample` (grammar-based rejection sampling): the token is sampled from the
unconstrained chain first; only if the grammar rejects it are the logits masked by the grammar and the chain
run again, drawing from the same random generator.

Lazy grammars (`grammar_lazy` with `grammar_triggers`, `LazyConstraint`) follow `llama_grammar_accept_impl`
(src/llama-grammar.cpp): until a trigger fires nothing is masked and each sampled token's text (special
tokens as their text) is appended to a buffer; a trigger token fires when it is sampled and is fed to the
grammar; a trigger pattern fires when it is found in the buffer (`llama_grammar_trigger_pattern::find`:
`std::regex_match` of the whole buffer for a pattern written `^...$`, else `std::regex_search`), and the
buffer from the first non-empty capture group (else from the match start) to its end is fed to the grammar.
The patterns are built as `common_sampler_init` (common/sampling.cpp) builds them: a word is escaped, a
`pattern_full` is anchored with `^` and `$`.

Deliberate differences for lazy grammars: patterns are Python `re` patterns over the buffer's bytes (upstream:
ECMAScript `std::regex` over the same bytes); the two agree on the usual syntax, but `$` also matches before
a final newline in Python, `.` matches `\r`, and lookbehind is accepted (std::regex refuses it). Text is
fed to llguidance as tokens: the sampled tokens themselves, and the text of a partial first token or of a
special token re-tokenized as plain text (upstream's grammar reads pieces as text, so it accepts the same
bytes). A trigger text the grammar rejects fails the request (`GrammarError`); upstream's exception in
`post_decode` aborts every running slot. Same answers, lower cost: a word is searched for in the new text
only, and a pattern led by `[\s\S]*` is matched once from the start instead of searched from every start.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

MSG_BAD_GRAMMAR = "failed to parse grammar"


class GrammarError(ValueError):
    """A grammar or schema that cannot be compiled."""


def from_gbnf(text: str) -> str:
    """An llguidance grammar from a GBNF grammar (llama.cpp's grammars/README.md syntax)."""
    try:
        return llguidance.grammar_from("gbnf", text)
    except Exception as e:  # noqa: BLE001 - the converter raises its own and Python errors alike
        raise GrammarError(f"{MSG_BAD_GRAMMAR}: {e}") from None


def from_json_schema(schema: Any) -> str:
    """An llguidance grammar from a JSON schema; an empty object means any object, as upstream."""
    if isinstance(schema, dict) and not schema:
        schema = {"type": "object"}
    try:
        return llguidance.grammar_from("json_schema", json.dumps(schema))
    except Exception as e:  # noqa: BLE001
        raise GrammarError(str(e)) from None


class _Vocab:
    """What llguidance's TokenizerWrapper reads from a tokenizer: every token's bytes, EOS/BOS, specials,
    and an encoder for text without special tokens."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.eos_token_id = tok.eos_id
        self.bos_token_id = tok.bos_id
        self.tokens = [tok.token_to_piece(i, special=True) for i in range(tok.n_vocab)]
        self.special_token_ids = [i for i in range(tok.n_vocab) if tok.is_control(i)]

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tok.tokenize(text, add_special=False, parse_special=False)


_LL_TOKENIZERS: "weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer]" = weakref.WeakKeyDictionary()


def ll_tokenizer(tok: Any) -> llguidance.LLTokenizer:
    """llguidance's view of a tokenizer, built once per tokenizer (~0.1 s for a 49k vocabulary)."""
    got = _LL_TOKENIZERS.get(tok)
    if got is None:
        eog = sorted(getattr(tok, "eog_ids", ()) or [tok.eos_id])
        got = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(tok)), n_vocab=tok.n_vocab,
                                     eos_token=eog)
        _LL_TOKENIZERS[tok] = got
    return got


def validate(grammar: str) -> str:
    """"" when the grammar compiles (independent of any vocabulary), else llguidance's error message."""
    return llguidance.LLMatcher.validate_grammar(grammar)


def check(grammar: str, tok: Any) -> None:
    """Raise GrammarError if the grammar does not compile for this vocabulary."""
    err = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer(tok))
    if err:
        raise GrammarError(f"{MSG_BAD_GRAMMAR}: {err}")


class Constraint:
    """One sequence's grammar state: which tokens may come next, and the tokens consumed so far."""

    __slots__ = ("matcher", "n_vocab", "_bitmask", "_allowed")

    def __init__(self, grammar: str, tok: Any) -> None:
        lt = ll_tokenizer(tok)
        self.matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"{MSG_BAD_GRAMMAR}: {self.matcher.get_error()}")
        self.n_vocab = tok.n_vocab
        self._bitmask = allocate_token_bitmask(1, lt.vocab_size)
        self._allowed: np.ndarray | None = None

    def allowed(self) -> np.ndarray:
        """Boolean [n_vocab]: the tokens the grammar accepts next (computed once per position)."""
        if self._allowed is None:
            fill_next_token_bitmask(self.matcher, self._bitmask, 0)
            bits = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")
            self._allowed = bits[:self.n_vocab].astype(bool)
        return self._allowed

    def allows(self, token: int) -> bool:
        return bool(self.allowed()[token])

    def mask(self, logits: np.ndarray) -> None:
        """Set the logits of every token the grammar rejects to -inf, in place."""
        logits[~self.allowed()] = -np.inf

    def accept(self, token: int) -> None:
        self.matcher.consume_token(int(token))
        self._allowed = None


# common_grammar_trigger_type (common/common.h): the integers the request's "type" takes
TRIGGER_TOKEN, TRIGGER_WORD, TRIGGER_PATTERN, TRIGGER_PATTERN_FULL = 0, 1, 2, 3
TRIGGER_TYPE_NAMES = {TRIGGER_TOKEN: "token", TRIGGER_WORD: "word", TRIGGER_PATTERN: "pattern",
                      TRIGGER_PATTERN_FULL: "pattern_full"}
LLAMA_TOKEN_NULL = -1


@dataclass(frozen=True, slots=True)
class GrammarTrigger:
    """`common_grammar_trigger`: a token (`token` is its id, `value` its text), a word, or a pattern."""

    type: int
    value: str
    token: int = LLAMA_TOKEN_NULL

    def to_json(self) -> dict[str, Any]:
        """`server_grammar_trigger::to_json` (tools/server/server-common.h)."""
        out: dict[str, Any] = {"type": self.type, "value": self.value}
        if self.type == TRIGGER_TOKEN:
            out["token"] = self.token
        return out


@dataclass(frozen=True, slots=True)
class TriggerPattern:
    """One compiled trigger pattern (`llama_grammar_trigger_pattern`); `literal` is a word's bytes."""

    source: str
    regex: re.Pattern[bytes]
    literal: bytes | None = None
    from_start: bool = False        # the pattern begins with [\s\S]* (see _absorbs_any_prefix)

    def find(self, text: bytes | bytearray, new_from: int = 0) -> int:
        """Where the constrained text starts in `text` (first non-empty group, else the match), or -1.

        `new_from`: `text[:new_from]` was searched before without a match. That only matters for a word: a
        literal match found now must end past `new_from`, so the search starts just before it. A regex can
        depend on what follows, so it is tried on the whole text, as upstream does (from the start only when
        `from_start`); the answers are upstream's either way."""
        if self.literal is not None:
            return text.find(self.literal, max(0, new_from - len(self.literal) + 1))
        m = None
        if self.source.startswith("^") and self.source.endswith("$"):
            m = self.regex.fullmatch(text)
        if m is None:
            m = self.regex.match(text) if self.from_start else self.regex.search(text)
        if m is None:
            return -1
        for i in range(1, (m.re.groups or 0) + 1):
            if m.end(i) - m.start(i) > 0:
                return m.start(i)
        return m.start()


def trigger_pattern_source(t: GrammarTrigger) -> str | None:
    """The regex `common_sampler_init` builds for a word or pattern trigger (None for a token trigger)."""
    if t.type == TRIGGER_WORD:
        return re.escape(t.value)
    if t.type == TRIGGER_PATTERN:
        return t.value
    if t.type == TRIGGER_PATTERN_FULL:
        if not t.value:
            return "^$"
        return ("" if t.value.startswith("^") else "^") + t.value + ("" if t.value.endswith("$") else "$")
    return None


_ANY_RUNS = (r"[\s\S]*", r"[\S\s]*")


def _absorbs_any_prefix(source: str) -> bool:
    r"""Whether the pattern is `[\s\S]*` or `[\s\S]*?` followed by the rest, with no alternation around
    both: then a match starting anywhere is also one starting at 0 (the run takes the text before it), so
    `search` finds what `match` finds, and `match` costs one pass where `search` retries at every start
    (quadratic in the text for patterns like `[\s\S]*?(<tool_call>)[\s\S]*`)."""
    if not source.startswith(_ANY_RUNS):
        return False
    try:    # the structure from the re module's own parser (private; without it: search, as upstream)
        from re import _constants as sre_c, _parser as sre_p
        first = sre_p.parse(source.encode("utf-8")).data[0]
    except Exception:  # noqa: BLE001
        return False
    return first[0] in (sre_c.MIN_REPEAT, sre_c.MAX_REPEAT) and tuple(first[1][:2]) == (0, sre_c.MAXREPEAT)


def compile_trigger_patterns(triggers: Iterable[GrammarTrigger]) -> tuple[TriggerPattern, ...]:
    """The word/pattern triggers compiled; a pattern that does not compile raises GrammarError naming it."""
    out = []
    for t in triggers:
        source = trigger_pattern_source(t)
        if source is None:
            continue
        try:
            literal = t.value.encode("utf-8") if t.type == TRIGGER_WORD and t.value else None
            out.append(TriggerPattern(source, re.compile(source.encode("utf-8")), literal,
                                      _absorbs_any_prefix(source)))
        except re.error as e:
            raise GrammarError(f"invalid grammar trigger pattern {source!r}: {e}") from None
    return tuple(out)


class LazyConstraint(Constraint):
    """A grammar that is `active` only once a trigger has fired; until then every token is allowed."""

    __slots__ = ("active", "_tok", "_lt", "_trigger_tokens", "_patterns", "_buffer", "_spans")

    def __init__(self, grammar: str, tok: Any, triggers: Iterable[GrammarTrigger]) -> None:
        super().__init__(grammar, tok)
        triggers = tuple(triggers)
        self.active = False
        self._tok = tok
        self._lt = ll_tokenizer(tok)
        self._trigger_tokens = frozenset(t.token for t in triggers if t.type == TRIGGER_TOKEN)
        self._patterns = compile_trigger_patterns(triggers)
        self._buffer = bytearray()                      # the text generated while awaiting a trigger
        self._spans: list[tuple[int, int, int]] = []    # (token, start, end) of each token's piece in it

    def allowed(self) -> np.ndarray:
        if not self.active:
            return np.ones(self.n_vocab, dtype=bool)
        return super().allowed()

    def allows(self, token: int) -> bool:
        return True if not self.active else super().allows(token)

    def accept(self, token: int) -> None:
        if self.active:
            super().accept(token)
            return
        token = int(token)
        piece = self._tok.token_to_piece(token, special=True)
        if token in self._trigger_tokens:
            self._fire([(token, piece, True)])
            return
        start = len(self._buffer)
        self._buffer += piece
        self._spans.append((token, start, len(self._buffer)))
        if not self._patterns:
            return
        text = self._buffer                               # searched in place (re takes a bytearray)
        for pat in self._patterns:
            at = pat.find(text, start)
            if at >= 0:
                self._fire([(tok, bytes(text[max(s, at):e]), s >= at) for tok, s, e in self._spans if e > at])
                return

    def _fire(self, pieces: list[tuple[int, bytes, bool]]) -> None:
        """Activate and feed the grammar: whole normal tokens as themselves, anything else as plain text."""
        self.active = True
        self._buffer.clear()
        self._spans.clear()
        ids: list[int] = []
        for tok, data, whole in pieces:
            if whole and not self._lt.is_special_token(tok):
                ids.append(tok)
            elif data:
                ids.extend(self._lt.tokenize_bytes(data))
        self._allowed = None
        if ids and not self.matcher.consume_tokens(ids) or self.matcher.is_error():
            text = b"".join(d for _, d, _ in pieces).decode("utf-8", "replace")
            raise GrammarError(f"the text that fired the lazy grammar's trigger does not match the grammar: "
                               f"{text!r}: {self.matcher.get_error()}")
