"""Server configuration with llama-server's names, flags and defaults (`common_params` in common/common.h,
`common_params_parser_init` in common/arg.cpp, start-up resolution in tools/server/server.cpp).

`ServerConfig` holds what the user asked for; `resolve()` turns it into the values the server actually runs
with (auto slots, padded context, per-slot context, effective batch sizes), as llama-server does at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.core.errors import ConfigError

CTX_PAD = 256  # GGML_PAD(n_ctx, 256) in the llama_context constructor, src/llama-context.cpp


def pad256(n: int) -> int:
    return (n + CTX_PAD - 1) // CTX_PAD * CTX_PAD


@dataclass(frozen=True, slots=True)
class PolicyNames:
    """Which policy of each kind the core uses (keys of the registries in `policies`)."""

    slot_selection: str = "lcp_lru"
    queue_order: str = "fifo"
    batch_building: str = "decode_first"
    context_shift: str = "half"
    eviction: str = "fifo"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """llama-server flags that shape scheduling. Field names follow `common_params`; defaults are upstream's.

    `n_ctx = 0` means "the model's n_ctx_train" as upstream; then `n_ctx_train` must be known.
    `kv_unified = None` means upstream's auto rule: unified iff `n_parallel` is auto (-1).
    """

    n_parallel: int = -1               # -np; -1 = auto -> 4 slots + unified KV
    n_ctx: int = 0                     # -c; 0 = n_ctx_train
    n_ctx_train: int = 0               # from the model (GGUF `context_length`); 0 = unknown
    n_batch: int = 2048                # -b
    n_ubatch: int = 512                # -ub
    cache_ram_mib: int = 8192          # -cram; -1 = no byte limit, 0 = prompt cache off
    slot_prompt_similarity: float = 0.10   # -sps; 0 disables similarity matching
    n_cache_reuse: int = 0             # --cache-reuse; 0 = off
    cache_prompt: bool = True          # per-request default of `cache_prompt`
    cont_batching: bool = True         # -cb / -nocb
    ctx_shift: bool = False            # --context-shift
    n_keep: int = 0                    # --keep; -1 = whole prompt
    cache_idle_slots: bool = True      # --cache-idle-slots
    kv_unified: bool | None = None     # -kvu / -no-kvu; None = auto
    n_predict: int = -1                # -n; per-request default, request values are not capped by it
    # Model facts the scheduler needs (the backend reports them; these defaults are SmolLM2-135M's).
    add_bos_token: bool = False        # context shift keeps BOS in addition to n_keep
    # Host-RAM cache entry size = what llama_state_seq_get_size reports for a sequence of n tokens:
    # n * kv_bytes_per_token + kv_state_header_bytes + 4 bytes per KV stream (cell count). Defaults are
    # SmolLM2-135M with llama.cpp's f16 KV: 2 (K,V) * 30 layers * 3 kv heads * 64 dims * 2 bytes = 23040,
    # plus 12 bytes of cell metadata per token; header 20 + 24 per layer.
    kv_bytes_per_token: int = 23052
    kv_state_header_bytes: int = 740
    can_shift: bool = True             # llama_memory_can_shift: false forces --cache-reuse 0 / no ctx shift
    eog_ids: frozenset[int] = frozenset()
    # slotlab extensions (not llama-server flags): policies and cache hit semantics.
    policies: PolicyNames = field(default_factory=PolicyNames)
    cache_hit: str = "move"            # "move" (upstream: a hit takes the entry out) or "copy"

    def resolve(self) -> "ResolvedConfig":
        """Validate and derive the running values, as llama-server's start-up does."""
        if self.n_parallel == 0 or self.n_parallel < -1:
            raise ConfigError(f"invalid value for n_parallel: {self.n_parallel} (use -1 for auto or a positive count)")
        auto = self.n_parallel == -1
        n_slots = 4 if auto else self.n_parallel
        unified = True if (auto and self.kv_unified is None) else bool(self.kv_unified)
        n_ctx = self.n_ctx
        if n_ctx < 0:
            raise ConfigError(f"invalid value for n_ctx: {n_ctx} (must be >= 0; 0 = the model's n_ctx_train)")
        if n_ctx == 0:
            if self.n_ctx_train <= 0:
                raise ConfigError("n_ctx is 0 (use the model's n_ctx_train) but n_ctx_train is unknown; pass -c N")
            n_ctx = self.n_ctx_train
        n_ctx = pad256(n_ctx)
        if unified:
            n_ctx_slot = n_ctx
        else:
            n_ctx_slot = pad256(n_ctx // n_slots)
            n_ctx = n_ctx_slot * n_slots
        if self.n_ctx_train > 0 and n_ctx_slot > self.n_ctx_train:
            n_ctx_slot = self.n_ctx_train  # upstream warns and caps the slot context at n_ctx_train
        for name in ("n_batch", "n_ubatch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"invalid value for {name}: {getattr(self, name)} (must be >= 1)")
        n_batch = min(n_ctx, self.n_batch)
        n_ubatch = min(n_batch, self.n_ubatch)
        if self.cache_ram_mib < -1:
            raise ConfigError(f"invalid value for cache_ram_mib: {self.cache_ram_mib} (-1 = no limit, 0 = off)")
        if not 0.0 <= self.slot_prompt_similarity <= 1.0:
            raise ConfigError(f"invalid value for slot_prompt_similarity: {self.slot_prompt_similarity} (0..1)")
        if self.n_cache_reuse < 0:
            raise ConfigError(f"invalid value for n_cache_reuse: {self.n_cache_reuse} (must be >= 0)")
        if self.n_keep < -1:
            raise ConfigError(f"invalid value for n_keep: {self.n_keep} (-1 = whole prompt, else >= 0)")
        if self.n_predict < -1:
            raise ConfigError(f"invalid value for n_predict: {self.n_predict} (-1 = unlimited, else >= 0)")
        if self.kv_bytes_per_token < 1:
            raise ConfigError(f"invalid value for kv_bytes_per_token: {self.kv_bytes_per_token} (must be >= 1)")
        if self.kv_state_header_bytes < 0:
            raise ConfigError(f"invalid value for kv_state_header_bytes: {self.kv_state_header_bytes} (>= 0)")
        if self.cache_hit not in ("move", "copy"):
            raise ConfigError(f"invalid value for cache_hit: {self.cache_hit!r} (choose 'move' or 'copy')")
        # upstream: --cache-idle-slots requires --cache-ram, disabling; --cache-reuse needs a shiftable memory
        cache_idle_slots = self.cache_idle_slots and self.cache_ram_mib != 0
        n_cache_reuse = self.n_cache_reuse if self.can_shift else 0
        ctx_shift = self.ctx_shift and self.can_shift
        return ResolvedConfig(
            base=replace(self, cache_idle_slots=cache_idle_slots, n_cache_reuse=n_cache_reuse, ctx_shift=ctx_shift),
            n_slots=n_slots, kv_unified=unified, n_ctx=n_ctx, n_ctx_slot=n_ctx_slot,
            n_batch=n_batch, n_ubatch=n_ubatch,
        )


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """The values the server runs with. `base` is the (normalised) user config."""

    base: ServerConfig
    n_slots: int
    kv_unified: bool
    n_ctx: int          # total KV cells (padded; n_ctx_slot * n_slots when not unified)
    n_ctx_slot: int     # what each slot may hold (= n_ctx when unified)
    n_batch: int        # min(n_ctx, n_batch)
    n_ubatch: int       # min(n_batch, n_ubatch)

    @property
    def cache_limit_bytes(self) -> int:
        """Host-RAM prompt-cache byte limit: 0 = no limit (upstream maps -1 to 0 here)."""
        return 1024 * 1024 * max(0, self.base.cache_ram_mib)

    def state_size_bytes(self, n_tokens: int) -> int:
        """Bytes of a saved sequence state of n_tokens (`llama_state_seq_get_size`): what a prompt-cache
        entry costs against --cache-ram. One KV stream when unified, one per slot otherwise."""
        n_stream = 1 if self.kv_unified else self.n_slots
        return n_tokens * self.base.kv_bytes_per_token + self.base.kv_state_header_bytes + 4 * n_stream

    @property
    def cache_enabled(self) -> bool:
        return self.base.cache_ram_mib != 0
