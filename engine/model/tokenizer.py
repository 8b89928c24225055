"""Tokenizer built from a GGUF vocabulary, producing llama.cpp's token ids, pieces and EOG set.

Mirrors llama.cpp `llama_vocab::impl` (src/llama-vocab.cpp): `load()` (special-token ids, attribute fixes,
EOG detection), `tokenize()` (special-token partition, then BPE or SPM per text fragment) and
`token_to_piece()`; `detokenize` is llama-server's `tokens_to_str` (`common_token_to_piece` concatenation).
"""

from __future__ import annotations

import heapq
import mmap
import struct
from dataclasses import dataclass

import gguf
import numpy as np
from tokenizers import Regex, Tokenizer as HFTokenizer, models, pre_tokenizers

# llama_token_attr bits (llama.h); a token's attr is derived from its GGUF token type.
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

_ATTR_OF_TYPE = {1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL, 4: ATTR_USER_DEFINED,
                 5: ATTR_UNUSED, 6: ATTR_BYTE}
_ATTR_RENDERED_ONLY_IF_SPECIAL = ATTR_UNKNOWN | ATTR_CONTROL

# Pre-tokenizer regexes, copied as facts from llama.cpp `llm_tokenizer_bpe` (applied in order, each split
# keeps matched and unmatched parts, like HF `Split(behavior="isolated")`).
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
              r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
             r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_RE_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _RE_GPT2, r"[0-9][0-9][0-9]")


@dataclass(frozen=True, slots=True)
class PreTokenizerSpec:
    """How llama.cpp pre-tokenizes one `tokenizer.ggml.pre` family."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a vocab entry is emitted whole (llama3)
    add_bos: bool = False  # default of `add_bos` before the GGUF key overrides it


_SMOLLM = PreTokenizerSpec((r"\p{N}", _RE_GPT2))
_GPT2 = PreTokenizerSpec((_RE_GPT2,))
_LLAMA3 = PreTokenizerSpec((_RE_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizerSpec((_RE_QWEN2,))

PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "default": PreTokenizerSpec(_RE_DEFAULT),
    "falcon": PreTokenizerSpec(_RE_FALCON),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b", "mellum2"), _SMOLLM),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                     "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion",
                     "granite-docling", "exaone4"), _GPT2),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano"), _LLAMA3),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizerSpec((_RE_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "megrez", "hunyuan",
                     "solar-open"), _QWEN2),
}

# Token texts llama.cpp recognises when the GGUF does not name the id (`llama_vocab::impl::load`).
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss hack

_SPM_SPACE = "\u2581"  # "▁", SentencePiece's escaped space
_C_ISSPACE = " \t\n\v\f\r"


def _gpt2_byte_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to U+0100 upwards."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    n_extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + n_extra)
            n_extra += 1
    return table


_BYTE_TO_UNICODE = _gpt2_byte_to_unicode()
_UNICODE_TO_BYTE = {c: b for b, c in _BYTE_TO_UNICODE.items()}


def _reader_metadata(reader: gguf.GGUFReader) -> dict:
    """The tokenizer-relevant KV pairs of an open GGUFReader (strings decoded one by one, leniently)."""
    meta = {}
    for key, fld in reader.fields.items():
        if not (key.startswith("tokenizer.") or key == gguf.Keys.General.NAME):
            continue
        if fld.types and fld.types[0] == gguf.GGUFValueType.ARRAY and fld.types[-1] == gguf.GGUFValueType.STRING:
            meta[key] = [bytes(fld.parts[i]).decode("utf-8", errors="replace") for i in fld.data]
        else:
            meta[key] = fld.contents()
    return meta


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: str) -> dict:
    """All KV pairs of a GGUF (v2/v3, little-endian) without touching tensor data.

    `gguf.GGUFReader` builds a numpy view per array element (seconds for a 49k vocabulary); the
    tokenizer and chat template only need the key/value section at the head of the file.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, _n_tensors, n_kv = struct.unpack_from("<IIQQ", buf, 0)
        if magic != gguf.GGUF_MAGIC or version not in (2, 3):
            raise ValueError(f"{path}: not a little-endian GGUF v2/v3 file")
        off = 24

        def read_str(o: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, o)
            return bytes(buf[o + 8:o + 8 + n]).decode("utf-8", errors="replace"), o + 8 + n

        def read_value(vtype: int, o: int):
            if vtype == _GGUF_STRING:
                return read_str(o)
            if vtype == _GGUF_ARRAY:
                etype, count = struct.unpack_from("<IQ", buf, o)
                o += 12
                if etype in _GGUF_SCALARS:
                    dtype = np.dtype(_GGUF_SCALARS[etype])
                    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=o).tolist()
                    return arr, o + count * dtype.itemsize
                items = []
                for _ in range(count):
                    item, o = read_value(etype, o)
                    items.append(item)
                return items, o
            fmt = _GGUF_SCALARS[vtype]
            return struct.unpack_from(fmt, buf, o)[0], o + struct.calcsize(fmt)

        meta = {}
        for _ in range(n_kv):
            key, off = read_str(off)
            (vtype,) = struct.unpack_from("<I", buf, off)
            meta[key], off = read_value(vtype, off + 4)
        return meta


def _valid_unicode(text: str) -> str:
    """Lone surrogates (possible from JSON "\\ud800") cannot be UTF-8 encoded: pair them or use U+FFFD."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _decode_gpt2_text(text: str) -> bytes:
    """llama.cpp `llama_decode_text`: byte-level alphabet back to raw bytes."""
    try:
        return bytes(map(_UNICODE_TO_BYTE.__getitem__, text))
    except KeyError:
        pass
    out = bytearray()
    for ch in text:
        b = _UNICODE_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:  # upstream's odd fallback, kept verbatim so pieces stay identical
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
    return bytes(out)


class Tokenizer:
    """Text ↔ token ids with llama.cpp semantics for `gpt2` (byte-level BPE) and `llama` (SPM) vocabs."""

    def __init__(self, *, model: str, pre: str, tokens: list[str], token_types: list[int] | None,
                 scores: list[float] | None, merges: list[str] | None, special_ids: dict[str, int],
                 add_bos: bool | None = None, add_eos: bool | None = None, add_space_prefix: bool | None = None,
                 model_name: str = ""):
        if model not in ("gpt2", "llama"):
            raise ValueError(f"unsupported tokenizer.ggml.model {model!r} (supported: 'gpt2', 'llama')")
        self.model = model
        self.tokens = tokens
        self.n_vocab = len(tokens)
        self.token_to_id = {t: i for i, t in enumerate(tokens)}
        if len(self.token_to_id) != self.n_vocab:
            raise ValueError("duplicate token text in the GGUF vocabulary")
        self.scores = scores
        attrs = [ATTR_NORMAL] * self.n_vocab
        if token_types is not None:
            attrs = [_ATTR_OF_TYPE.get(int(t), ATTR_UNDEFINED) for t in token_types[: self.n_vocab]]

        spec = None
        if model == "gpt2":
            self.pre = pre or "default"
            spec = PRE_TOKENIZERS.get(self.pre)
            if spec is None:
                raise ValueError(f"unknown pre-tokenizer type {self.pre!r}; supported: "
                                 f"{', '.join(sorted(PRE_TOKENIZERS))}")
            default_ids = {"bos": 11, "eos": 11}
            default_add_bos, default_add_space = spec.add_bos, False
        else:
            self.pre = "default"
            default_ids = {"bos": 1, "eos": 2, "unk": 0}
            default_add_bos, default_add_space = True, True
        self.add_bos = default_add_bos if add_bos is None else bool(add_bos)
        self.add_eos = False if add_eos is None else bool(add_eos)
        self.add_space_prefix = default_add_space if add_space_prefix is None else bool(add_space_prefix)

        ids: dict[str, int | None] = {}
        for name in ("bos", "eos", "eot", "eom", "unk", "sep", "pad", "mask", *_FIM_TEXTS):
            tid = special_ids.get(name, default_ids.get(name))
            ids[name] = tid if tid is not None and 0 <= tid < self.n_vocab else None
        self._detect_special_tokens(ids, attrs)
        self.bos_id, self.eos_id, self.eot_id, self.eom_id = ids["bos"], ids["eos"], ids["eot"], ids["eom"]
        self.unk_id, self.pad_id = ids["unk"], ids["pad"]
        self.special_token_ids = ids
        if self.add_bos and self.bos_id is None:
            raise ValueError("tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
        if self.add_eos and self.eos_id is None:
            raise ValueError("tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set")

        self.attrs = attrs
        # cache_special_tokens: longest text first, so "<|im_start|>" wins over any shorter overlap.
        special = [i for i, a in enumerate(attrs) if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
        self._special_sorted = sorted(special, key=lambda i: (-len(tokens[i].encode()), i))
        self._pieces = [self._piece_uncached(i) for i in range(self.n_vocab)]
        self._set_strip_attrs(model_name.lower())
        self._bpe = self._build_bpe(spec, merges) if model == "gpt2" else None

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader, path: str = "") -> Tokenizer:
        """Build from an open GGUF (`path` is only used in error messages)."""
        return cls.from_metadata(_reader_metadata(reader), path)

    @classmethod
    def from_gguf_path(cls, path: str) -> Tokenizer:
        """Build from a GGUF file, reading only its metadata section (fast)."""
        return cls.from_metadata(read_gguf_metadata(str(path)), str(path))

    @classmethod
    def from_metadata(cls, meta: dict, path: str = "") -> Tokenizer:
        """Build from GGUF key/value metadata (`tokenizer.ggml.*`, `general.name`)."""
        k = gguf.Keys.Tokenizer
        model, tokens = meta.get(k.MODEL), meta.get(k.LIST)
        if model is None or tokens is None:
            raise ValueError(f"{path or 'GGUF'}: no tokenizer.ggml.model / tokenizer.ggml.tokens")
        special_keys = {"bos": k.BOS_ID, "eos": k.EOS_ID, "eot": k.EOT_ID, "eom": k.EOM_ID, "unk": k.UNK_ID,
                        "sep": k.SEP_ID, "pad": k.PAD_ID, "mask": k.MASK_ID, "fim_pre": k.FIM_PRE_ID,
                        "fim_suf": k.FIM_SUF_ID, "fim_mid": k.FIM_MID_ID, "fim_pad": k.FIM_PAD_ID,
                        "fim_rep": k.FIM_REP_ID, "fim_sep": k.FIM_SEP_ID}
        deprecated = {"fim_pre": k.PREFIX_ID, "fim_suf": k.SUFFIX_ID, "fim_mid": k.MIDDLE_ID}
        special_ids = {}
        for name, key in special_keys.items():
            value = meta.get(key, meta.get(deprecated.get(name, "")))
            if value is not None:
                special_ids[name] = int(value)
        scores = meta.get(k.SCORES)
        try:
            return cls(model=str(model), pre=str(meta.get(k.PRE) or ""), tokens=list(tokens),
                       token_types=meta.get(k.TOKEN_TYPE),
                       scores=[float(x) for x in scores] if scores is not None else None,
                       merges=meta.get(k.MERGES), special_ids=special_ids,
                       add_bos=meta.get(k.ADD_BOS), add_eos=meta.get(k.ADD_EOS),
                       add_space_prefix=meta.get(k.ADD_PREFIX), model_name=str(meta.get(gguf.Keys.General.NAME) or ""))
        except ValueError as e:
            raise ValueError(f"{path or 'GGUF'}: {e}") from None

    def _detect_special_tokens(self, ids: dict[str, int | None], attrs: list[int]) -> None:
        """Text-based detection of EOT/EOM/FIM ids and the EOG set, as `llama_vocab::impl::load` does.

        Upstream walks an unordered_map, so when several texts match an unset id the winner is
        unspecified; here the lowest id wins (the EOG set itself does not depend on that choice).
        """
        def first_match(texts) -> int | None:
            found = [self.token_to_id[t] for t in texts if t in self.token_to_id]
            return min(found) if found else None

        for name, texts in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), *_FIM_TEXTS.items()):
            if ids[name] is None:
                ids[name] = first_match(texts)
                if ids[name] is not None:
                    attrs[ids[name]] |= ATTR_CONTROL
        for i, text in enumerate(self.tokens):
            if attrs[i] & ATTR_CONTROL and "unused" in text:
                attrs[i] |= ATTR_UNUSED

        eog = {ids[n] for n in ("fim_pad", "fim_rep", "fim_sep") if ids[n] is not None}
        for text in _EOG_TEXTS:
            tid = self.token_to_id.get(text)
            if tid is not None:
                eog.add(tid)
                attrs[tid] |= ATTR_CONTROL
        for text in _ALWAYS_RENDERED:
            if text in self.token_to_id:
                attrs[self.token_to_id[text]] = ATTR_USER_DEFINED
        eog |= {ids[n] for n in ("eos", "eot", "eom") if ids[n] is not None}
        texts = {self.tokens[i]: i for i in eog}
        if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts.keys()
                                   or {"<|calls|>", "<|flush|>"} <= texts.keys()):
            eog.discard(texts["<|end|>"])  # harmony / solar-open: <|end|> ends a message, not generation
            attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
        if "<|tool_response>" in texts and "</s>" in texts:
            eog.discard(texts["</s>"])  # gemma4
            attrs[texts["</s>"]] = ATTR_NORMAL
        self.eog_ids = frozenset(eog)

    def _set_strip_attrs(self, model_name: str) -> None:
        """Per-model lstrip/rstrip attributes llama.cpp sets by name (they only affect tokenize)."""
        if "phi-3" in model_name or "phi3" in model_name:
            for tid in self._special_sorted:
                self.attrs[tid] |= ATTR_RSTRIP
            for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                if text in self.token_to_id:
                    tid = self.token_to_id[text]
                    self.attrs[tid] = self.attrs[tid] | ATTR_RSTRIP if on else self.attrs[tid] & ~ATTR_RSTRIP
        elif self.pre in ("jina-v2-de", "jina-v2-es", "jina-v2-code") and "<mask>" in self.token_to_id:
            self.attrs[self.token_to_id["<mask>"]] |= ATTR_LSTRIP

    def _build_bpe(self, spec: PreTokenizerSpec, merges: list[str] | None) -> HFTokenizer:
        if merges is None:
            raise ValueError("cannot find tokenizer merges in model file")
        pairs = []
        self.n_merges_dropped = 0  # HF rejects merges whose result is not a vocab entry; upstream keeps them
        for m in merges:
            pos = m.find(" ", 1)
            if pos < 0:
                continue
            a, b = m[:pos], m[pos + 1:]
            if a in self.token_to_id and b in self.token_to_id and a + b in self.token_to_id:
                pairs.append((a, b))
            else:
                self.n_merges_dropped += 1
        bpe = models.BPE(vocab=self.token_to_id, merges=pairs, ignore_merges=spec.ignore_merges,
                         fuse_unk=False)
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
        return hf

    # ---- tokenize --------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """`llama_tokenize`: BOS/EOS only if `add_special` and the vocab asks for them; with
        `parse_special=False` control-token text is plain text (user-defined tokens still match)."""
        text = _valid_unicode(text)
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        after_special = True  # SPM prefixes a space to a fragment that follows a special token
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                after_special = True
            elif self._bpe is not None:
                out.extend(self._bpe.encode(frag, add_special_tokens=False).ids)
            else:
                if self.add_space_prefix and after_special:
                    frag = " " + frag
                out.extend(self._spm_tokenize(frag.replace(" ", _SPM_SPACE)))
                after_special = False
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """`tokenizer_st_partition`: split raw text around special-token texts, longest token first."""
        frags: list[str | int] = [text] if text else []
        for tid in self._special_sorted:
            attr = self.attrs[tid]
            if not parse_special and attr & (ATTR_CONTROL | ATTR_UNKNOWN):
                continue
            tok = self.tokens[tid]
            if tok not in text:
                continue
            new: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or tok not in frag:
                    new.append(frag)
                    continue
                parts = frag.split(tok)
                for j, part in enumerate(parts):
                    if j > 0 and attr & ATTR_RSTRIP:
                        part = part.lstrip(_C_ISSPACE)
                    if j < len(parts) - 1 and attr & ATTR_LSTRIP:
                        part = part.rstrip(_C_ISSPACE)
                    if part:
                        new.append(part)
                    if j < len(parts) - 1:
                        new.append(tid)
            frags = new
        return frags

    def _spm_tokenize(self, text: str) -> list[int]:
        """`llm_tokenizer_spm_session`: greedy highest-score bigram merges, then byte fallback."""
        if not text:
            return []
        sym_text = list(text)  # one symbol per code point; merged-away symbols become ""
        nxt = list(range(1, len(text) + 1))
        nxt[-1] = -1
        prv = list(range(-1, len(text) - 1))
        heap: list[tuple[float, int, int, str]] = []
        scores = self.scores or [0.0] * self.n_vocab

        def try_add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            merged = sym_text[left] + sym_text[right]
            tid = self.token_to_id.get(merged)
            if tid is None:
                return
            heapq.heappush(heap, (-scores[tid], left, right, merged))

        for i in range(1, len(text)):
            try_add(i - 1, i)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not sym_text[left] or not sym_text[right] or sym_text[left] + sym_text[right] != merged:
                continue
            sym_text[left], sym_text[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            try_add(prv[left], left)
            try_add(left, nxt[left])

        # Every merge produces a vocab entry, so a final symbol that is not one is a single code point:
        # upstream's `resegment` then falls back to byte tokens (its rev_merge branch cannot trigger).
        out: list[int] = []
        i = 0
        while i != -1:
            tid = self.token_to_id.get(sym_text[i])
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._spm_byte_token(b) for b in sym_text[i].encode("utf-8"))
            i = nxt[i]
        return out

    def _spm_byte_token(self, byte: int) -> int:
        tid = self.token_to_id.get(f"<0x{byte:02X}>")
        if tid is None:
            tid = self.token_to_id.get(chr(byte), self.unk_id)
        return tid

    # ---- pieces ----------------------------------------------------------------------------------

    def _piece_uncached(self, tid: int) -> bytes:
        attr, text = self.attrs[tid], self.tokens[tid]
        if attr & (_ATTR_RENDERED_ONLY_IF_SPECIAL | ATTR_USER_DEFINED):
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if self.model == "gpt2":
                return _decode_gpt2_text(text)
            return text.replace(_SPM_SPACE, " ").encode("utf-8")
        if attr & ATTR_BYTE:
            return bytes([int(text[3:5], 16)])
        return b""

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """Raw bytes of one token (may be a partial UTF-8 sequence); control/unknown tokens are empty
        unless `special`."""
        if not special and self.attrs[token_id] & _ATTR_RENDERED_ONLY_IF_SPECIAL:
            return b""
        return self._pieces[token_id]

    def detokenize(self, ids, special: bool = True) -> str:
        """Concatenated pieces; invalid or truncated UTF-8 becomes U+FFFD."""
        return b"".join(self.token_to_piece(int(t), special) for t in ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as stored in the GGUF (e.g. 'Ġhello', '<|im_start|>')."""
        return self.tokens[token_id]

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def is_control(self, token_id: int) -> bool:
        return bool(self.attrs[token_id] & ATTR_CONTROL)

