"""Pluggable scheduling policies: one registry dict per kind; upstream llama-server is each kind's default.

Configs name policies by registry key (`PolicyNames` in engine.core.config); `make_policies` builds fresh
instances (some policies keep state, e.g. round robin's cursor or GDSF's clock).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.core.config import PolicyNames
from engine.core.protocols import Policies
from policies import batch_building, context_shift, eviction, queue_order, slot_selection

SLOT_SELECTORS: dict[str, Callable[[], Any]] = {
    "lcp_lru": slot_selection.LcpLru,          # upstream
    "lru": slot_selection.LruOnly,
    "round_robin": slot_selection.RoundRobin,
    "session": slot_selection.SessionAffinity,
}
QUEUE_ORDERS: dict[str, Callable[[], Any]] = {
    "fifo": queue_order.Fifo,                  # upstream
    "shortest_prompt": queue_order.ShortestPromptFirst,
    "most_cached": queue_order.MostCachedFirst,
}
BATCH_BUILDERS: dict[str, Callable[[], Any]] = {
    "decode_first": batch_building.DecodeFirst,  # upstream
    "prefill_first": batch_building.PrefillFirst,
    "token_budget": batch_building.TokenBudget,
}
CONTEXT_SHIFTS: dict[str, Callable[[], Any]] = {
    "half": context_shift.Half,                # upstream
    "sink_window": context_shift.SinkWindow,
}
EVICTIONS: dict[str, Callable[[], Any]] = {
    "fifo": eviction.Fifo,                     # upstream
    "lru": eviction.Lru,
    "lfu": eviction.Lfu,
    "gdsf": eviction.Gdsf,
    "largest": eviction.LargestFirst,
    "slru": eviction.Slru,                     # slru:F = protected share of bytes (default 0.8)
    "clock": eviction.Clock,
    "belady": eviction.Belady,                 # offline oracle: the simulator binds the future requests
}

REGISTRIES = {
    "slot_selection": SLOT_SELECTORS,
    "queue_order": QUEUE_ORDERS,
    "batch_building": BATCH_BUILDERS,
    "context_shift": CONTEXT_SHIFTS,
    "eviction": EVICTIONS,
}


def _make(kind: str, name: str) -> Any:
    """Instantiate policy `name` of `kind`; `name:ARG` passes one numeric argument (e.g. token_budget:512)."""
    registry = REGISTRIES[kind]
    key, _, arg = name.partition(":")
    if key not in registry:
        raise ValueError(f"unknown {kind} policy {name!r}; choose one of: {', '.join(registry)}")
    if not arg:
        return registry[key]()
    try:
        value: Any = int(arg)
    except ValueError:
        try:
            value = float(arg)
        except ValueError:
            raise ValueError(f"{kind} policy {name!r}: argument {arg!r} is not a number") from None
    return registry[key](value)


def make_policies(names: PolicyNames | None = None) -> Policies:
    names = names or PolicyNames()
    return Policies(
        slot_selector=_make("slot_selection", names.slot_selection),
        queue_order=_make("queue_order", names.queue_order),
        batch_builder=_make("batch_building", names.batch_building),
        context_shift=_make("context_shift", names.context_shift),
        eviction=_make("eviction", names.eviction),
    )
