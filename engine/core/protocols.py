"""Policy protocols: what the serving core asks each kind of policy. Implementations live in `policies/`.

Each protocol has one job and a docstring contract; upstream llama-server behaviour is each kind's default
(see `policies/__init__.py` for the registries).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.core.slot import Slot
    from engine.core.types import CacheEntry, Task


@dataclass(frozen=True, slots=True)
class Selection:
    """A slot choice. `update_cache`: save the slot's prompt to the RAM cache and try to load a better one.

    The slot may be busy (a task that names a busy `id_slot`); the core then defers the task.
    """

    slot: "Slot"
    update_cache: bool
    reason: str           # "id_slot" | "similarity" | "lru" | policy-specific
    f_sim: float = 0.0


class SlotSelector(Protocol):
    """`get_available_slot`: choose a slot for a task, or None when no slot is idle."""

    def select(self, task: "Task", slots: Sequence["Slot"], similarity: float) -> Selection | None: ...

    # Optional: a selector whose choice never depends on a busy slot's tokens sets `busy_tokens_read = False`;
    # a simulator may then keep generating slots' tokens pending during stretches (ServerCore.lazy_tokens).


class QueueOrder(Protocol):
    """`pop_deferred_task`: which deferred task resumes when `released` frees up (index into `deferred`).

    `any_named` is False when no deferred task names a slot (id_slot), so policies can skip that scan."""

    def pick_deferred(self, deferred: Sequence["Task"], released: "Slot", any_named: bool = True) -> int: ...

    # Optional: a policy that never reads the prompts (`tokens`) of the deferred tasks sets
    # `reads_deferred_prompts = False`; a simulator may then draw a deferred task's prompt only when it
    # resumes (sim/driver.py). Without it, prompts are assumed read.


class BatchBuilder(Protocol):
    """How `pre_decode` fills a batch: decode tokens first or not, prompt-token budget, slot order."""

    def include_decodes(self, n_generating: int, n_prompt_pending: int) -> bool: ...

    def prompt_budget(self, n_batch: int, n_decode: int, cont_batching: bool) -> int: ...

    def prompt_order(self, slots: Sequence["Slot"]) -> Iterable["Slot"]: ...

    # Optional: a builder whose answers depend only on their arguments and whose prompt_order depends only on
    # slot ids (not on progress) sets `stable = True`; the core may then fast-forward stretches of prompt
    # chunks (`ServerCore.prefill_horizon`). Without it, every such step runs normally.
    # A builder whose prompt_order returns the slots as given (slot order) may set `in_slot_order = True`:
    # the core's stretches then visit only the slots with a prompt pending.


class ContextShift(Protocol):
    """What a full GENERATING slot keeps and discards: returns (n_keep, n_discard) in tokens."""

    def plan(self, n_tokens: int, n_ctx: int, n_keep: int, n_discard: int, n_prompt: int,
             add_bos: bool) -> tuple[int, int]: ...


class EvictionPolicy(Protocol):
    """Which prompt-cache entry leaves when room is needed. Stateful: one instance per cache."""

    def on_insert(self, entry: "CacheEntry", now_s: float) -> None: ...

    def on_hit(self, entry: "CacheEntry", now_s: float) -> None: ...

    def on_remove(self, entry: "CacheEntry") -> None: ...

    def victim(self, entries: Mapping[int, "CacheEntry"]) -> "CacheEntry":
        """The entry to evict; `entries` is id -> entry in insertion order (oldest first), never empty."""
        ...


@dataclass(frozen=True, slots=True)
class Policies:
    """One instance of each kind, handed to `ServerCore`."""

    slot_selector: SlotSelector
    queue_order: QueueOrder
    batch_builder: BatchBuilder
    context_shift: ContextShift
    eviction: EvictionPolicy
