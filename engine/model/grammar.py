"""Grammar-constrained sampling (`grammar`, `json_schema`, `response_format`) with llguidance.

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
"""

from __future__ import annotations

import json
import weakref
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
