"""NumpyBackend: executes the core's BatchPlans on a loaded numpy Model and measures how long they take.

Mirrors what llama-server's `update_slots` asks of llama.cpp: KV-memory operations (`llama_memory_seq_rm`,
`seq_add`, `seq_cp`, `llama_state_seq_get/set_data` for the host-RAM prompt cache), `llama_decode` calls,
and `common_sampler_sample` for the slots whose logits are needed.

The core does the KV cell accounting (unified or not); the backend's KVStore is sized so that it never
refuses what the core admits: every sequence may hold a whole slot context (`n_ctx_slot`), and memory grows
on demand.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from engine.core.config import ResolvedConfig
from engine.core.types import BatchPlan, ForwardCall, KVOp, StepResult, Task
from engine.model import BatchChunk, Model
from engine.model.sampling import Sampler, SamplingParams

try:
    import resource
except ImportError:                                    # not a Unix: no page-fault counts
    resource = None  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class SamplingFailed:
    """`StepResult.extra` entry for a slot whose sampler raised (the token given is the argmax)."""

    message: str


def minor_faults() -> int | None:
    """The process's minor page faults so far (all its threads: `getrusage(RUSAGE_SELF).ru_minflt`), or None where
    the platform has no `resource` module. A minor fault is the kernel supplying a page on first touch; a step
    whose temporaries land in memory new to the process takes thousands (docs/validation_sim.md §16)."""
    if resource is None:                               # not a Unix
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


class NumpyBackend:
    """Applies a plan's program in order on `model`; one `Sampler` per task (seeded as llama-server does)."""

    def __init__(self, model: Model, n_seq: int, n_ctx_seq: int,
                 default_sampling: SamplingParams | None = None, resident: bool = True) -> None:
        self.model = model
        self.n_seq = n_seq
        self.n_ctx_seq = n_ctx_seq
        # resident (Model.new_kv): the cells allocated and written now, as llama.cpp's (for_server says when)
        self.kv = model.new_kv(n_seq, n_ctx_seq, unified=False, resident=resident)
        self.default_sampling = default_sampling if default_sampling is not None else SamplingParams()
        self.cache: dict[int, bytes] = {}                  # prompt-cache entry id -> sequence state bytes
        self._samplers: dict[int, tuple[Task, Sampler]] = {}   # task id -> (task, its sampler)
        tok = model.tokenizer
        self._eog = frozenset(tok.eog_ids)
        self.n_steps = 0
        self.t_total_s = 0.0
        # optional observer called after every execute as on_step(plan, elapsed_s, minor_faults) (slotlab
        # replay's step log): the step's measured seconds and the process's minor page faults during it (read
        # outside the timed region; None where unknown), which the step log records (experiments/steplog.py)
        self.on_step: Any = None

    # --- facts the server builds its ServerConfig from -----------------------------------------------------
    @classmethod
    def for_server(cls, model: Model, resolved: ResolvedConfig,
                   default_sampling: SamplingParams | None = None) -> NumpyBackend:
        """The backend of a server of `resolved`'s slots and per-slot cells. Its KV is resident (allocated and
        written at start, as llama.cpp's) unless the server is unified: then every slot gets n_ctx cells here,
        n_slots x the cells that can be in use at once, and the store stays lazy (docs/engine.md)."""
        return cls(model, resolved.n_slots, resolved.n_ctx_slot, default_sampling, resident=not resolved.kv_unified)

    @property
    def n_threads(self) -> int:
        """Compute threads of the forward passes (`Model.n_threads`: the matmul split's threads, or BLAS's own
        in threading="blas"; 0 = no BLAS library found there)."""
        return self.model.n_threads

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv.bytes_per_token

    @property
    def eog_ids(self) -> frozenset[int]:
        return self._eog

    @property
    def add_bos_token(self) -> bool:
        return bool(self.model.tokenizer.add_bos)

    @property
    def n_ctx_train(self) -> int:
        return self.model.hparams.n_ctx_train

    @property
    def n_vocab(self) -> int:
        return self.model.hparams.n_vocab

    # --- execution -------------------------------------------------------------------------------------------
    def execute(self, plan: BatchPlan) -> StepResult:
        """Run the program; sample for every slot that asked for logits; elapsed_s is measured wall time."""
        faults0 = minor_faults()
        t0 = time.perf_counter()
        rows: dict[int, np.ndarray] = {}                   # slot -> logits row [n_vocab]
        for step in plan.program:
            if isinstance(step, ForwardCall):
                chunks = [BatchChunk(c.seq, c.tokens, c.pos0, bool(c.sample_for)) for c in step.chunks]
                out = self.model.forward_batch(self.kv, chunks)
                for c, logits in zip(step.chunks, out):
                    for sid in c.sample_for:
                        rows[sid] = logits[-1]             # [n_vocab]
            else:
                self.apply(step)
        sampled: dict[int, int] = {}
        extra: dict[int, Any] = {}
        for sid, row in rows.items():
            task = plan.tasks[sid]
            try:
                sampler = self._sampler(task)
                with np.errstate(all="ignore"):
                    res = sampler.sample(row, self._penalty_window(task, sampler.params))
            except Exception as e:  # noqa: BLE001 - one request's odd sampling settings must not stop the batch
                # the slot still needs a token to stay consistent; the server fails the task with this error
                sampled[sid] = int(np.argmax(row))
                extra[sid] = SamplingFailed(f"{type(e).__name__}: {e}")
                continue
            sampled[sid] = res.token
            if res.probs is not None:
                extra[sid] = res
        elapsed = time.perf_counter() - t0
        faults1 = minor_faults()
        self.n_steps += 1
        self.t_total_s += elapsed
        if len(self._samplers) > 4 * self.n_seq:
            self._prune_samplers()
        if self.on_step is not None:
            self.on_step(plan, elapsed, None if faults0 is None or faults1 is None else faults1 - faults0)
        return StepResult(elapsed, sampled, extra or None)

    def apply(self, op: KVOp) -> None:
        """One KV operation (also used by the server to flush pending operations outside a step)."""
        kv = self.kv
        kind = op.kind
        if kind == "seq_rm":
            kv.seq_rm(op.seq, op.p0, op.p1)
        elif kind == "seq_add":
            kv.seq_add(op.seq, op.p0, op.p1, op.delta)
        elif kind == "seq_cp":
            kv.seq_cp(op.seq, op.dst, op.p0, op.p1)
        elif kind == "clear":
            kv.clear()
        elif kind == "cache_save":
            self.cache[op.entry] = kv.state_save(op.seq)
        elif kind == "cache_load":
            data = self.cache[op.entry] if op.keep else self.cache.pop(op.entry)
            kv.state_load(op.seq, data)
        elif kind == "cache_drop":
            self.cache.pop(op.entry, None)
        else:
            raise ValueError(f"unknown KV operation {kind!r}")

    def seq_state_save(self, seq: int) -> bytes:
        """One sequence's KV state as bytes (`llama_state_seq_get_data`), for slot save."""
        return self.kv.state_save(seq)

    def seq_state_load(self, seq: int, data: bytes) -> int:
        """Replace a sequence's KV with a `seq_state_save` blob (`llama_state_seq_set_data`); returns the
        number of tokens it holds. A blob that does not fit raises (ValueError or KVCacheFull) before
        anything changes."""
        self.kv.state_load(seq, data)
        return self.kv.n_tokens(seq)

    def release(self, task: Task) -> None:
        """Forget a finished task's sampler (the server calls this; stale ones are also pruned)."""
        self._samplers.pop(task.id, None)

    @property
    def cache_bytes(self) -> int:
        return sum(len(b) for b in self.cache.values())

    # --- sampling ----------------------------------------------------------------------------------------------
    def _sampler(self, task: Task) -> Sampler:
        got = self._samplers.get(task.id)
        if got is not None and got[0] is task:
            return got[1]
        params = task.sampling if isinstance(task.sampling, SamplingParams) else self.default_sampling
        if task.is_child and not params.is_random_seed:
            # upstream `add_child`: each child's seed is seed + (child index + 1), unless the seed is random
            params = replace(params, seed=(params.seed + task.child_index + 1) & 0xFFFFFFFF)
        sampler = Sampler(params, self.n_vocab, self._eog, tokenizer=self.model.tokenizer)
        self._samplers[task.id] = (task, sampler)
        return sampler

    @staticmethod
    def _penalty_window(task: Task, params: SamplingParams) -> list[int] | tuple:
        """The last `repeat_last_n` tokens of prompt + generated, only when a penalty is active."""
        n = params.repeat_last_n
        if n <= 0 or "penalties" not in params.samplers or (
                params.repeat_penalty == 1.0 and params.frequency_penalty == 0.0
                and params.presence_penalty == 0.0):
            return ()
        gen = task.generated
        if len(gen) >= n:
            return gen[-n:]
        return task.tokens[-(n - len(gen)):] + gen

    def _prune_samplers(self) -> None:
        for tid in [tid for tid, (t, _) in self._samplers.items() if t.done]:
            del self._samplers[tid]
