"""A server slot (`server_slot`): one sequence of the KV cache and the task it serves."""

from __future__ import annotations

from engine.core.types import SlotState, Task


class Slot:
    """`tokens` is `slot.prompt.tokens`: what the slot's KV holds (plus tokens queued in the current batch).

    A released slot keeps its tokens: that is what makes prefix reuse possible for the next task.
    """

    __slots__ = ("id", "n_ctx", "state", "task", "tokens", "t_last_used_s", "n_past", "i_prompt",
                 "sampled", "n_tasks", "lk0", "lkc", "lkb")

    def __init__(self, id: int, n_ctx: int) -> None:
        self.id = id
        self.n_ctx = n_ctx
        self.state = SlotState.IDLE
        self.task: Task | None = None
        self.tokens: list[int] = []
        self.t_last_used_s = -1.0          # upstream starts at -1: the first task goes to the last slot
        self.n_past = 0                    # prompt tokens reused from the slot's KV for the current task
        self.i_prompt = 0                  # next prompt token to put in a batch
        self.sampled = -1                  # last sampled token (not yet in the KV)
        self.n_tasks = 0
        # lazy stretches (ServerCore.lazy_tokens): the core's lockstep step count when this GENERATING slot's
        # tokens were last written out; -1 when nothing is pending (always, unless the core is lazy)
        self.lk0 = -1
        self.lkc = 0                       # ... the lock step count at which a context shift would be due
        self.lkb = 0                       # ... and at which its first stop may come (or that shift)

    @property
    def is_processing(self) -> bool:
        return self.state != SlotState.IDLE

    def __repr__(self) -> str:
        return f"Slot(id={self.id}, state={self.state.name}, n_tokens={len(self.tokens)})"
