"""KV cell accounting, idle-slot purge and n_batch halving.

Upstream's decode-failure fallback (`decode`, `try_clear_idle_slots` in tools/server/server-context.cpp): a
call that finds no free KV cells purges one idle slot (unified KV only) or halves n_batch and retries; at
n_batch 1 it is fatal for every processing slot. The four cases of upstream's `test_completion_unified`
(tools/server/tests/unit/test_completion.py: 4 slots sharing 256 cells, 2-token prompt) are reproduced here.
"""

import pytest

from engine.core import Recorder, step
from tests.core.fakes import FakeBackend, make_core, run, task


def unified_run(n_predicts):
    rec = Recorder()
    core = make_core(rec, n_ctx=256, n_parallel=4, kv_unified=True, cache_ram_mib=0)
    be = FakeBackend()
    tasks = [core.submit(task([1, 100 + i], n_predict=n), 0.0) for i, n in enumerate(n_predicts)]
    run(core, be)
    return tasks, rec, be


def outcome(tasks):
    return ["ok" if t.error is None and t.n_decoded == t.n_predict else "fail" for t in tasks]


def test_four_70s_exceed_256_unified_cells_and_all_fail():
    tasks, rec, _ = unified_run([70, 70, 70, 70])
    assert outcome(tasks) == ["fail"] * 4
    assert all(t.error.message == "Context size has been exceeded." and t.error.http_status == 500 for t in tasks)
    assert rec.of_kind("batch_halved")


def test_idle_slot_purge_lets_80_40_80_80_succeed():
    tasks, rec, _ = unified_run([80, 40, 80, 80])
    assert outcome(tasks) == ["ok"] * 4
    purges = rec.of_kind("purge_idle_slot")
    assert len(purges) == 1 and purges[0][2]["slot"] == tasks[1].slot_id


def test_three_90s_still_exceed_after_purge():
    tasks, _, _ = unified_run([90, 90, 40, 90])
    assert outcome(tasks) == ["fail", "fail", "ok", "fail"]


def test_90_90_40_75_all_succeed():
    tasks, _, _ = unified_run([90, 90, 40, 75])
    assert outcome(tasks) == ["ok"] * 4


def test_backend_never_holds_more_cells_than_unified_pool():
    core = make_core(n_ctx=256, n_parallel=4, kv_unified=True, cache_ram_mib=0)
    be = FakeBackend()
    for i in range(8):
        core.submit(task([1, 100 + i], n_predict=60), 0.0)
    now = 0.0
    while core.has_work():
        now = step(core, be, now).t_end_s
        assert sum(be.cells.values()) <= 256


def test_split_kv_never_purges_other_slots():
    rec = Recorder()
    core = make_core(rec, n_ctx=1024, n_parallel=4, cache_ram_mib=0)
    for i, n in enumerate([200, 40, 200, 200]):
        core.submit(task([1, 100 + i], n_predict=n), 0.0)
    run(core, FakeBackend())
    assert not rec.of_kind("purge_idle_slot") and not rec.of_kind("batch_halved")


@pytest.mark.parametrize("n_batch", [7, 64])
def test_batch_larger_than_n_batch_is_split_into_several_decode_calls(n_batch):
    core = make_core(n_ctx=4096, n_parallel=1, n_batch=n_batch)
    core.submit(task(range(100), n_predict=1), 0.0)
    # a single slot's prompt is chunked by the batch builder itself: each plan is one call of <= n_batch
    be = FakeBackend()
    sizes = []
    run(core, be, on_step=lambda st: sizes.extend(f.n_tokens for f in st.plan.forwards))
    assert max(sizes) <= n_batch and sum(sizes) == 100
