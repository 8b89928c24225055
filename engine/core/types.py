"""Records the serving core works with: tasks, slot states, batch plans, KV operations and step results.

Mirrors `server_task`, `server_slot` states and `llama_batch` of llama-server; plans and results are
frozen so a backend cannot change what the core decided.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple, Protocol

from engine.core.errors import ErrorType


class SlotState(IntEnum):
    """`slot_state` of tools/server/server-context.cpp."""

    IDLE = 0
    STARTED = 1
    PROCESSING_PROMPT = 2
    DONE_PROMPT = 3
    GENERATING = 4
    WAIT_OTHER = 5


STOP_NONE, STOP_EOS, STOP_WORD, STOP_LIMIT = "none", "eos", "word", "limit"


class TextHook(Protocol):
    """Text-level stop processing attached to a task by the front end (engine/http).

    `push(token)` is called for every generated token in `process_token` order (first); it returns the
    matched stop word (or None) and what the front end wants delivered with this token (the text it
    released, say), which the core hands back untouched in the step's `TokenEvent`s. The core stays free of
    text: it only acts on the verdict.
    """

    def push(self, token: int) -> tuple[str | None, Any]: ...


class TokenEvent(NamedTuple):
    """One sampled token of a task, as a step reports it; `out` is the task's text hook output (or None)."""

    task: "Task"
    token: int
    out: Any = None


@dataclass(slots=True)
class TaskError:
    type: ErrorType
    message: str
    extra: dict[str, Any] = field(default_factory=dict)   # e.g. n_prompt_tokens / n_ctx for exceed-context

    @property
    def http_status(self) -> int:
        return self.type.http_status


@dataclass(slots=True, eq=False)
class Task:
    """One completion request (`server_task`) and what happened to it.

    Request fields use llama-server's names; `None` means "the server default" as a JSON null does upstream.
    """

    id: int
    tokens: list[int]
    n_predict: int | None = None
    id_slot: int = -1
    cache_prompt: bool | None = None
    n_keep: int | None = None
    n_discard: int = 0
    n_cache_reuse: int | None = None
    ignore_eos: bool = False
    n_cmpl: int = 1
    sampling: Any = None             # opaque to the core; the backend's sampler reads it
    text_hook: TextHook | None = None
    user: Any = None                 # anything the driver wants to carry (session, trace row, ...)
    # --- filled in by the core ---
    id_parent: int = -1
    child_index: int = -1            # 0-based index among the parent's children
    children: list["Task"] = field(default_factory=list)
    t_submit_s: float = 0.0
    t_launch_s: float = -1.0         # slot assigned
    t_start_s: float = -1.0          # prompt processing started (stats.t_start)
    t_prompt_last_s: float = -1.0    # first token sampled
    t_gen_last_s: float = -1.0       # last token sampled
    t_end_s: float = -1.0
    slot_id: int = -1                # slot that served it
    n_prompt_cached: int = 0         # timings.cache_n
    n_prompt_processed: int = 0      # timings.prompt_n
    generated: list[int] = field(default_factory=list)
    stop_type: str = STOP_NONE
    stopping_word: str = ""
    truncated: bool = False
    n_tokens_cached: int = 0         # slot.prompt.n_tokens() at the end = n_prompt + n_gen - 1
    n_deferred: int = 0              # how many times it went to the deferred queue
    n_predict_max: int = -1          # the budget in force (request n_predict, else the server's; -1 = none)
    error: TaskError | None = None
    done: bool = False
    cancelled: bool = False

    @property
    def is_parent(self) -> bool:
        return self.n_cmpl > 1 and self.id_parent == -1

    @property
    def is_child(self) -> bool:
        return self.id_parent != -1

    @property
    def n_decoded(self) -> int:
        return len(self.generated)


# --- plans: what the core asks a backend to do, in order ---------------------------------------------
# KVOp, Chunk and ForwardCall are NamedTuples rather than frozen dataclasses: immutable all the same, and
# several times cheaper to build (one Chunk per slot per step is on the simulator's hot path).

class KVOp(NamedTuple):
    """One KV-memory operation; positions follow llama.cpp (p1 = -1 means "to the end", p0 = -1 "from 0").

    kinds: seq_rm(seq, p0, p1) | seq_add(seq, p0, p1, delta) | seq_cp(seq -> dst, p0, p1) | clear |
           cache_save(seq -> entry, n_tokens) | cache_load(entry -> seq, keep) | cache_drop(entry)
    """

    kind: str
    seq: int = -1
    p0: int = -1
    p1: int = -1
    delta: int = 0
    dst: int = -1
    entry: int = -1
    n_tokens: int = 0
    keep: bool = False


class Chunk(NamedTuple):
    """Consecutive tokens of one slot in a forward call, at positions pos0 .. pos0+len-1.

    `sample_for` lists the slots that sample from the logits of the chunk's last token (the slot itself,
    plus n_cmpl children that share its prompt); empty = no logits needed.
    """

    seq: int
    task_id: int
    tokens: tuple[int, ...] | list[int]
    pos0: int
    sample_for: tuple[int, ...] = ()
    is_prompt: bool = True


class ForwardCall(NamedTuple):
    """One `llama_decode` call (a view of the batch of at most n_batch tokens)."""

    chunks: tuple[Chunk, ...]
    n_tokens: int


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """What one `update_slots` iteration asks of the backend: KV operations and forward calls, in order."""

    t_s: float
    program: tuple[KVOp | ForwardCall, ...]
    n_prompt_tokens: int
    n_decode_tokens: int
    tasks: dict[int, Task]            # slot id -> task, for slots that sample in this plan

    @property
    def sampling(self) -> dict[int, Any]:
        """Slot id -> the task's sampling params, for the slots that sample (built on demand from `tasks`)."""
        return {sid: t.sampling for sid, t in self.tasks.items()}

    @property
    def forwards(self) -> tuple[ForwardCall, ...]:
        return tuple(p for p in self.program if isinstance(p, ForwardCall))

    @property
    def is_empty(self) -> bool:
        return not self.program


@dataclass(frozen=True, slots=True)
class StepResult:
    """What the backend did: sampled token per sampling slot, and how long it took (predicted or measured)."""

    elapsed_s: float
    sampled: dict[int, int]           # slot id -> token
    extra: dict[int, Any] | None = None   # slot id -> backend data for the front end (e.g. token probabilities)


class Backend(Protocol):
    """An execution backend: applies a plan's KV operations and forward calls in order."""

    def execute(self, plan: BatchPlan) -> StepResult: ...


@dataclass(slots=True, eq=False)
class CacheEntry:
    """One host-RAM prompt-cache entry (`server_prompt` in `server_prompt_cache`): a saved sequence state."""

    id: int
    tokens: list[int]
    size_bytes: int
    t_insert_s: float
    t_used_s: float
    n_hits: int = 0
    priority: float = 0.0      # free for policies (e.g. GDSF's H value)
    seq: int = field(default=0)  # insertion sequence number (ties)
