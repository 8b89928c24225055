"""A fake backend with constant step time and a tiny synchronous driver, for core tests."""

from __future__ import annotations

from engine.core import ServerConfig, ServerCore, Task, run_until_idle
from engine.core.recorder import Recorder
from engine.core.types import BatchPlan, ForwardCall, KVOp, StepResult
from policies import make_policies


class _Cells(dict):
    """seq -> number of KV cells. Assigning a count (as tests do to declare restored KV) declares cells at
    positions 0..count-1."""

    def __init__(self, backend: FakeBackend) -> None:
        super().__init__()
        self._backend = backend

    def __setitem__(self, seq: int, n: int) -> None:
        self._backend.pos[seq] = list(range(n))
        super().__setitem__(seq, n)


class FakeBackend:
    """Returns token `1000 + k` for the k-th sample of a slot unless a script says otherwise; tracks the
    positions of each sequence's KV cells (as llama.cpp's memory does: seq_rm drops a position range, seq_add
    shifts one and drops cells shifted below 0) so tests can check the ops the core emits: every forward
    chunk must extend cells at exactly positions 0..pos0-1."""

    def __init__(self, step_s: float = 0.01, tokens_for=None) -> None:
        self.step_s = step_s
        self.tokens_for = tokens_for          # callable(task, n_decoded) -> token
        self.pos: dict[int, list[int]] = {}   # seq -> sorted positions of its cells
        self.cells: dict[int, int] = _Cells(self)
        self.cache: dict[int, int] = {}       # entry id -> n_tokens
        self.plans: list[BatchPlan] = []

    def _set(self, seq: int, positions) -> None:
        self.pos[seq] = sorted(positions)
        dict.__setitem__(self.cells, seq, len(self.pos[seq]))

    def execute(self, plan: BatchPlan) -> StepResult:
        self.plans.append(plan)
        for p in plan.program:
            if isinstance(p, ForwardCall):
                for c in p.chunks:
                    have = self.pos.get(c.seq, [])
                    assert have == list(range(len(have))) and c.pos0 == len(have), (c, have)
                    self._set(c.seq, have + list(range(c.pos0, c.pos0 + len(c.tokens))))
            else:
                self._apply(p)
        sampled = {}
        for sid, task in plan.tasks.items():
            sampled[sid] = self.tokens_for(task, task.n_decoded) if self.tokens_for else 1000 + task.n_decoded
        return StepResult(self.step_s if plan.program else 0.0, sampled)

    def _apply(self, op: KVOp) -> None:
        have = self.pos.get(op.seq, [])
        p0 = 0 if op.p0 < 0 else op.p0
        p1 = float("inf") if op.p1 < 0 else op.p1
        if op.kind == "seq_rm":
            self._set(op.seq, [q for q in have if not p0 <= q < p1])
        elif op.kind == "seq_add":
            moved = [q + op.delta if p0 <= q < p1 else q for q in have]
            self._set(op.seq, [q for q in moved if q >= 0])
            assert len(set(self.pos[op.seq])) == len(self.pos[op.seq]), f"seq_add made positions collide: {op}"
        elif op.kind == "cache_save":
            assert len(have) >= op.n_tokens
            self.cache[op.entry] = op.n_tokens
        elif op.kind == "cache_load":
            assert op.entry in self.cache
            self._set(op.seq, range(self.cache[op.entry]))
            if not op.keep:
                del self.cache[op.entry]
        elif op.kind == "cache_drop":
            del self.cache[op.entry]
        elif op.kind == "seq_cp":                      # dst joins the copied cells; it must not have its own there
            copied = [q for q in have if p0 <= q < p1]
            own = self.pos.get(op.dst, [])
            assert not set(own) & set(copied), f"seq_cp onto occupied positions: {op}"
            self._set(op.dst, own + copied)
        else:
            raise AssertionError(f"unexpected KV op {op}")


def make_core(rec: Recorder | None = None, **kw) -> ServerCore:
    cfg = ServerConfig(**kw)
    return ServerCore(cfg, make_policies(cfg.policies), rec if rec is not None else Recorder())


def run(core: ServerCore, backend: FakeBackend, t0: float = 0.0, max_steps: int = 100000, on_step=None) -> float:
    """Drive the serving loop until the core has no work; returns the end time."""
    return run_until_idle(core, backend, t0, max_steps, on_step)


def task(tokens, **kw) -> Task:
    return Task(id=-1, tokens=list(tokens), **kw)
