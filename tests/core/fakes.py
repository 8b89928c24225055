"""A fake backend with constant step time and a tiny synchronous driver, for core tests."""

from __future__ import annotations

from engine.core import ServerConfig, ServerCore, Task
from engine.core.recorder import Recorder
from engine.core.types import BatchPlan, ForwardCall, KVOp, StepResult
from policies import make_policies


class FakeBackend:
    """Returns token `1000 + k` for the k-th sample of a slot unless a script says otherwise; tracks KV cells
    per sequence so tests can check the ops the core emits."""

    def __init__(self, step_s: float = 0.01, tokens_for=None) -> None:
        self.step_s = step_s
        self.tokens_for = tokens_for          # callable(task, n_decoded) -> token
        self.cells: dict[int, int] = {}
        self.cache: dict[int, int] = {}       # entry id -> n_tokens
        self.plans: list[BatchPlan] = []

    def execute(self, plan: BatchPlan) -> StepResult:
        self.plans.append(plan)
        for p in plan.program:
            if isinstance(p, ForwardCall):
                for c in p.chunks:
                    assert c.pos0 == self.cells.get(c.seq, 0), (c, self.cells)
                    self.cells[c.seq] = c.pos0 + len(c.tokens)
            else:
                self._apply(p)
        sampled = {}
        for sid, task in plan.tasks.items():
            sampled[sid] = self.tokens_for(task, task.n_decoded) if self.tokens_for else 1000 + task.n_decoded
        return StepResult(self.step_s if plan.program else 0.0, sampled)

    def _apply(self, op: KVOp) -> None:
        n = self.cells.get(op.seq, 0)
        if op.kind == "seq_rm":
            p0 = 0 if op.p0 < 0 else op.p0
            p1 = n if op.p1 < 0 else op.p1
            self.cells[op.seq] = n - max(0, min(p1, n) - p0)
        elif op.kind == "cache_save":
            assert n >= op.n_tokens
            self.cache[op.entry] = op.n_tokens
        elif op.kind == "cache_load":
            assert op.entry in self.cache
            self.cells[op.seq] = self.cache[op.entry]
            if not op.keep:
                del self.cache[op.entry]
        elif op.kind == "cache_drop":
            del self.cache[op.entry]
        elif op.kind == "seq_cp":
            self.cells[op.dst] = n
        elif op.kind == "seq_add":
            pass


def make_core(rec: Recorder | None = None, **kw) -> ServerCore:
    cfg = ServerConfig(**kw)
    return ServerCore(cfg, make_policies(cfg.policies), rec if rec is not None else Recorder())


def run(core: ServerCore, backend: FakeBackend, t0: float = 0.0, max_steps: int = 100000) -> float:
    """Drive schedule/execute/commit until the core has no work; returns the end time."""
    now = t0
    for _ in range(max_steps):
        if not core.has_work():
            return now
        plan = core.schedule(now)
        res = backend.execute(plan)
        now += res.elapsed_s
        core.commit(plan, res, now)
    raise AssertionError("core did not finish")


def task(tokens, **kw) -> Task:
    return Task(id=-1, tokens=list(tokens), **kw)
