"""Batch-building policies (`pre_decode` of update_slots)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.core.slot import Slot


class DecodeFirst:
    """Upstream continuous batching: one decode token per generating slot, then prompt chunks in slot order
    until n_batch. Without cont_batching, prompt tokens are added only to an empty batch."""

    stable = True                    # see engine.core.protocols.BatchBuilder
    in_slot_order = True             # (prompt_order below)

    def include_decodes(self, n_generating: int, n_prompt_pending: int) -> bool:
        return True

    def prompt_budget(self, n_batch: int, n_decode: int, cont_batching: bool) -> int:
        if not cont_batching and n_decode > 0:
            return 0
        return n_batch - n_decode

    def prompt_order(self, slots: Sequence[Slot]) -> Iterable[Slot]:
        return slots


class PrefillFirst:
    """vLLM v0 style: while any prompt is pending, batches carry only prompt tokens (decodes pause)."""

    stable = True                    # see engine.core.protocols.BatchBuilder
    in_slot_order = True             # (prompt_order below)

    def include_decodes(self, n_generating: int, n_prompt_pending: int) -> bool:
        return n_prompt_pending == 0

    def prompt_budget(self, n_batch: int, n_decode: int, cont_batching: bool) -> int:
        return n_batch - n_decode

    def prompt_order(self, slots: Sequence[Slot]) -> Iterable[Slot]:
        return slots


class TokenBudget:
    """Sarathi-Serve style chunked prefill: decodes first, and the whole batch is capped at `budget` tokens,
    so long prompts are cut into chunks that piggyback on decode steps with a bounded step time."""

    stable = True                    # see engine.core.protocols.BatchBuilder
    in_slot_order = True             # (prompt_order below)

    def __init__(self, budget: int = 256) -> None:
        if budget < 1:
            raise ValueError(f"token budget must be >= 1, got {budget}")
        self.budget = budget

    def include_decodes(self, n_generating: int, n_prompt_pending: int) -> bool:
        return True

    def prompt_budget(self, n_batch: int, n_decode: int, cont_batching: bool) -> int:
        if not cont_batching and n_decode > 0:
            return 0
        return max(0, min(n_batch, self.budget) - n_decode)

    def prompt_order(self, slots: Sequence[Slot]) -> Iterable[Slot]:
        return slots
