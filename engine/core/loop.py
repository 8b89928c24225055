"""The serving loop, written once: schedule -> execute -> commit.

One iteration of llama-server's `server_context::update_slots` (tools/server/server-context.cpp): take new
tasks, build the batch, run `llama_decode` on it, sample, apply the stop checks, release finished slots.
Every driver calls `step`: the SimPy simulator (`sim/driver.py`), the HTTP engine thread
(`engine/http/engine_thread.py`), `slotlab generate`, and the test drivers. They differ only in where time
comes from, which is why the end of a step is a function (`end_s`) of what the backend reports:

- simulated or fake time: the step ends `result.elapsed_s` after it began (the default);
- wall time: the engine thread passes a reading of its clock.

A step whose backend raises is committed as a step that sampled nothing, so the core accepts the next
schedule, and `StepFailed` carries the plan to the caller. What the KV memory holds after a failed call is
unknown: the caller decides what to tell the tasks and resets the memory and the slots' tokens
(`ServerCore.set_slot_tokens`); the HTTP server fails the running tasks with a 500 and starts from empty
slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from engine.core.server import ServerCore
from engine.core.types import Backend, BatchPlan, StepResult, Task, TokenEvent

NOTHING = StepResult(0.0, {})
_tuple_new = tuple.__new__       # what an empty plan "returns": it is not sent to the backend


class Step(NamedTuple):
    """What one iteration did."""

    plan: BatchPlan
    result: StepResult
    t_start_s: float
    t_end_s: float
    tokens: list[TokenEvent]        # tokens sampled for tasks with a text hook (all, if the core streams)
    finished: list[Task]            # tasks that ended, in the order they ended (since the last pop)


class StepFailed(Exception):
    """The backend raised while executing `plan` (the cause is `__cause__`); the plan was committed empty."""

    def __init__(self, plan: BatchPlan, t_s: float) -> None:
        super().__init__(f"backend failed on a plan of {len(plan.forwards)} forward call(s)")
        self.plan = plan
        self.t_s = t_s


def step(core: ServerCore, backend: Backend, now_s: float,
         end_s: Callable[[StepResult], float] | None = None) -> Step:
    """Run one iteration at `now_s`; the commit happens at `end_s(result)` (default now_s + elapsed)."""
    plan = core.schedule(now_s)
    if plan.program:
        try:
            result = backend.execute(plan)
        except Exception as exc:
            t = now_s if end_s is None else end_s(NOTHING)
            core.commit(plan, NOTHING, t)
            raise StepFailed(plan, t) from exc
    else:
        result = NOTHING
    t_end = now_s + result.elapsed_s if end_s is None else end_s(result)
    tokens = core.commit(plan, result, t_end)
    # Step(plan, result, now_s, t_end, tokens, finished), without the NamedTuple's Python-level __new__
    return _tuple_new(Step, (plan, result, now_s, t_end, tokens, core.pop_finished()))


def run_until_idle(core: ServerCore, backend: Backend, now_s: float = 0.0, max_steps: int = 1 << 62,
                   on_step: Callable[[Step], None] | None = None) -> float:
    """Step on simulated time (each step lasts what the backend says) until the core has no work; returns
    the end time. For synchronous drivers with every task submitted up front (tests, `slotlab generate`)."""
    for _ in range(max_steps):
        if not core.has_work():
            return now_s
        st = step(core, backend, now_s)
        now_s = st.t_end_s
        if on_step is not None:
            on_step(st)
    raise RuntimeError(f"the core still has work after {max_steps} steps")
