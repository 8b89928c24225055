"""Server options (the `slotlab serve` flags that are not scheduling settings) and the running server state:
the model, core, backend and engine thread, loaded in the background while the API answers 503.

Mirrors `server_context::load_model` / `init` and the model-name rules of server.cpp, and sleeping on idle
(`--sleep-idle-seconds`, `server_queue::start_loop` + `server_context::handle_sleeping_state`): when the
engine thread has had no task for that long and no request that needs the model is open, the model, KV
memory, slots and prompt cache are dropped; `/health`, `/props`, `/models` and `/metrics` answer from
responses cached at that moment; any other request reloads the model first (`wake`). As upstream, the metrics
counters survive a sleep (the reloaded core takes them over) and the slots and prompt cache start empty.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from engine.backend import NumpyBackend
from engine.core import ServerConfig, ServerCore
from engine.http.engine_thread import Engine
from engine.http.params import ServerDefaults
from engine.http.server_log import ServerLog
from engine.model import Model, load
from engine.model.chat import ChatTemplate, TemplateError
from engine.model.sampling import SamplingParams
from engine.model.tokenizer import read_gguf_metadata
from policies import make_policies

log = logging.getLogger("slotlab.server")


def return_freed_memory() -> None:
    """Give the dropped model's memory back to the system. glibc raises its mmap threshold each time a large
    block is freed, so the weights of a model that was loaded, freed and loaded again sit in the heap, and a
    freed heap stays resident until `malloc_trim` (measured with SmolLM2: 1,074 MiB resident asleep without
    it, 157 MiB with it). A no-op where the C library has no malloc_trim."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """Everything `slotlab serve` was asked for. `config` holds the scheduling flags (model facts are filled
    in from the loaded model)."""

    model_path: str
    config: ServerConfig = field(default_factory=ServerConfig)
    n_threads: int | None = None
    default_sampling: SamplingParams = field(default_factory=SamplingParams)
    aliases: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()
    cors_origins: str = "*"            # --cors-origins: "*", "localhost" or a literal value
    cors_methods: str = "GET, POST, DELETE, OPTIONS"   # --cors-methods
    cors_headers: str = "*"            # --cors-headers
    cors_credentials: bool = True      # --cors-credentials / --no-cors-credentials
    endpoint_metrics: bool = False
    endpoint_slots: bool = True
    endpoint_props: bool = False
    slot_save_path: str = ""
    api_prefix: str = ""
    numerics: str = "f32"              # engine arithmetic (engine.model.load): "f32" or "ggml"
    chat_template: str = ""            # --chat-template / --chat-template-file: overrides the model's template
    verbose: bool = False              # -v/--verbose: OpenAI-shaped responses carry `__verbose` debug data
    sleep_idle_s: float = -1           # --sleep-idle-seconds: unload the model after this long idle; -1 = never
    warmup: bool = True                # --warmup / --no-warmup: a warm-up run at load (`Model.warm_up`)

    @property
    def model_name(self) -> str:
        """The first alias in alphabetical order (upstream keeps them in a std::set), else the file name."""
        if self.aliases:
            return sorted(self.aliases)[0]
        return os.path.basename(self.model_path)


class ServerState:
    """The server's moving parts. `ready` flips once `load()` finished; `load_error` is set if it failed."""

    def __init__(self, options: ServerOptions, loader: Callable[..., Model] = load) -> None:
        """`loader(model_path, n_threads, numerics=...)` loads the model (`engine.model.load`)."""
        self.options = options
        self.loader = loader
        self.ready = False
        self.load_error: str | None = None
        self.model: Model | None = None
        self.tokenizer: Any = None
        self.core: ServerCore | None = None
        self.backend: NumpyBackend | None = None
        self.engine: Engine | None = None
        self.chat_template: ChatTemplate | None = None
        self.chat_template_source = ""
        self.meta: dict[str, Any] = {}
        self.defaults = ServerDefaults()
        self.t_start_s = time.time()
        self.load_s = 0.0
        self._thread: threading.Thread | None = None
        # sleeping on idle
        self.sleeping = False
        self.n_sleeps = 0
        self.n_wakes = 0
        self.n_busy = 0                  # open requests that need the model: the model stays loaded meanwhile
        self.sleep_cache: dict[str, Any] = {}    # responses of the read-only endpoints, taken when falling asleep
        self.sleep_snapshot: Callable[[ServerState], dict[str, Any]] | None = None   # set by the app
        self.reset_bucket_on_wake = False
        self.lock = threading.Lock()     # guards `sleeping`, `n_busy` and posting to the engine while awake
        self._wake_lock = threading.Lock()
        self._carry: tuple[Any, int, int] | None = None   # metrics and cancelled-token counts across a sleep
        self._slept_thread: threading.Thread | None = None

    # --- loading ---------------------------------------------------------------------------------------------
    def start_loading(self, on_error: Callable[[str], None] | None = None) -> None:
        def run() -> None:
            try:
                self.load()
            except Exception as e:  # noqa: BLE001 - reported to the caller, the API keeps answering 503
                self.load_error = f"{type(e).__name__}: {e}"
                log.error("failed to load model %s: %s", self.options.model_path, self.load_error)
                if on_error is not None:
                    on_error(self.load_error)

        self._thread = threading.Thread(target=run, name="slotlab-load", daemon=True)
        self._thread.start()

    def load(self) -> None:
        t0 = time.perf_counter()
        opts = self.options
        model = self.loader(opts.model_path, opts.n_threads, numerics=opts.numerics)
        warm_up = getattr(model, "warm_up", None)
        if opts.warmup and warm_up is not None:
            # as upstream's common_init_from_params ("warming up the model with an empty run"); here it also
            # compiles the numba kernels of a compiled numerics on a fresh cache (or loads them from the cache)
            log.info("warming up the model with an empty run - please wait ... (--no-warmup to disable)")
            log.info("warm-up done in %.2f s (numerics %s)", warm_up(), getattr(model, "numerics", "f32"))
        meta = read_gguf_metadata(opts.model_path)
        config = replace(opts.config, **model.config_facts())
        resolved = config.resolve()
        # llama-server's log lines for slot and prompt-cache decisions (engine/http/server_log.py)
        server_log = ServerLog(resolved.state_size_bytes, resolved.base.slot_prompt_similarity,
                               resolved.cache_limit_bytes)
        core = ServerCore(resolved, make_policies(config.policies), server_log)
        server_log.bind(core.slots)
        backend = NumpyBackend.for_server(model, resolved, opts.default_sampling)
        template_src = opts.chat_template or str(meta.get("tokenizer.chat_template") or "")
        template = None
        if template_src:
            try:
                template = ChatTemplate(template_src)
            except TemplateError as e:
                log.warning("chat template does not compile (%s); chat endpoints will fail", e)
        self.model, self.tokenizer, self.meta = model, model.tokenizer, meta
        self.core, self.backend = core, backend
        self.chat_template, self.chat_template_source = template, template_src
        self.defaults = ServerDefaults(n_predict=config.n_predict, n_keep=config.n_keep,
                                       n_cache_reuse=resolved.base.n_cache_reuse, cache_prompt=config.cache_prompt,
                                       n_parallel=resolved.n_slots, sampling=opts.default_sampling,
                                       verbose=opts.verbose)
        engine = Engine(core, backend)
        if self._carry is not None:          # waking up: the counters go on, as upstream's server_metrics
            core.metrics, engine.n_cancelled_prompt_tokens, engine.n_cancelled_predicted_tokens = self._carry
            self._carry = None
            if self.reset_bucket_on_wake:    # a scrape while asleep already reported the buckets
                core.metrics.reset_bucket()
                self.reset_bucket_on_wake = False
        engine.sleep_idle_s = opts.sleep_idle_s
        engine.may_sleep = self._may_sleep
        engine.after_sleep = return_freed_memory
        self.engine = engine
        engine.start()
        self.load_s = time.perf_counter() - t0
        log.info("model loaded in %.2f s: %d slots, n_ctx %d (per slot %d), %s KV, %s, numerics %s",
                 self.load_s, resolved.n_slots, resolved.n_ctx, resolved.n_ctx_slot,
                 "unified" if resolved.kv_unified else "per-slot",
                 getattr(model, "threads_desc", f"{backend.n_threads} threads"),
                 getattr(model, "numerics", "f32"))
        self.ready = True

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            if self.ready:
                return True
            if self.load_error is not None:
                return False
            time.sleep(0.01)
        return self.ready

    # --- sleeping on idle --------------------------------------------------------------------------------------
    def _may_sleep(self) -> bool:
        """Asked by the engine thread when it has been idle for `sleep_idle_s`: fall asleep unless a request
        needs the model or a message is waiting. Runs in the engine thread (the core may be read)."""
        engine = self.engine
        with self.lock:
            if self.n_busy or engine is None or not engine.inbox.empty():
                return False
            self.sleep_cache = self.sleep_snapshot(self) if self.sleep_snapshot is not None else {}
            self._carry = (self.core.metrics, engine.n_cancelled_prompt_tokens, engine.n_cancelled_predicted_tokens)
            self.sleeping = True
            self.n_sleeps += 1
            self._slept_thread = threading.current_thread()
            self.model = self.tokenizer = self.core = self.backend = self.engine = None
        log.info("srv  handle_sleeping_state: server is entering sleeping state")
        return True

    def wake(self) -> None:
        """Reload the model if asleep (blocking: run it off the event loop). Requests that need the model call
        this after counting themselves in `n_busy`, so the server cannot fall asleep again under them."""
        with self._wake_lock:
            if not self.sleeping:
                return
            if self._slept_thread is not None:     # the old engine thread has let go of the model
                self._slept_thread.join()
                self._slept_thread = None
            log.info("srv  handle_sleeping_state: server is exiting sleeping state")
            self.load()
            with self.lock:
                self.sleeping = False
                self.n_wakes += 1

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.stop()

    # --- text helpers (thread-safe: the tokenizer is read-only) ----------------------------------------------
    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        return self.tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.tokenizer.token_to_piece(token_id, True).decode("utf-8", errors="replace")
