"""The one serving loop (`engine.core.loop`): timing of a step, empty plans, a failing backend."""

from __future__ import annotations

import pytest

from engine.core import StepFailed, run_until_idle, step
from tests.core.fakes import FakeBackend, make_core, task


def test_a_step_ends_elapsed_after_it_starts_unless_the_driver_reads_a_clock():
    core = make_core(n_ctx=1024, n_parallel=1)
    t = core.submit(task(range(5), n_predict=2), 0.0)
    be = FakeBackend(step_s=0.25)
    st = step(core, be, 1.0)
    assert (st.t_start_s, st.t_end_s) == (1.0, 1.25) and st.plan.forwards
    assert t.t_prompt_last_s == 1.25                       # the first token is committed at the step's end
    st = step(core, be, 2.0, end_s=lambda r: 7.5)
    assert st.t_end_s == 7.5 and st.finished == [t] and t.t_end_s == 7.5


def test_an_empty_plan_is_not_sent_to_the_backend():
    core = make_core(n_ctx=1024, n_parallel=1)
    be = FakeBackend()
    st = step(core, be, 0.0)
    assert not st.plan.program and be.plans == [] and st.t_end_s == 0.0


def test_a_failing_backend_leaves_the_core_consistent():
    class Broken(FakeBackend):
        def execute(self, plan):
            raise MemoryError("out of memory")

    core = make_core(n_ctx=1024, n_parallel=1)
    t = core.submit(task(range(5), n_predict=2), 0.0)
    with pytest.raises(StepFailed) as err:
        step(core, Broken(), 0.0, end_s=lambda r: 3.0)
    assert isinstance(err.value.__cause__, MemoryError) and err.value.plan.forwards and err.value.t_s == 3.0
    assert t.generated == []                              # nothing was sampled
    core.cancel(t, 3.0)                                   # the caller fails the task and resets the KV
    core.set_slot_tokens(0, [])
    u = core.submit(task(range(5), n_predict=1), 3.0)
    run_until_idle(core, FakeBackend(), 3.0)
    assert u.done and u.error is None and len(u.generated) == 1


def test_run_until_idle_gives_up_after_max_steps():
    core = make_core(n_ctx=1024, n_parallel=1)
    core.submit(task(range(5), n_predict=50), 0.0)
    with pytest.raises(RuntimeError, match="still has work after 3 steps"):
        run_until_idle(core, FakeBackend(), 0.0, max_steps=3)
