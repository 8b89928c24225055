"""Token sampling with llama-server's parameters, defaults, sampler order and probability reporting.

Mirrors `common_sampler_init` (common/sampling.cpp: logit bias, then the configured chain, then `dist`),
the samplers of src/llama-sampling.cpp, the request parsing of tools/server/server-schema.cpp and the
`n_probs` reporting of `server_context::populate_token_probs`. With an MT19937 generator seeded like
`std::mt19937(seed)` (`make_rng`), the random draws are the ones llama.cpp makes for the same seed.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from engine.model import grammar as grammar_mod

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # "pick a random seed"
INT32_MAX = 2**31 - 1

# Sampler names as llama.cpp's `common_sampler_type_to_str`; order = `common_params_sampling::samplers`.
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
_SAMPLER_ALIASES = {
    "top-k": "top_k", "top-p": "top_p", "nucleus": "top_p", "typical-p": "typ_p", "typical": "typ_p",
    "typ-p": "typ_p", "typ": "typ_p", "min-p": "min_p", "temp": "temperature", "top-n-sigma": "top_n_sigma",
    "adaptive-p": "adaptive_p",
}
_SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "m": "min_p", "t": "temperature",
                  "x": "xtc", "e": "penalties", "s": "top_n_sigma", "i": "infill", "a": "adaptive_p"}
_SUPPORTED_SAMPLERS = frozenset(DEFAULT_SAMPLERS)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings; field names and defaults are llama-server's (llama.cpp common/common.h,
    `common_params_sampling`)."""

    seed: int = LLAMA_DEFAULT_SEED
    temperature: float = 0.8
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    typical_p: float = 1.0
    repeat_last_n: int = 64
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0  # DRY is not implemented: a non-zero multiplier is rejected
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    n_probs: int = 0
    min_keep: int = 0
    post_sampling_probs: bool = False
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias); ignore_eos adds (eog, -inf) entries
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    grammar: str = ""         # llguidance grammar (engine.model.grammar) from the request's grammar / json_schema
    grammar_source: str = ""  # what the request gave: the GBNF text, or the JSON schema as JSON
    grammar_lazy: bool = False                                 # constrain only once a trigger has fired
    grammar_triggers: tuple[grammar_mod.GrammarTrigger, ...] = ()
    preserved_tokens: tuple[int, ...] = ()                     # sorted ids whose text is kept in the output

    @classmethod
    def from_request(cls, data: dict, defaults: SamplingParams | None = None, *, n_vocab: int | None = None,
                     eog_ids=(), tokenize=None) -> SamplingParams:
        """Parse a request body the way server-schema.cpp does.

        Soft-limit fields are clamped, hard-limit fields raise `ValueError("Field 'x': ...")`, JSON null
        means "use the default". `tokenize(str) -> list[int]` resolves string keys of `logit_bias`;
        `eog_ids` are banned when `ignore_eos` is true.
        """
        base = defaults if defaults is not None else cls()
        out: dict = {}

        def has(name: str) -> bool:
            return data.get(name) is not None

        for name, lo, hi in (("top_k", 0, INT32_MAX), ("mirostat", 0, 2)):
            if has(name):
                out[name] = int(min(hi, max(lo, _number(name, data[name], int))))
        for name, lo, hi in (("top_p", 0.0, 1.0), ("min_p", 0.0, 1.0), ("xtc_probability", 0.0, 1.0),
                             ("xtc_threshold", 0.0, 1.0), ("temperature", 0.0, math.inf)):
            if has(name):
                out[name] = min(hi, max(lo, _number(name, data[name], float)))
        for name in ("dynatemp_range", "dynatemp_exponent", "top_n_sigma", "typical_p", "repeat_penalty",
                     "frequency_penalty", "presence_penalty", "dry_multiplier", "mirostat_tau", "mirostat_eta"):
            if has(name):
                out[name] = _number(name, data[name], float)
        for name in ("repeat_last_n", "dry_allowed_length", "dry_penalty_last_n", "min_keep"):
            if has(name):
                out[name] = _hard_limited(name, _number(name, data[name], int), 0, INT32_MAX)
        if has("dry_base"):
            value = _number("dry_base", data["dry_base"], float)
            out["dry_base"] = value if value >= 1.0 else base.dry_base
        if has("seed"):
            out["seed"] = _number("seed", data["seed"], int) & 0xFFFFFFFF  # -1 wraps to LLAMA_DEFAULT_SEED
        for name in ("n_probs", "logprobs"):  # "logprobs" is an alias used when n_probs is absent
            if has(name):
                out["n_probs"] = _number(name, data[name], int)
                break
        for name in ("post_sampling_probs", "ignore_eos"):
            if has(name):
                if not isinstance(data[name], bool):
                    raise ValueError(f"Field '{name}': type must be boolean")
                out[name] = data[name]
        if has("samplers"):
            out["samplers"] = _parse_samplers(data["samplers"])

        logit_bias = list(base.logit_bias)
        if has("logit_bias"):
            logit_bias = _parse_logit_bias(data["logit_bias"], n_vocab, tokenize)
        if out.get("ignore_eos", base.ignore_eos):
            banned = {t for t, b in logit_bias if b == -math.inf}
            logit_bias += [(int(t), -math.inf) for t in sorted(eog_ids) if t not in banned]
        out["logit_bias"] = tuple(logit_bias)
        out.update(_parse_grammar(data))

        params = replace(base, **out)
        params.check_supported()
        return params

    def check_supported(self) -> None:
        """Reject settings this engine cannot honour instead of silently ignoring them."""
        unknown = [s for s in self.samplers if s not in _SUPPORTED_SAMPLERS]
        if unknown:
            raise ValueError(f"unsupported sampler(s): {', '.join(unknown)}")
        if self.dry_multiplier != 0.0 and "dry" in self.samplers:
            raise ValueError("DRY sampling (dry_multiplier != 0) is not supported by this engine")

    @property
    def is_random_seed(self) -> bool:
        return self.seed == LLAMA_DEFAULT_SEED


def _parse_grammar(data: dict) -> dict:
    """`json_schema` / `grammar` as server-schema.cpp reads them: the schema is used when there is no
    `grammar` key; a grammar string of another type falls back to none (json_value). A schema that does not
    compile is a 400 '"json_schema": ...'; a grammar that does not parse is upstream's sampler-init error."""
    if "json_schema" in data and "grammar" not in data and data["json_schema"] is not None:
        schema = data["json_schema"]
        try:
            compiled = grammar_mod.from_json_schema(schema)
        except grammar_mod.GrammarError as e:
            raise ValueError(f'"json_schema": {e}') from None
        err = grammar_mod.validate(compiled)
        if err:
            raise ValueError(f'"json_schema": {err}')
        return {"grammar": compiled, "grammar_source": json.dumps(schema, separators=(",", ":"))}
    text = data.get("grammar")
    if isinstance(text, str) and text:
        try:
            compiled = grammar_mod.from_gbnf(text)
            err = grammar_mod.validate(compiled)
        except grammar_mod.GrammarError:
            err = grammar_mod.MSG_BAD_GRAMMAR
        if err:
            raise ValueError(f"Failed to initialize samplers: {grammar_mod.MSG_BAD_GRAMMAR}")
        return {"grammar": compiled, "grammar_source": text}
    return {}


def _number(name: str, value, kind):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"Field '{name}': type must be number, but is {type(value).__name__}")
    if kind is int:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"Field '{name}': value must be finite")
        return int(value)  # JSON 0.7 for an int field truncates, as nlohmann's get<int> does
    return float(value)


def _hard_limited(name: str, value: int, lo: int, hi: int) -> int:
    if value < lo or value > hi:
        raise ValueError(f"Field '{name}': Value must be between {lo} <= value <= {hi}, but got {value}")
    return value


def _parse_samplers(value) -> tuple[str, ...]:
    if isinstance(value, str):
        names = [_SAMPLER_CHARS[c] for c in value if c in _SAMPLER_CHARS]
    elif isinstance(value, list):
        names = []
        for item in value:
            if isinstance(item, str):
                name = _SAMPLER_ALIASES.get(item, item)
                if name in _SUPPORTED_SAMPLERS or name in ("infill", "adaptive_p"):
                    names.append(name)  # unknown names are dropped, as upstream does
    else:
        raise ValueError("Field 'samplers': must be an array of names or a string of sampler chars")
    return tuple(names)


def _parse_bias(value) -> float | None:
    if isinstance(value, bool):
        return -math.inf if value is False else None  # false bans; true is not a valid bias
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _parse_logit_bias(value, n_vocab: int | None, tokenize) -> list[tuple[int, float]]:
    """`[[token, bias], ...]` or `{"token": bias}`; a token may be an id or a string to tokenize."""
    out: list[tuple[int, float]] = []

    def add(token, bias: float) -> None:
        if isinstance(token, str):
            if tokenize is None:
                raise ValueError("Field 'logit_bias': string tokens need a tokenizer")
            out.extend((int(t), bias) for t in tokenize(token))
        elif n_vocab is None or 0 <= token < n_vocab:
            out.append((int(token), bias))

    if isinstance(value, list):
        for el in value:
            if not isinstance(el, list) or len(el) != 2:
                continue
            bias = _parse_bias(el[1])
            if bias is None:
                continue
            if isinstance(el[0], int) and not isinstance(el[0], bool):
                add(el[0], bias)
            elif isinstance(el[0], str):
                add(el[0], bias)
    elif isinstance(value, dict):
        for key, raw in value.items():
            bias = _parse_bias(raw)
            if bias is None:
                continue
            key = str(key)
            add(int(key) if key.lstrip("-").isdigit() else key, bias)
    return out


# ---- random numbers ------------------------------------------------------------------------------------


def make_rng(seed: int) -> np.random.Generator:
    """An MT19937 generator in the state `std::mt19937(seed)` starts in; LLAMA_DEFAULT_SEED draws a seed."""
    seed_cur = secrets.randbits(32) if seed == LLAMA_DEFAULT_SEED else seed & 0xFFFFFFFF
    key = np.empty(624, dtype=np.uint32)
    value = seed_cur
    key[0] = value
    for i in range(1, 624):  # init_genrand, the seeding both std::mt19937 and numpy's legacy MT use
        value = (1812433253 * (value ^ (value >> 30)) + i) & 0xFFFFFFFF
        key[i] = value
    bit_gen = np.random.MT19937()
    bit_gen.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": 624}}
    return np.random.Generator(bit_gen)


def _uniform_double(rng: np.random.Generator) -> float:
    """`std::uniform_real_distribution<double>(0, 1)` on mt19937 (libstdc++ generate_canonical: 2 draws)."""
    if isinstance(rng.bit_generator, np.random.MT19937):
        lo, hi = rng.bit_generator.random_raw(2)
        value = (float(lo) + float(hi) * 4294967296.0) / 18446744073709551616.0
        return value if value < 1.0 else math.nextafter(1.0, 0.0)
    return float(rng.random())


def _uniform_float(rng: np.random.Generator) -> float:
    """`std::uniform_real_distribution<float>(0, 1)` on mt19937 (one draw, float arithmetic)."""
    if isinstance(rng.bit_generator, np.random.MT19937):
        value = np.float32(rng.bit_generator.random_raw()) / np.float32(4294967296.0)
        return float(value) if value < 1.0 else float(np.nextafter(np.float32(1.0), np.float32(0.0)))
    return float(rng.random(dtype=np.float32))


# ---- candidates and samplers ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Candidates:
    """`llama_token_data_array`: the surviving tokens in llama.cpp's order (order decides `dist`)."""

    ids: np.ndarray  # [n] int64
    logits: np.ndarray  # [n] float32
    probs: np.ndarray | None = None  # [n] float32, set by samplers that normalise
    is_sorted: bool = False  # descending by logit

    def take(self, index) -> None:
        self.ids, self.logits = self.ids[index], self.logits[index]
        if self.probs is not None:
            self.probs = self.probs[index]

    def sort(self) -> None:
        if not self.is_sorted:
            self.take(np.argsort(-self.logits, kind="stable"))
            self.is_sorted = True

    def softmax(self, sort: bool) -> None:
        """`llama_sampler_softmax_impl` (float32, like upstream)."""
        if sort:
            self.sort()
        p = np.exp(self.logits - self.logits.max())
        # upstream sums in float32 left to right; np.cumsum is sequential, np.sum would be pairwise,
        # and the difference moves top-p's cut-off on long candidate lists
        self.probs = p / np.cumsum(p, dtype=np.float32)[-1]


def _apply_top_k(c: _Candidates, k: int) -> None:
    if k <= 0:
        return
    k = min(k, len(c.ids))
    if not c.is_sorted:
        if k < len(c.ids):  # avoid sorting the whole vocabulary: partition, then sort k entries
            idx = np.sort(np.argpartition(-c.logits, k - 1)[:k])
            c.take(idx)
        c.sort()
    c.take(slice(0, k))


def _apply_top_p(c: _Candidates, p: float, min_keep: int) -> None:
    if p >= 1.0:
        return
    c.softmax(sort=False)
    if not c.is_sorted:
        n = len(c.ids)
        head = min(256, n)
        if n > 1024:  # upstream's heuristic: the nucleus is usually inside the top 256
            idx = np.sort(np.argpartition(-c.logits, head - 1)[:head])
            order = idx[np.argsort(-c.logits[idx], kind="stable")]
            cum = np.cumsum(c.probs[order], dtype=np.float32)
            if not np.any((cum >= p) & (np.arange(1, head + 1) >= min_keep)):
                order = None
        else:
            order = None
        if order is None:
            order = np.argsort(-c.logits, kind="stable")
        c.take(order)
        c.is_sorted = True
    cum = np.cumsum(c.probs, dtype=np.float32)
    hit = np.flatnonzero((cum >= np.float32(p)) & (np.arange(1, len(cum) + 1) >= min_keep))
    if hit.size:
        c.take(slice(0, int(hit[0]) + 1))


def _apply_min_p(c: _Candidates, p: float, min_keep: int) -> None:
    if p <= 0.0 or len(c.ids) == 0:
        return
    log_p = np.float32(math.log(p))
    if not c.is_sorted:
        keep = c.logits >= c.logits.max() + log_p
        n_keep = int(keep.sum())
        if n_keep > 0 and n_keep >= min_keep:
            c.take(keep)
            return
        c.sort()
    below = c.logits < c.logits[0] + log_p
    below[0] = False  # the top token always survives
    below &= np.arange(len(below)) >= min_keep
    hit = np.flatnonzero(below)
    if hit.size:
        c.take(slice(0, int(hit[0])))


def _apply_typical(c: _Candidates, p: float, min_keep: int) -> None:
    if p >= 1.0:
        return
    c.softmax(sort=True)
    probs = c.probs.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        neg_log = np.where(probs > 0, -np.log(probs), np.inf)
        entropy = float(np.sum(np.where(probs > 0, probs * neg_log, 0.0)))
    order = np.argsort(np.abs(neg_log - entropy), kind="stable")
    cum = np.cumsum(c.probs[order], dtype=np.float32)
    ok = (cum > np.float32(p)) & ((min_keep == 0) | (np.arange(len(cum)) >= min_keep - 1))
    hit = np.flatnonzero(ok)
    last = int(hit[0]) + 1 if hit.size else len(order)
    c.take(order[:last])
    c.is_sorted = False


def _apply_top_n_sigma(c: _Candidates, n: float) -> None:
    if n <= 0.0 or len(c.ids) <= 1:
        return
    finite = c.logits != -np.inf
    if finite.any():
        vals = c.logits[finite].astype(np.float64)
        top, std = vals.max(), vals.std()
        c.logits = np.where(c.logits < top - n * std, np.float32(-np.inf), c.logits).astype(np.float32)
    c.softmax(sort=True)


def _apply_xtc(c: _Candidates, probability: float, threshold: float, min_keep: int, rng) -> None:
    if probability <= 0.0 or threshold > 0.5 or len(c.ids) < 2:
        return
    if _uniform_float(rng) > probability:
        return
    c.softmax(sort=True)
    below = np.flatnonzero(~(c.probs >= np.float32(threshold)))
    pos_last = max(0, (int(below[0]) if below.size else len(c.probs)) - 1)  # last of the leading run >= t
    if len(c.ids) - pos_last >= min_keep and pos_last > 0:
        c.take(slice(pos_last, None))


def _apply_temperature(c: _Candidates, temp: float, delta: float, exponent: float) -> None:
    if delta > 0.0:
        if len(c.ids) <= 1:
            return
        min_temp, max_temp = max(0.0, temp - delta), temp + delta
        max_entropy = -math.log(1.0 / len(c.ids))
        c.softmax(sort=True)
        probs = c.probs[c.probs > 0].astype(np.float64)
        entropy = float(-(probs * np.log(probs)).sum())
        temp = min_temp + (max_temp - min_temp) * (entropy / max_entropy) ** exponent
    if temp <= 0.0:  # greedy: everything but the first maximum becomes -inf, nothing is removed
        best = int(np.argmax(c.logits))
        logits = np.full_like(c.logits, -np.inf)
        logits[best] = c.logits[best]
        c.logits = logits
    else:
        c.logits = (c.logits / np.float32(temp)).astype(np.float32)
    if delta > 0.0:
        c.softmax(sort=False)


def _dist(c: _Candidates, rng) -> int:
    """`llama_sampler_dist_apply`: one uniform draw against the running sum, in candidate order."""
    if len(c.ids) == 1:  # still draws once, keeping the RNG stream aligned with llama.cpp's
        _uniform_double(rng)
        c.probs = np.ones(1, dtype=np.float32)
        return 0
    p = np.exp(c.logits - c.logits.max())
    cum = np.cumsum(p, dtype=np.float64)
    total = cum[-1]
    target = total * _uniform_double(rng)
    c.probs = (p / total).astype(np.float32)
    return min(int(np.searchsorted(cum, target, side="left")), len(cum) - 1)


def _discrete(c: _Candidates, rng) -> int:
    """`std::discrete_distribution` (used by mirostat): lower_bound of u in the normalised prefix sums."""
    cum = np.cumsum(c.probs.astype(np.float64))
    cum /= cum[-1]
    return min(int(np.searchsorted(cum, _uniform_double(rng), side="left")), len(cum) - 1)


@dataclass(frozen=True, slots=True)
class SampleResult:
    """A sampled token and, when `n_probs > 0`, its log-probability and the top-n (id, logprob) list.

    Pre-sampling (default) probabilities are the softmax of the raw logits; with `post_sampling_probs`
    they are the final distribution of the chain (zero-probability entries dropped), as upstream.
    """

    token: int
    logprob: float | None = None
    probs: list[tuple[int, float]] | None = None


def _log(p: float) -> float:
    return math.log(p) if p > 0.0 else -math.inf


@dataclass(slots=True)
class Sampler:
    """Per-sequence sampler state: parameters, RNGs (explicit `numpy.random.Generator`s) and mirostat's mu.

    `prev_tokens` passed to `sample` is the sequence so far (llama-server feeds the prompt into the
    penalty window too); the last `repeat_last_n` of them are penalised.
    """

    params: SamplingParams
    n_vocab: int
    eog_ids: frozenset[int] = frozenset()
    rng: np.random.Generator | None = None  # dist / mirostat draws
    xtc_rng: np.random.Generator | None = None  # XTC has its own generator upstream, seeded the same way
    tokenizer: Any = None                     # the model's tokenizer; needed only for a grammar
    mirostat_mu: float = field(init=False, default=0.0)
    constraint: Any = field(init=False, default=None, repr=False)   # engine.model.grammar.Constraint
    _bias_ids: np.ndarray = field(init=False, repr=False)
    _bias_vals: np.ndarray = field(init=False, repr=False)
    _all_ids: np.ndarray = field(init=False, repr=False)  # [n_vocab] int64, never modified in place

    def __post_init__(self) -> None:
        self.params.check_supported()
        if self.rng is None:
            self.rng = make_rng(self.params.seed)
        if self.xtc_rng is None and self.params.xtc_probability > 0.0:
            self.xtc_rng = make_rng(self.params.seed)
        self.mirostat_mu = 2.0 * self.params.mirostat_tau
        self.constraint = None
        if self.params.grammar:
            if self.tokenizer is None:
                raise ValueError("a grammar needs the model's tokenizer")
            if self.params.grammar_lazy:    # common_sampler_init: llama_sampler_init_grammar_lazy_patterns
                self.constraint = grammar_mod.LazyConstraint(self.params.grammar, self.tokenizer,
                                                             self.params.grammar_triggers)
            else:
                self.constraint = grammar_mod.Constraint(self.params.grammar, self.tokenizer)
        bias = [(t, b) for t, b in self.params.logit_bias if 0 <= t < self.n_vocab]
        if self.params.ignore_eos:  # from_request already added these; params built in code may not have
            banned = {t for t, b in bias if b == -math.inf}
            bias += [(t, -math.inf) for t in sorted(self.eog_ids) if t not in banned and 0 <= t < self.n_vocab]
        self._bias_ids = np.array([t for t, _ in bias], dtype=np.int64)
        self._bias_vals = np.array([b for _, b in bias], dtype=np.float32)
        self._all_ids = np.arange(self.n_vocab, dtype=np.int64)

    def sample(self, logits_row: np.ndarray, prev_tokens=()) -> SampleResult:
        params = self.params
        raw = np.asarray(logits_row, dtype=np.float32)  # [n_vocab]
        if raw.shape != (self.n_vocab,):
            raise ValueError(f"logits row has shape {raw.shape}, expected (n_vocab,) = ({self.n_vocab},)")
        c, selected = self._run_chain(raw, prev_tokens, grammar=False)
        token = int(c.ids[selected])
        g = self.constraint
        if g is not None:
            # common_sampler_sample: keep the token if the grammar accepts it, else mask and sample again
            # (a lazy grammar awaiting its trigger accepts every token)
            if not g.allows(token):
                c, selected = self._run_chain(raw, prev_tokens, grammar=True)
                token = int(c.ids[selected])
            g.accept(token)

        if params.n_probs <= 0:
            return SampleResult(token)
        if params.post_sampling_probs:
            order = np.argsort(-c.probs, kind="stable")[: params.n_probs]
            top = [(int(c.ids[i]), _log(float(c.probs[i]))) for i in order if c.probs[i] > 0.0]
            return SampleResult(token, _log(float(c.probs[selected])), top)
        return self._pre_sampling_probs(raw, token)

    def _run_chain(self, raw: np.ndarray, prev_tokens, grammar: bool) -> tuple[_Candidates, int]:
        """Logit bias, (the grammar mask,) then the sampler chain and the draw: (candidates, selected)."""
        params = self.params
        copy = grammar or self._bias_ids.size or self._penalties_active()
        logits = raw.copy() if copy else raw
        if self._bias_ids.size:
            np.add.at(logits, self._bias_ids, self._bias_vals)
        if grammar:
            self.constraint.mask(logits)
        c = _Candidates(ids=self._all_ids, logits=logits)
        if params.mirostat == 0:
            for name in params.samplers:
                self._apply(name, c, prev_tokens)
            selected = _dist(c, self.rng)
        else:
            _apply_temperature(c, params.temperature, 0.0, 1.0)
            selected = self._mirostat(c)
        return c, selected

    def _penalties_active(self) -> bool:
        p = self.params
        return p.repeat_last_n > 0 and "penalties" in p.samplers and (
            p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)

    def _apply(self, name: str, c: _Candidates, prev_tokens) -> None:
        p = self.params
        if name == "penalties":
            self._apply_penalties(c, prev_tokens)
        elif name == "top_k":
            _apply_top_k(c, p.top_k)
        elif name == "typ_p":
            _apply_typical(c, p.typical_p, p.min_keep)
        elif name == "top_p":
            _apply_top_p(c, p.top_p, p.min_keep)
        elif name == "min_p":
            _apply_min_p(c, p.min_p, p.min_keep)
        elif name == "top_n_sigma":
            _apply_top_n_sigma(c, p.top_n_sigma)
        elif name == "xtc":
            _apply_xtc(c, p.xtc_probability, p.xtc_threshold, p.min_keep, self.xtc_rng)
        elif name == "temperature":
            _apply_temperature(c, p.temperature, p.dynatemp_range, p.dynatemp_exponent)
        # "dry" with multiplier 0 is a no-op (non-zero is rejected in check_supported)

    def _apply_penalties(self, c: _Candidates, prev_tokens) -> None:
        p = self.params
        if not self._penalties_active() or len(prev_tokens) == 0:
            return
        window = np.asarray(prev_tokens[-p.repeat_last_n:], dtype=np.int64)
        ids, counts = np.unique(window, return_counts=True)
        if len(c.ids) == self.n_vocab and c.ids[0] == 0 and c.ids[-1] == self.n_vocab - 1:
            pos, counts = ids[(ids >= 0) & (ids < self.n_vocab)], counts[(ids >= 0) & (ids < self.n_vocab)]
        else:  # the chain was reordered: find the penalised ids among the survivors
            where = np.isin(c.ids, ids)
            pos = np.flatnonzero(where)
            counts = counts[np.searchsorted(ids, c.ids[pos])]
        vals = c.logits[pos]
        vals = np.where(vals <= 0, vals * np.float32(p.repeat_penalty), vals / np.float32(p.repeat_penalty))
        vals -= counts.astype(np.float32) * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty)
        c.logits[pos] = vals.astype(np.float32)
        c.is_sorted = False

    def _mirostat(self, c: _Candidates) -> int:
        p = self.params
        c.softmax(sort=True)
        if p.mirostat == 1:
            m = min(100 - 1, len(c.ids) - 1)
            i = np.arange(m, dtype=np.float64)
            t = np.log((i + 2) / (i + 1))
            b = np.log(c.probs[:m].astype(np.float64) / c.probs[1:m + 1].astype(np.float64))
            s_hat = float((t * b).sum() / (t * t).sum())
            eps = s_hat - 1
            with np.errstate(all="ignore"):
                k = ((eps * 2.0 ** self.mirostat_mu) / (1 - self.n_vocab ** -eps)) ** (1 / s_hat)
            _apply_top_k(c, max(int(k), 1) if math.isfinite(k) else len(c.ids))
        else:
            surprise = -np.log2(c.probs.astype(np.float64))
            over = np.flatnonzero(surprise > self.mirostat_mu)
            c.take(slice(0, max(int(over[0]) if over.size else len(c.ids), 1)))
        c.softmax(sort=True)
        selected = _discrete(c, self.rng)
        self.mirostat_mu -= p.mirostat_eta * (-math.log2(float(c.probs[selected])) - p.mirostat_tau)
        return selected

    def _pre_sampling_probs(self, raw: np.ndarray, token: int) -> SampleResult:
        """`get_token_probabilities`: softmax of the raw logits (no bias, no penalties), top n_probs."""
        n = min(self.params.n_probs, len(raw))
        p = np.exp(raw - raw.max())  # [n_vocab]
        p /= p.sum(dtype=np.float64)
        top = np.argpartition(-raw, n - 1)[:n] if n < len(raw) else np.arange(len(raw))
        top = top[np.lexsort((top, -raw[top]))]
        return SampleResult(token, _log(float(p[token])), [(int(i), _log(float(p[i]))) for i in top])


__all__ = ["LLAMA_DEFAULT_SEED", "DEFAULT_SAMPLERS", "SamplingParams", "Sampler", "SampleResult", "make_rng"]
