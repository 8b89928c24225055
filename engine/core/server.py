"""The serving core: llama-server's task queue, slots, prompt reuse, RAM prompt cache and batch building.

Mirrors `server_context` (`process_single_task`, `get_available_slot`, `update_slots`/`pre_decode`,
`decode`, `process_token`, `release`). Time is injected: every entry point takes `now_s`. The core never
touches KV memory: it emits KV operations and forward calls in a `BatchPlan`; a backend executes them.

Loop (`engine.core.loop.step`, the one place it is written): ``plan = core.schedule(now);
result = backend.execute(plan); tokens = core.commit(plan, result, now + dt)``.

Deliberate differences from upstream (also in docs/core.md):
- A task naming a busy slot is deferred *without* the prompt-cache save/load upstream runs on that busy
  slot first: upstream's `get_available_slot` (tools/server/server-context.cpp) returns the named slot even
  while it is processing, computes f_keep 0 and saves/loads its prompt before `process_single_task` defers
  the task; saving/loading a running slot would corrupt it (a latent upstream bug, read from the source).
- KV cell accounting is done here (the core knows every slot's tokens), so "KV full", idle-slot purges and
  n_batch halving happen identically in simulation and on the real engine. In unified mode the cells an
  n_cmpl child copies from its parent stay shared (as llama.cpp's seq_cp shares cells) until either side
  drops them.
- Within one step, a slot released by an earlier view of a split batch is not purgeable until the next step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from operator import attrgetter
from typing import Any

from engine.core.config import ResolvedConfig, ServerConfig
from engine.core.errors import ErrorType
from engine.core.kv_cells import KVCells
from engine.core.metrics import Metrics
from engine.core.prompt_cache import CacheLoadFailed, PromptCache
from engine.core.protocols import Policies
from engine.core.recorder import NullRecorder, Recorder
from engine.core.slot import Slot
from engine.core.tokens import common_prefix, token_array
from engine.core.types import (
    STOP_EOS, STOP_LIMIT, STOP_WORD, BatchPlan, Chunk, ForwardCall, KVOp, SlotState, StepResult, Task, TaskError,
    TokenEvent,
)

IDLE, STARTED, PROCESSING_PROMPT, DONE_PROMPT, GENERATING, WAIT_OTHER = (
    SlotState.IDLE, SlotState.STARTED, SlotState.PROCESSING_PROMPT, SlotState.DONE_PROMPT,
    SlotState.GENERATING, SlotState.WAIT_OTHER)

MSG_CTX_EXCEEDED = "Context size has been exceeded."
_tuple_new = tuple.__new__      # builds a NamedTuple from a full field tuple without its Python-level __new__
_slot_id = attrgetter("id")


class Admission:
    """A stretch `ServerCore.admission_horizon` found: its first step runs `chunks` ((slot, pos0, take) in
    prompt order, after the KV operations `ops`) with a decode token of each slot of `gen`; the slots of
    `done` finish their prompts in it and sample; the k - 1 steps after it decode every slot of `dec`
    (gen and done, in slot order) and, when `q` is not None, add a chunk of `q_take` tokens of q's prompt.
    `gen_ctx`: Σ len(tokens) over `gen` before the first step (its decode tokens' positions)."""

    __slots__ = ("k", "gen", "chunks", "done", "dec", "q", "q_take", "ops", "gen_ctx")

    def __init__(self, k: int, gen: list[Slot], chunks: list[tuple[Slot, int, int]], done: list[Slot],
                 dec: list[Slot], q: Slot | None, q_take: int, ops: list, gen_ctx: int = 0) -> None:
        self.k, self.gen, self.chunks, self.done, self.dec, self.q, self.q_take, self.ops, self.gen_ctx = (
            k, gen, chunks, done, dec, q, q_take, ops, gen_ctx)


class ServerCore:
    """One llama-server scheduling state machine. Not thread-safe: one thread (or one SimPy process) drives it.

    `stream_tokens`: every sampled token is reported in `commit`'s events (tokens of tasks with a text hook
    always are, with the hook's output). `token_arrays`: the core keeps every token sequence (task prompts
    and generated tokens, slot tokens, prompt-cache entries) as `array('i')` instead of `list`
    (engine/core/tokens.py); submitted prompts are converted to it, and the decisions are the same either way."""

    def __init__(self, config: ServerConfig | ResolvedConfig, policies: Policies,
                 recorder: Recorder | None = None, stream_tokens: bool = False, token_arrays: bool = False) -> None:
        self.cfg = config.resolve() if isinstance(config, ServerConfig) else config
        self.base = self.cfg.base
        self.policies = policies
        self.rec = recorder if recorder is not None else NullRecorder()
        self.stream_tokens = stream_tokens
        self.slots = [Slot(i, self.cfg.n_ctx_slot) for i in range(self.cfg.n_slots)]
        # the token container: its type, and a function making a new one (a copy of an iterable)
        self._tok_type, self._tokens = (type(token_array()), token_array) if token_arrays else (list, list)
        for s in self.slots:
            s.tokens = self._tokens()
        self.queue: deque[Task] = deque()          # queue_tasks (new + resumed tasks)
        self.deferred: list[Task] = []             # queue_tasks_deferred
        self.metrics = Metrics()
        self.finished: list[Task] = []             # drained by pop_finished()
        self._events: list[TokenEvent] = []        # this commit's tokens (returned by commit)
        self._ops: list[KVOp | ForwardCall] = []   # KV ops decided outside a batch (launch, cache, cancel)
        self._next_task_id = 0
        self._n_busy = 0                           # slots not IDLE
        self._n_parents_busy = 0                   # slots serving an n_cmpl parent
        self._n_named_deferred = 0                 # deferred tasks that name a slot (id_slot >= 0)
        self._eog = self.base.eog_ids
        # per slot: id of a cache entry known to contain its current tokens (skips alloc's O(entries) scan)
        self._saved_in: list[int] = [-1] * len(self.slots)
        self._self_only = [(i,) for i in range(len(self.slots))]   # a decode chunk's sample_for, per slot
        self.kv = KVCells(self.slots, self.cfg.kv_unified, self.cfg.n_ctx, self.cfg.n_ctx_slot)
        # lazy stretches (lazy_tokens): generating slots advance in lock step and write out their tokens only
        # when something reads them; a member slot s has _lk - s.lk0 generated tokens pending
        self._lz: Any = None                       # fn(task, n0, k): the task's tokens at generated positions n0..
        self._lk = 0                               # lockstep steps applied so far
        self._lz_n = 0                             # member slots (lk0 >= 0)
        self._lz_s0 = 0                            # Σ lk0 over them
        self._lz_len = 0                           # Σ len(tokens) over them (written-out tokens)
        self._lz_t = 0.0                           # the end of the last lazy stretch (the members' t_gen_last_s)
        self._c_join: list[Slot] = []              # the last census: generating slots not yet members
        self._c_stop: list[Slot] = []              # ... the generating slots whose stop bound is k
        self._c_kstop = 0                          # ... that k
        self._c_pend: list[Slot] = []              # ... the slots with a prompt pending
        self.gen_ctx = 0                           # ... Σ len(tokens) over the generating slots
        self._launched: list[Slot] = []            # slots launched since the last commit or stretch
        self.cache: PromptCache | None = None
        if self.cfg.cache_enabled:
            self.cache = PromptCache(self.cfg.cache_limit_bytes, self.cfg.n_ctx, policies.eviction,
                                     self.base.cache_hit, self.rec, self._emit_cache_drop)

    # ------------------------------------------------------------------ public API
    def submit(self, task: Task, now_s: float) -> Task:
        """Post a completion task (`queue_tasks.post`). n_cmpl > 1 creates child tasks sharing its prompt."""
        if type(task.tokens) is not self._tok_type:
            task.tokens = self._tokens(task.tokens)
        task.id = self._new_id()
        task.t_submit_s = now_s
        if task.n_cmpl > 1 and not task.children:
            if task.n_cmpl > len(self.slots):
                raise ValueError(f"Field 'n_cmpl': Value must be between 1 and {len(self.slots)}")
            for i in range(task.n_cmpl - 1):
                child = Task(id=self._new_id(), tokens=task.tokens, n_predict=task.n_predict, id_slot=-1,
                             cache_prompt=task.cache_prompt, n_keep=task.n_keep, n_discard=task.n_discard,
                             n_cache_reuse=task.n_cache_reuse, ignore_eos=task.ignore_eos, n_cmpl=task.n_cmpl,
                             sampling=task.sampling, user=task.user, id_parent=task.id, child_index=i,
                             t_submit_s=now_s)
                task.children.append(child)
        self.queue.append(task)
        if self.rec.enabled:
            self.rec.record(now_s, "submit", task=task.id, n_tokens=len(task.tokens), id_slot=task.id_slot)
        return task

    def cancel(self, task: Task, now_s: float) -> None:
        """Remove a task (and its children) from every queue and release its slot (`SERVER_TASK_TYPE_CANCEL`)."""
        self.sync()
        targets = [task, *task.children]
        ids = {t.id for t in targets}
        self.queue = deque(t for t in self.queue if t.id not in ids)
        self.deferred = [t for t in self.deferred if t.id not in ids]
        self._n_named_deferred = sum(1 for t in self.deferred if t.id_slot >= 0)
        for t in targets:
            t.cancelled = True
        for s in self.slots:
            if s.task is not None and s.task.id in ids:
                self._release(s, now_s)
        for t in targets:
            if not t.done:
                self._finish_unslotted(t, now_s)
        self.rec.record(now_s, "cancel", task=task.id)

    def lazy_tokens(self, fn: Any) -> None:
        """Lazy stretches: from now on `fast_forward(gen, None, ...)` applies a decode or admission stretch's
        tokens as a pending count per generating slot instead of appending them (a stretch then touches only
        the slots that may stop); `fn(task, n0, k)` gives the task's k sampled tokens from generated position
        n0 on (a pure function of the task and the position, as a simulator's stand-in tokens are), and is
        called when something reads a slot's tokens: a release, `schedule`, `cancel`, `prefill_horizon`,
        `slots_of`, `sync`. `None` writes everything out and turns it off. Only for a front end whose tokens
        contain no EOG, with no recorder, no streaming and a slot selector that reads no busy slot's tokens
        (`busy_tokens_read = False`)."""
        self.sync()
        self._lz = fn
        self.kv.pending = None if fn is None else self._lz_pending

    def _lz_pending(self) -> int:
        return self._lz_n * self._lk - self._lz_s0

    def sync(self) -> None:
        """Write out every slot's pending stand-in tokens (lazy stretches)."""
        if self._lz_n:
            for s in self.slots:
                if s.lk0 >= 0:
                    self._materialize(s)

    def _materialize(self, s: Slot) -> None:
        """Write out a member slot's pending tokens as the decode steps would have appended them, and leave
        the lock step (it joins again at its next stretch)."""
        lk0 = s.lk0
        s.lk0 = -1
        self._lz_n -= 1
        self._lz_s0 -= lk0
        toks = s.tokens
        self._lz_len -= len(toks)
        p = self._lk - lk0
        if p:
            task = s.task
            gen_t = task.generated
            new = self._lz(task, len(gen_t), p)
            toks.append(s.sampled)
            toks.extend(new)
            s.sampled = toks.pop()           # the last sampled token is not in the KV yet
            gen_t.extend(new)
            task.t_gen_last_s = self._lz_t
            if len(toks) > self.metrics.n_tokens_max:
                self.metrics.n_tokens_max = len(toks)

    def slot_len(self, s: Slot) -> int:
        """len(s.tokens) with its pending tokens (lazy stretches)."""
        return len(s.tokens) if s.lk0 < 0 else len(s.tokens) + self._lk - s.lk0

    def has_work(self) -> bool:
        return bool(self.queue) or self._n_busy > 0

    def pop_finished(self) -> list[Task]:
        out, self.finished = self.finished, []
        return out

    def take_pending_ops(self) -> list[KVOp]:
        """KV operations decided outside a step (releases, cancels, cache drops) that would lead the next
        plan. A front end that reads or replaces a slot's KV between steps (slot save/restore) applies them
        first; they are then not repeated in the next plan."""
        if self._uncommitted is not None:
            raise RuntimeError("take_pending_ops() between schedule() and commit()")
        ops, self._ops = self._ops, []
        return ops

    def set_slot_tokens(self, slot_id: int, tokens: list[int]) -> None:
        """Declare that an idle slot's KV now holds `tokens` (slot restore / erase done by the front end)."""
        s = self.slots[slot_id]
        if s.is_processing:
            raise RuntimeError(f"slot {slot_id} is processing; its tokens can change only when idle")
        self.kv.truncated(slot_id, 0)
        self._saved_in[slot_id] = -1
        s.tokens = self._tokens(tokens)
        self._launched.append(s)       # its tokens count towards n_tokens_max at the next commit

    def kv_cells_used(self) -> int:
        """KV cells in use: every slot's tokens, counting cells shared by seq_cp once (unified KV)."""
        return self.kv.used()

    @property
    def n_processing(self) -> int:
        return self._n_busy

    # ------------------------------------------------------------------ schedule
    def schedule(self, now_s: float) -> BatchPlan:
        """`process_new_tasks` then `update_slots`/`pre_decode`: returns what the backend must run now.

        Every plan with forward calls must be executed and passed to `commit` before the next schedule.
        """
        if self._uncommitted is not None:
            raise RuntimeError("schedule() called before commit() of the previous plan")
        if self._lz_n:
            self.sync()
        while self.queue:
            self._process_single_task(self.queue.popleft(), now_s)
        return self._build_batch(now_s)

    def _process_single_task(self, task: Task, now_s: float) -> None:
        if task.cancelled or task.done:
            return
        if self._n_busy == len(self.slots):
            # no idle slot: whatever a selector returns (None, or a busy named slot) the task is deferred
            self._defer(task, now_s, "slot busy" if task.id_slot >= 0 else "no idle slot")
            return
        sel = self.policies.slot_selector.select(task, self.slots, self.base.slot_prompt_similarity)
        if sel is None or sel.slot.is_processing:
            self._defer(task, now_s, "no idle slot" if sel is None else "slot busy")
            return
        slot = sel.slot
        if self.rec.enabled:
            self.rec.record(now_s, "select", task=task.id, slot=slot.id, reason=sel.reason,
                            f_sim=round(sel.f_sim, 6), update_cache=sel.update_cache)
        if sel.update_cache and self.cache is not None:
            self._prompt_save(slot, now_s)
            if not self._prompt_load(slot, task.tokens, now_s):
                self._prompt_clear(slot)
            self.cache.update(now_s)
        if task.is_parent:
            children = [s for s in self.slots if not s.is_processing and s is not slot][:len(task.children)]
            if len(children) < len(task.children):
                self._defer(task, now_s, "not enough idle slots for n_cmpl")
                return
            for child_task, cs in zip(task.children, children):
                self._launch(cs, child_task, now_s, WAIT_OTHER)
        self._launch(slot, task, now_s, STARTED)
        if self.base.cache_idle_slots and self.cache is not None and self._n_busy < len(self.slots):
            for s in self.slots:
                if s.state:                         # not IDLE
                    continue
                if self._prompt_save(s, now_s):     # (skips empty slots and slots already saved)
                    self.cache.update(now_s)
                if self.cfg.kv_unified:
                    self._prompt_clear(s)

    def _defer(self, task: Task, now_s: float, why: str) -> None:
        task.n_deferred += 1
        self.metrics.n_deferrals += 1
        self.deferred.append(task)
        if task.id_slot >= 0:
            self._n_named_deferred += 1
        if self.rec.enabled:
            self.rec.record(now_s, "defer", task=task.id, why=why, n_deferred=len(self.deferred))

    def _launch(self, slot: Slot, task: Task, now_s: float, state: SlotState) -> None:
        self._launched.append(slot)
        slot.task = task
        slot.state = state
        self._n_busy += 1
        if task.is_parent:
            self._n_parents_busy += 1
        slot.n_past = 0
        slot.i_prompt = 0
        slot.n_tasks += 1
        if type(task.generated) is not self._tok_type:
            task.generated = self._tokens(task.generated)
        task.slot_id = slot.id
        npr = task.n_predict
        task.n_predict_max = self.base.n_predict if npr is None or npr == -1 else npr
        task.t_launch_s = now_s
        if self.rec.enabled:
            self.rec.record(now_s, "launch", task=task.id, slot=slot.id, state=state.name)

    # --- RAM prompt cache (slot.prompt_save / prompt_load / prompt_clear) ---------------------------
    def _emit_cache_drop(self, entry_id: int) -> None:
        # KVOp("cache_drop", entry=entry_id), built from its full field tuple (see _tuple_new)
        self._ops.append(_tuple_new(KVOp, ("cache_drop", -1, -1, -1, 0, -1, entry_id, 0, False)))

    def _prompt_save(self, slot: Slot, now_s: float) -> bool:
        if not slot.tokens:
            return False
        known = self._saved_in[slot.id]
        if known >= 0 and known in self.cache.entries:   # unchanged tokens, containing entry still cached
            return False
        n = len(slot.tokens)
        entry = self.cache.alloc(slot.tokens, self.cfg.state_size_bytes(n), now_s)
        if entry is None:
            return False
        self._saved_in[slot.id] = entry.id
        # KVOp("cache_save", seq=slot.id, entry=entry.id, n_tokens=n)
        self._ops.append(_tuple_new(KVOp, ("cache_save", slot.id, -1, -1, 0, -1, entry.id, n, False)))
        if self.rec.enabled:
            self.rec.record(now_s, "cache_save", slot=slot.id, entry=entry.id, n_tokens=n,
                            cache_bytes=self.cache.size_bytes(), n_entries=len(self.cache))
        return True

    def _prompt_load(self, slot: Slot, tokens: list[int], now_s: float) -> bool:
        can_restore = None
        if self.cfg.kv_unified:
            free = self.kv.room_to_restore(slot)
            can_restore = lambda e: len(e.tokens) <= free  # noqa: E731
        try:
            entry = self.cache.load(slot.tokens, tokens, now_s, can_restore)
        except CacheLoadFailed:
            return False
        if entry is not None:
            keep = self.base.cache_hit == "copy"
            self._ops.append(KVOp("cache_load", seq=slot.id, entry=entry.id, n_tokens=len(entry.tokens), keep=keep))
            self.kv.truncated(slot.id, 0)
            slot.tokens = entry.tokens[:]
            self._saved_in[slot.id] = entry.id if keep else -1
        return True

    def _prompt_clear(self, slot: Slot) -> None:
        if slot.tokens:
            self._ops.append(KVOp("seq_rm", seq=slot.id, p0=-1, p1=-1))
            slot.tokens = self._tokens()
            self.kv.truncated(slot.id, 0)
        self._saved_in[slot.id] = -1

    # ------------------------------------------------------------------ batch building (pre_decode)
    def _build_batch(self, now_s: float) -> BatchPlan:
        slots = self.slots
        ops = self._ops   # ops emitted while building (releases, purges, cache drops) land in program order
        self._ops = ops
        if not self._n_busy:
            self._ops = []
            return BatchPlan(now_s, tuple(ops), 0, 0, {})
        n_ctx = self.cfg.n_ctx_slot
        chunks: list[Chunk] = []
        tasks: dict[int, Task] = {}
        # 1. context shift of full generating slots (each slot on its own, so one pass does 1. and the census)
        gen = []
        n_prompt_pending = 0
        n_gen_max = -1             # the longest generating slot's tokens (before its decode token)
        n_rest = 0                 # the longest tokens of the other slots (an upper bound after this pass)
        for s in slots:
            st = s.state
            if st == GENERATING:
                n = len(s.tokens)
                if n + 1 >= n_ctx:
                    self._context_shift(s, ops, now_s)
                    n = len(s.tokens)
                    if s.state != GENERATING:
                        if n > n_rest:
                            n_rest = n
                        continue
                if n > n_gen_max:
                    n_gen_max = n
                gen.append(s)
            else:
                if st == STARTED or st == PROCESSING_PROMPT:
                    n_prompt_pending += 1
                if len(s.tokens) > n_rest:
                    n_rest = len(s.tokens)
        # 2. one decode token per generating slot
        n_decode = 0
        if gen and self.policies.batch_builder.include_decodes(len(gen), n_prompt_pending):
            self_only = self._self_only
            append = chunks.append
            for s in gen:
                toks = s.tokens
                sid = s.id
                task = s.task
                tok = s.sampled
                append(_tuple_new(Chunk, (sid, task.id, (tok,), len(toks), self_only[sid], False)))
                toks.append(tok)
                tasks[sid] = task
            n_decode = len(gen)
            n_gen_max += 1
        # 3. prompt chunks
        n_prompt = 0
        budget = self.policies.batch_builder.prompt_budget(self.cfg.n_batch, n_decode, self.base.cont_batching)
        if n_prompt_pending and budget > 0:
            for s in self.policies.batch_builder.prompt_order(slots):
                if budget <= 0:
                    break
                if s.state == STARTED:
                    if not self._begin_prompt(s, ops, now_s):
                        continue
                if s.state != PROCESSING_PROMPT:
                    continue
                task = s.task
                n_total = len(task.tokens)
                take = min(budget, n_total - s.i_prompt)
                pos0 = len(s.tokens)
                part = task.tokens[s.i_prompt:s.i_prompt + take]
                s.tokens.extend(part)
                s.i_prompt += take
                budget -= take
                n_prompt += take
                if pos0 + take > n_gen_max:
                    n_gen_max = pos0 + take
                sample_for: tuple[int, ...] = ()
                if s.i_prompt == n_total:
                    s.state = DONE_PROMPT
                    sample_for = (s.id, *(c.slot_id for c in task.children))
                    for sid in sample_for:
                        tasks[sid] = slots[sid].task
                chunks.append(Chunk(s.id, task.id, part, pos0, sample_for, True))
        if not chunks:
            self._ops = []
            return BatchPlan(now_s, tuple(ops), 0, 0, {})
        # every slot's tokens are now at most max(n_gen_max, n_rest): the slots given tokens are at most n_gen_max
        # long, the others only shrank since the first pass (prompt trims, releases), or stayed
        fatal, single = self._decode_views(chunks, n_decode + n_prompt, ops, now_s, max(n_gen_max, n_rest))
        self._ops = []
        if not single:     # split batch: only slots whose last chunk made it into a forward call sample
            tasks = {}
            for p in ops:
                if type(p) is ForwardCall:
                    for c in p.chunks:
                        for sid in c.sample_for:
                            tasks[sid] = slots[sid].task
        if self.rec.enabled:
            self.rec.record(now_s, "batch", n_decode=n_decode, n_prompt=n_prompt,
                            slots=[c.seq for c in chunks], n_calls=sum(isinstance(p, ForwardCall) for p in ops))
        plan = BatchPlan(now_s, tuple(ops), n_prompt, n_decode, tasks)
        self._uncommitted = plan
        # one call: the slots given tokens now are all that grew since the last commit, but for those launched
        # since (counted at commit); a split batch may purge idle slots, so its commit takes the max over all
        self._n_built_max = n_gen_max if single else -1
        if fatal:
            self._pending_fatal = plan
        return plan

    def _begin_prompt(self, s: Slot, ops: list, now_s: float) -> bool:
        """STARTED -> PROCESSING_PROMPT: admission checks, n_past from the slot's tokens, KV trimmed."""
        task = s.task
        n = len(task.tokens)
        task.t_start_s = now_s
        if n == 0:
            self._release(s, now_s)       # empty prompt: empty final response
            return False
        if n >= s.n_ctx:
            task.error = TaskError(
                ErrorType.EXCEED_CONTEXT_SIZE,
                f"request ({n} tokens) exceeds the available context size ({s.n_ctx} tokens), try increasing it",
                {"n_prompt_tokens": n, "n_ctx": s.n_ctx})
            self.rec.record(now_s, "reject", task=task.id, slot=s.id, n_tokens=n, n_ctx=s.n_ctx)
            self._release(s, now_s)
            return False
        cache_prompt = self.base.cache_prompt if task.cache_prompt is None else task.cache_prompt
        if cache_prompt:
            n_past = common_prefix(s.tokens, task.tokens)
            n_reuse = self.base.n_cache_reuse if task.n_cache_reuse is None else task.n_cache_reuse
            if n_reuse > 0 and self.base.can_shift:
                n_past = self._cache_reuse(s, task.tokens, n_past, n_reuse, ops)
        else:
            n_past = 0
        if n_past == n and n_past > 0:
            n_past -= 1                   # at least one prompt token is evaluated to get logits
        task.n_prompt_cached = n_past
        task.n_prompt_processed = n - n_past
        self.metrics.n_prompt_tokens_cached_total += n_past
        if len(s.tokens) > n_past:
            s.tokens = s.tokens[:n_past]     # (a fresh copy: cheaper than deleting a long list tail in place)
            self.kv.truncated(s.id, n_past)
            ops.append(_tuple_new(KVOp, ("seq_rm", s.id, n_past, -1, 0, -1, -1, 0, False)))  # seq_rm p0=n_past
        self._saved_in[s.id] = -1
        s.n_past = n_past
        s.i_prompt = n_past
        s.state = PROCESSING_PROMPT
        if self.rec.enabled:
            self.rec.record(now_s, "prompt", task=task.id, slot=s.id, n_tokens=n, n_past=n_past)
        return True

    def _cache_reuse(self, s: Slot, new: list[int], n_past: int, n_reuse: int, ops: list) -> int:
        """`--cache-reuse`: move matching chunks of the slot's KV left to where the new prompt needs them."""
        cache = s.tokens
        head_c = head_p = n_past
        self.kv.truncated(s.id, n_past)
        while head_c < len(cache) and head_p < len(new):
            n_match = 0
            while (head_c + n_match < len(cache) and head_p + n_match < len(new)
                   and cache[head_c + n_match] == new[head_p + n_match]):
                n_match += 1
            if n_match >= n_reuse:
                kv_shift = head_p - head_c
                ops.append(KVOp("seq_rm", seq=s.id, p0=head_p, p1=head_c))
                ops.append(KVOp("seq_add", seq=s.id, p0=head_c, p1=head_c + n_match, delta=kv_shift))
                cache[head_p:head_p + n_match] = cache[head_c:head_c + n_match]
                n_past += n_match
                head_c += n_match
                head_p += n_match
            else:
                head_c += 1
        return n_past

    def _context_shift(self, s: Slot, ops: list, now_s: float) -> None:
        task = s.task
        if not self.base.ctx_shift:
            self._fail(s, ErrorType.SERVER, "context shift is disabled", now_s)
            return
        if task.is_parent or task.is_child:
            self._fail(s, ErrorType.SERVER, "context shift cannot be used for shared prompt", now_s)
            return
        n_keep_req = self.base.n_keep if task.n_keep is None else task.n_keep
        n_tokens = len(s.tokens)
        n_keep, n_discard = self.policies.context_shift.plan(
            n_tokens, s.n_ctx, n_keep_req, task.n_discard, len(task.tokens), self.base.add_bos_token)
        ops.append(KVOp("seq_rm", seq=s.id, p0=n_keep, p1=n_keep + n_discard))
        ops.append(KVOp("seq_add", seq=s.id, p0=n_keep + n_discard, p1=n_tokens, delta=-n_discard))
        del s.tokens[n_keep:n_keep + n_discard]
        self.kv.truncated(s.id, n_keep)
        task.truncated = True
        self._saved_in[s.id] = -1
        self.metrics.n_context_shifts += 1
        self.rec.record(now_s, "context_shift", task=task.id, slot=s.id, n_keep=n_keep, n_discard=n_discard)

    # --- decode(): KV capacity, idle-slot purge, n_batch halving --------------------------------------
    def _decode_views(self, chunks: list[Chunk], n_total: int, ops: list, now_s: float,
                      n_bound: int = -1) -> tuple[str, bool]:
        """Cut the batch (`n_total` tokens in `chunks`, already appended to the slots' tokens) into llama_decode
        calls of at most n_batch tokens that fit in the KV cells (`KVCells.split`: idle-slot purge, n_batch
        halving). `n_bound`: an upper bound of every slot's tokens, or -1. Returns (fatal error message or "",
        whether the batch went as one call)."""
        if n_total <= self.cfg.n_batch and self.kv.fits_as_is(n_bound):
            # common case: one llama_decode call
            ops.append(_tuple_new(ForwardCall, (tuple(chunks), n_total)))   # ForwardCall(chunks, n_total)
            m = self.metrics
            m.n_decode_total += 1
            m.n_busy_slots_total += self._n_busy
            if self._n_parents_busy and any(len(c.sample_for) > 1 for c in chunks):
                self._after_forward(chunks, ops)
            return "", True
        added = [0] * len(self.slots)       # tokens each slot got in this batch
        for c in chunks:
            added[c.seq] += len(c.tokens)
        ok, used = self.kv.split(chunks, added, self.cfg.n_batch, _Views(self, ops, now_s))
        if not ok:
            self.rec.record(now_s, "decode_fatal", used=used, cap=self.kv.capacity)
            return MSG_CTX_EXCEEDED, False
        return "", False

    def _after_forward(self, view: list[Chunk], ops: list) -> list[int]:
        """n_cmpl: once a parent's prompt is decoded, copy its state to its waiting children (their ids)."""
        copied = []
        for c in view:
            if not c.sample_for or len(c.sample_for) == 1:
                continue
            parent = self.slots[c.seq]
            for sid in c.sample_for[1:]:
                child = self.slots[sid]
                ops.append(KVOp("seq_rm", seq=sid, p0=-1, p1=-1))
                ops.append(KVOp("seq_cp", seq=parent.id, dst=sid, p0=-1, p1=-1))
                self.kv.truncated(sid, 0)
                child.tokens = parent.tokens[:]
                self.kv.copied(sid, parent.id, len(parent.tokens))
                self._saved_in[sid] = -1
                ct = child.task
                ct.t_start_s = parent.task.t_start_s
                ct.n_prompt_cached = parent.task.n_prompt_cached
                ct.n_prompt_processed = parent.task.n_prompt_processed
                child.state = DONE_PROMPT
                copied.append(sid)
        return copied

    def _clear_idle_slot(self, now_s: float) -> int:
        """`try_clear_idle_slots`: drop the cells of the first idle slot that holds any; its id, or -1."""
        for s in self.slots:
            if s.is_processing or not s.tokens:
                continue
            self.rec.record(now_s, "purge_idle_slot", slot=s.id, n_tokens=len(s.tokens))
            self._prompt_clear(s)            # its seq_rm lands in self._ops, the batch's op list
            self.metrics.n_kv_purges += 1
            return s.id
        return -1

    # ------------------------------------------------------------------ commit (post_decode)
    _pending_fatal: BatchPlan | None = None
    _uncommitted: BatchPlan | None = None
    _n_built_max: int = -1     # the longest tokens of the slots the uncommitted plan (one call) gave tokens

    def commit(self, plan: BatchPlan, result: StepResult, now_s: float) -> list[TokenEvent]:
        """Apply sampled tokens (`post_decode` + `process_token`), release finished slots. Returns the
        step's token events (tasks with a text hook; every task when streaming), in slot order."""
        n_max = -1
        if plan is self._uncommitted:
            self._uncommitted = None
            n_max = self._n_built_max
        self._n_built_max = -1
        self._last_commit_s = now_s
        slots = self.slots
        m = self.metrics
        stream = self.stream_tokens
        sampled = result.sampled
        eog = self._eog
        ctx_stop = not self.base.ctx_shift     # the context limit stops a task only with ctx shift off
        ptasks = plan.tasks
        for sid in sorted(sampled):            # post_decode visits slots in id order
            tok = sampled[sid]
            s = slots[sid]
            task = s.task
            if task is None or task is not ptasks.get(sid):
                continue                       # cancelled while the step ran
            if s.state == DONE_PROMPT:
                s.state = GENERATING
                task.t_prompt_last_s = now_s
                dt = now_s - task.t_start_s
                m.n_prompt_tokens_processed_total += task.n_prompt_processed
                m.n_prompt_tokens_processed += task.n_prompt_processed
                m.t_prompt_processing_total_s += dt
                m.t_prompt_processing_s += dt
            s.sampled = tok
            gen = task.generated
            gen.append(tok)
            task.t_gen_last_s = now_s
            if stream and task.text_hook is None:
                self._events.append(TokenEvent(task, tok))
            npm = task.n_predict_max
            if (task.text_hook is None and tok not in eog and (npm == -1 or len(gen) < npm)
                    and not (ctx_stop and len(s.tokens) + 1 >= s.n_ctx)):
                continue                       # no stop condition can hold: skip the full check
            if self._process_token(s, task, tok):
                if task.id_parent != -1:
                    n_max = -1                 # a child's release clears its tokens: take the max over all
                self._release(s, now_s)
        if n_max < 0:
            n_max = max([len(s.tokens) for s in slots])
        else:                                  # the slots given tokens in the plan, and those launched since
            for s in self._launched:
                if len(s.tokens) > n_max:
                    n_max = len(s.tokens)
        if n_max > m.n_tokens_max:
            m.n_tokens_max = n_max
        self._launched = []
        if self._pending_fatal is plan:
            self._pending_fatal = None
            for s in slots:
                if s.is_processing:
                    self._fail(s, ErrorType.SERVER, MSG_CTX_EXCEEDED, now_s)
                    self._prompt_clear(s)
        events, self._events = self._events, []
        return events

    def _process_token(self, s: Slot, task: Task, tok: int) -> bool:
        """Stop checks in upstream order; returns True when the task is done."""
        stop = False
        if task.text_hook is not None:
            word, out = task.text_hook.push(tok)
            self._events.append(TokenEvent(task, tok, out))
            if word is not None:
                task.stop_type, task.stopping_word = STOP_WORD, word
                return True
        if not self.base.ctx_shift and len(s.tokens) + 1 >= s.n_ctx:
            task.truncated = True
            task.stop_type = STOP_LIMIT
            stop = True
        n_predict = task.n_predict_max
        if not stop and n_predict != -1 and len(task.generated) >= n_predict:
            task.stop_type = STOP_LIMIT    # n_predict 0 still yields the first token, as upstream
            stop = True
        if tok in self._eog and not task.ignore_eos:
            task.stop_type = STOP_EOS
            stop = True
        return stop

    # ------------------------------------------------------------------ exact fast-forward
    def _blocked(self) -> bool:
        """Something the next schedule must handle first: a queued task, a pending KV op or plan."""
        return bool(self.queue or self._ops) or self._uncommitted is not None or self._pending_fatal is not None

    def _decode_bound(self, gen: list[Slot]) -> int:
        """Plain decode steps the generating slots `gen` can take, each adding one token, before a context
        shift or a stop (a stop is allowed in the last step's commit)."""
        k = 1 << 62
        for s in gen:
            task = s.task
            # step j runs with len = n_left + j before it: a shift at its schedule when len+1 >= n_ctx, or (shift
            # off) a stop at its commit when len+2 >= n_ctx -- both first at j = n_ctx - n_left - 1 (shift)
            # or n_ctx - n_left - 2 (stop, allowed as the last step)
            n = s.n_ctx - len(s.tokens) - 1
            if n < k:
                k = n
            n_predict = task.n_predict_max
            if n_predict != -1:
                n = n_predict - len(task.generated)   # the stop lands in the last step's commit
                if n < k:
                    k = n
        return k

    def _census(self) -> tuple[list[Slot], int, int, int] | None:
        """One pass over the slots for the decode and admission stretches: (generating slots in slot order,
        prompts pending (STARTED or PROCESSING_PROMPT), k, Σ len(tokens) of the generating slots), where k
        bounds the plain decode steps the generating slots can take as `_decode_bound` does.
        None when a busy slot rules out any stretch: a text hook, a context shift due, a pending prompt of
        an n_cmpl task, or another state (DONE_PROMPT, WAIT_OTHER)."""
        gen = []
        pending = 0
        gen_ctx = 0
        k = 1 << 62                        # the bound of _decode_bound(gen), computed in the same pass
        lk = self._lk
        join = []                          # lazy: generating slots not in the lock step yet
        pend = []                          # the slots with a prompt pending, in slot order
        stop = []                          # lazy: the generating slots whose bound is k (a stop may come at k)
        lz = self._lz is not None
        for s in self.slots:
            st = s.state
            if st == IDLE:
                continue
            if st == GENERATING:
                if s.lk0 >= 0:             # lazy, in the lock step: its bounds are step counts (see below)
                    if s.lkc <= lk:
                        return None        # a context shift first
                    n = s.lkb - lk
                else:
                    t = s.task
                    # step j runs with len = n_left + j before it: see _decode_bound
                    n_tok = len(s.tokens)
                    n = s.n_ctx - n_tok - 1
                    if t.text_hook is not None or n <= 0:
                        return None        # a text hook, or a context shift first
                    npm = t.n_predict_max
                    if npm != -1:
                        n2 = npm - len(t.generated)   # the stop lands in the last step's commit
                        if n2 < n:
                            n = n2
                    gen_ctx += n_tok
                    if lz:
                        join.append(s)
                if n <= k:
                    if lz:
                        if n < k:
                            stop = [s]
                        else:
                            stop.append(s)
                    k = n
                gen.append(s)
            elif st == STARTED or st == PROCESSING_PROMPT:
                t = s.task
                if t.text_hook is not None or t.n_cmpl != 1 or t.id_parent != -1:
                    return None
                pending += 1
                pend.append(s)
            else:
                return None
        if self._lz_n:                     # the lock step's slots: Σ len(tokens), pending tokens included
            gen_ctx += self._lz_len + self._lz_n * lk - self._lz_s0
        self._c_join = join
        self._c_pend = pend
        self._c_stop = stop
        self._c_kstop = k
        self.gen_ctx = gen_ctx
        return gen, pending, k, gen_ctx

    def decode_horizon(self) -> tuple[int, list[Slot]]:
        """How many upcoming steps are certain to be plain decode steps: no queued task, no pending KV op,
        every busy slot GENERATING with no text hook, no context shift or KV-capacity event, and no stop
        before the commit of the last of them (which may end tasks). EOS is the caller's to rule out, since
        it knows the tokens. Returns (k, generating slots); k = 0 when the next step must run normally."""
        if self._blocked():
            return 0, []
        c = self._census()
        if c is None or c[1]:                # a slot that blocks any stretch, or a prompt pending
            return 0, []
        gen, _, k, _ = c
        if not gen or len(gen) > self.cfg.n_batch:
            return 0, []
        if not self.policies.batch_builder.include_decodes(len(gen), 0):
            return 0, []
        k = min(k, self.kv.decode_steps_left(len(gen)))
        return max(k, 0), gen

    def prefill_horizon(self) -> tuple[int, list[Slot], Slot | None, int]:
        """How many upcoming steps are certain to be one prompt chunk of `take` tokens (the whole prompt
        budget) for the first slot in prompt order that is processing a prompt, none of them its last chunk
        (that one samples: it runs normally), plus one decode token per generating slot when the batch
        builder includes decodes: a `stable` batch builder, no queued task, no pending KV op, every busy slot
        GENERATING with no text hook or waiting for its prompt, the batch within n_batch and fitting the KV
        cells as one call, no context shift, and no stop before the last step's commit.
        Returns (m, decoding slots, prompt slot, take); m = 0 when the next step must run normally."""
        none = 0, [], None, 0
        if self._blocked():
            return none
        if self._lz_n:
            self.sync()
        gen = []
        n_pending = 0
        for s in self.slots:
            st = s.state
            if st == IDLE:
                continue
            if st == GENERATING:
                if s.task.text_hook is not None:
                    return none
                gen.append(s)
            elif st == PROCESSING_PROMPT or st == STARTED:
                n_pending += 1
            else:
                return none
        bb = self.policies.batch_builder
        if not n_pending or not getattr(bb, "stable", False):
            return none
        p = None
        for s in bb.prompt_order(self.slots):     # the budget goes to the first pending prompt in this order
            if s.state == STARTED:
                return none                       # it would begin its prompt (admission checks, KV trim)
            if s.state == PROCESSING_PROMPT:
                p = s
                break
        if p is None or p.task.n_cmpl != 1 or p.task.id_parent != -1:
            return none
        n_batch = self.cfg.n_batch
        for s in gen:                        # a context shift would come first (decodes or not)
            if len(s.tokens) + 1 >= s.n_ctx:
                return none
        if not (gen and bb.include_decodes(len(gen), n_pending)):
            gen = []
        n_dec = len(gen)
        take = bb.prompt_budget(n_batch, n_dec, self.base.cont_batching)
        if take <= 0 or n_dec + take > n_batch:
            return none
        m = (len(p.task.tokens) - p.i_prompt - 1) // take   # chunks of `take` that leave the last one
        if gen:
            m = min(m, self._decode_bound(gen))
        kv = self.kv
        if kv.unified:
            m = min(m, (kv.capacity - kv.used()) // (n_dec + take))
        else:
            if not kv.fits_as_is():
                return none
            m = min(m, (kv.capacity - len(p.tokens)) // take)
        if m < 1:
            return none
        return m, gen, p, take

    def admission_horizon(self, now_s: float) -> Admission | None:
        """Take the queued tasks as `schedule(now_s)` does first (slot choice, prompt-cache save/load, launch),
        then: how many upcoming steps can be applied at once when the next one carries prompt chunks (the
        budget handed out in prompt order, as batch building does: the last chunks of some prompts, which
        sample at its commit, and at most one chunk that leaves its prompt unfinished) together with one
        decode token of every generating slot, and the ones after it are plain decode steps of all of them
        or, when a prompt is left unfinished, steps of one full-budget chunk of it with those decodes (as
        `prefill_horizon`'s stretches, never its last chunk).

        Conditions: a `stable` batch builder that includes the decodes; the pending prompts with no text
        hook and no n_cmpl; every busy slot GENERATING (no text hook, no context shift due) or with a prompt
        to process; the first step within n_batch and the KV cells as one call; no stop before the last
        step's commit. The STARTED slots the first step reaches begin their prompts here (`_begin_prompt`:
        n_past, the KV trim), at `now_s`, in prompt order, as the step's batch building would; when the rest
        does not hold, the next `schedule(now_s)` then finds the queue empty and those prompts begun, which
        is what it would have done itself. None when the next step must run normally."""
        if self._uncommitted is not None:
            raise RuntimeError("admission_horizon() called before commit() of the previous plan")
        while self.queue:
            self._process_single_task(self.queue.popleft(), now_s)
        if self._pending_fatal is not None or not self._n_busy:
            return None
        c = self._census()
        if c is None:
            return None
        gen, pending, k, dec_ctx = c
        if not pending:
            return None
        kstop = k                          # lazy: the least stop bound, and the slots that have it
        bb = self.policies.batch_builder
        if not getattr(bb, "stable", False):
            return None
        n_dec = len(gen)
        if gen and not bb.include_decodes(n_dec, pending):
            return None
        n_batch = self.cfg.n_batch
        cont = self.base.cont_batching
        budget = bb.prompt_budget(n_batch, n_dec, cont)
        if budget <= 0:
            return None
        chunks = []                        # (slot, pos0, take) in prompt order
        done = []                          # slots whose prompt ends in the first step
        q = None                           # the slot whose prompt the first step leaves unfinished
        n_prompt = 0
        # batch building's prompt pass (in slot order it need visit only the slots with a prompt pending)
        for s in (self._c_pend if getattr(bb, "in_slot_order", False) else bb.prompt_order(self.slots)):
            if budget <= 0:
                break
            st = s.state
            if st == STARTED:
                n = len(s.task.tokens)
                if n == 0 or n >= s.n_ctx:
                    return None            # _begin_prompt releases it
                self._begin_prompt(s, self._ops, now_s)
            elif st != PROCESSING_PROMPT:
                continue
            i = s.i_prompt                 # == len(s.tokens)
            n = len(s.task.tokens)
            take = min(budget, n - i)
            chunks.append((s, i, take))
            budget -= take
            n_prompt += take
            if i + take == n:
                done.append(s)
                kp = s.n_ctx - n           # then n tokens in the KV, 1 generated: bounds as _decode_bound's
                npm = s.task.n_predict_max
                if npm != -1 and npm < kp:
                    kp = npm
                if kp < 1:
                    kp = 1
                if kp <= kstop and self._lz is not None:
                    if kp < kstop:
                        self._c_stop = [s]
                        self._c_kstop = kstop = kp
                    else:
                        self._c_stop.append(s)
                if kp < k:
                    k = kp
            else:
                q = s
            if len(chunks) == pending:
                break                      # every pending prompt has its chunk: the other slots have none
        if n_dec + n_prompt > n_batch:
            return None
        kv = self.kv
        used = 0
        if kv.unified:
            used = kv.used() + n_dec + n_prompt          # after the first step
            if used > kv.capacity:
                return None
        # per-slot KV: the first step fits as is (fits_as_is: every slot within its n_ctx cells), since each
        # decoding slot has len + 1 < n_ctx (no shift due), a prompt ends at n < n_ctx, the others unchanged
        if not done:
            dec = gen
        elif len(done) == pending:         # every busy slot decodes after the first step: all of them, in order
            dec = [s for s in self.slots if s.state]
        else:
            dec = sorted([*gen, *done], key=_slot_id)
        n_dec1 = len(dec)
        q_take = 0
        if q is None:
            if pending > len(chunks) or n_dec1 > n_batch or not bb.include_decodes(n_dec1, 0):
                k = 1                      # a prompt begins next step, or no plain decode steps follow
            elif kv.unified:
                k = min(k, 1 + (kv.n_ctx - used) // n_dec1)
        else:
            if dec and not bb.include_decodes(n_dec1, pending - len(chunks) + 1):
                k = 1
            else:
                q_take = bb.prompt_budget(n_batch, n_dec1, cont)
                i = q.i_prompt + chunks[-1][2]            # q's chunk is the last one of the first step
                if q_take <= 0 or n_dec1 + q_take > n_batch:
                    k = 1
                else:
                    k = min(k, 1 + (len(q.task.tokens) - i - 1) // q_take)   # never q's last chunk
                    if kv.unified:
                        k = min(k, 1 + (kv.capacity - used) // (n_dec1 + q_take))
                    else:
                        k = min(k, 1 + (kv.capacity - i) // q_take)
        if k < 1:
            return None
        return Admission(k, gen, chunks, done, dec, q, q_take, self._ops, dec_ctx)

    def fast_forward(self, gen: list[Slot], tokens: dict[int, list[int]], end_times_s: list[float],
                     arrivals: dict[int, list[Task]] | None = None,
                     prompt: tuple[Slot, int] | None = None,
                     admit: Admission | None = None, t_start_s: float | None = None) -> list[TokenEvent]:
        """Apply k = len(end_times_s) steps at once, exactly as k schedule/commit rounds would.

        Plain decode steps: `gen` and k (at most) come from `decode_horizon`. With `prompt=(slot, take)` each
        step also carries a chunk of `take` prompt tokens of that slot, and `gen`, k (at most) and take come
        from `prefill_horizon`. With `admit` (from `admission_horizon`, called just before at the first step's
        start, with `gen` = admit.gen) the first step runs admit's prompt chunks with the decodes of `gen`
        (its leading KV operations already decided), and the steps after it decode admit.dec (and add
        admit.q's chunks). `tokens[slot]` holds the k tokens sampled for each decoding slot (admit.dec with
        `admit`; no EOG before the last). The last step's commit runs the stop checks and releases, as
        `commit` would. `arrivals[j]`: tasks submitted at the start of step j; only allowed while every slot
        is busy, when `process_new_tasks` can do nothing but defer them (so they do not change the stretch).
        `t_start_s`: the first step's start (default: the last commit's time; with `admit`, the `now_s` of
        `admission_horizon`).
        """
        k = len(end_times_s)
        if arrivals and self._n_busy < len(self.slots):
            raise RuntimeError("fast_forward with arrivals needs every slot busy")
        if admit is not None and t_start_s is None:
            raise ValueError("fast_forward with admit needs t_start_s (the now_s given to admission_horizon)")
        if arrivals and 0 in arrivals and admit is not None:
            raise RuntimeError("fast_forward with admit: the first step's tasks were taken by admission_horizon")
        m = self.metrics
        n_dec = len(gen)
        busy = self._n_busy
        rec = self.rec.enabled
        t_end = end_times_s[-1]
        stream = self.stream_tokens
        ids = [s.id for s in gen] if rec else None
        t_start = self._last_commit_s if t_start_s is None else t_start_s
        if admit is not None:
            self._ops = []                   # the first step's leading KV operations: executed with it
            n_first = 0
            for s, i, take in admit.chunks:
                s.tokens.extend(s.task.tokens[i:i + take])
                s.i_prompt = i + take
                n_first += take
            t1 = end_times_s[0]              # the first step's commit: DONE_PROMPT -> GENERATING, as commit()
            for s in admit.done:             # (in slot order, as commit visits them)
                task = s.task
                # the prompt's last token stands for the token to append first: then the slot's sampled
                # tokens go into its KV like every decoding slot's (all but the last)
                s.sampled = s.tokens.pop()
                s.state = GENERATING
                task.t_prompt_last_s = t1
                dt = t1 - task.t_start_s
                m.n_prompt_tokens_processed_total += task.n_prompt_processed
                m.n_prompt_tokens_processed += task.n_prompt_processed
                m.t_prompt_processing_total_s += dt
                m.t_prompt_processing_s += dt
            gen = admit.dec
            if rec:                          # the first step: the decodes, then the prompt chunks
                self.rec.record(t_start, "batch", n_decode=n_dec, n_prompt=n_first,
                                slots=[*ids, *(c[0].id for c in admit.chunks)], n_calls=1)
                ids = [s.id for s in gen]
            n_dec = len(gen)                 # the steps after it: decodes of gen and done (and q's chunks)
            if admit.q is not None:
                prompt = (admit.q, admit.q_take)
        eog = self._eog
        ctx_stop = not self.base.ctx_shift
        stops = []                           # slots whose last token's stop checks may hold
        if tokens is None:
            # lazy: every decoding slot of the stretch (gen; admit.dec, its prompts' slots included) gets k
            # tokens, kept pending: the slots not in the lock step join it, and the step count moves on
            lk = self._lk
            join = self._c_join if admit is None or not admit.done else [*self._c_join, *admit.done]
            n_len = 0
            for s in join:
                # the bounds _census computes, as lock step counts: they hold while the slot is in it
                n = len(s.tokens)
                n_len += n
                s.lk0 = lk
                s.lkb = s.lkc = lk + s.n_ctx - n - 1
                task = s.task
                npm = task.n_predict_max
                if npm != -1:
                    n = lk + npm - len(task.generated)
                    if n < s.lkb:
                        s.lkb = n
            self._lz_n += len(join)
            self._lz_s0 += lk * len(join)
            self._lz_len += n_len
            self._lk = lk + k
            self._lz_t = t_end
            if k == self._c_kstop:
                # only a slot whose stop bound is the least may stop, and only when the stretch reaches it
                cands = self._c_stop
                if admit is not None and admit.done and len(cands) > 1:
                    cands = sorted(cands, key=_slot_id)
                for s in cands:
                    self._materialize(s)
                    task = s.task
                    npm = task.n_predict_max
                    if (s.sampled in eog or (npm != -1 and len(task.generated) >= npm)
                            or (ctx_stop and len(s.tokens) + 1 >= s.n_ctx)):
                        stops.append(s)
            gen = ()                         # (the eager per-slot pass below)
        for s in gen:
            task = s.task
            new = tokens[s.id]
            toks = s.tokens
            toks.append(s.sampled)
            toks.extend(new)
            tok = s.sampled = toks.pop()     # the last sampled token is not in the KV yet
            gen_t = task.generated
            gen_t.extend(new)
            task.t_gen_last_s = t_end
            if stream:
                self._events.extend(TokenEvent(task, t) for t in new)
            npm = task.n_predict_max
            if (tok in eog or (npm != -1 and len(gen_t) >= npm)
                    or (ctx_stop and len(toks) + 1 >= s.n_ctx)):
                stops.append(s)              # else no stop condition can hold (no text hook here): commit skips it
        n_prompt = 0
        if prompt is not None:
            p, take = prompt
            n_prompt = take
            n = (k if admit is None else k - 1) * take
            i = p.i_prompt
            p.tokens.extend(p.task.tokens[i:i + n])
            p.i_prompt = i + n
            if rec:
                ids.append(p.id)
        m.n_decode_total += k
        m.n_busy_slots_total += busy * k
        if arrivals or rec:
            # every step when recording (one batch event each), else only the steps that see arrivals
            for j in range(0 if admit is None else 1, k) if rec else sorted(arrivals):
                start = end_times_s[j - 1] if j else t_start
                if arrivals and j in arrivals:
                    for t in arrivals[j]:
                        self.submit(t, start)
                    while self.queue:
                        self._process_single_task(self.queue.popleft(), start)
                    assert not self._ops, "deferring a task emitted KV operations"
                if rec:
                    self.rec.record(start, "batch", n_decode=n_dec, n_prompt=n_prompt, slots=ids, n_calls=1)
        self._last_commit_s = t_end
        for s in stops:                      # the last step's commit: stop checks and releases in slot order
            task = s.task
            if self._process_token(s, task, s.sampled):
                self._release(s, t_end)
        if tokens is None:
            # lazy: the lock step's slots count at their write-out (their tokens only grow until then); of the
            # others only those launched since the last commit or stretch, or given prompt tokens, changed
            grown = self._launched
            if admit is not None:
                grown = [*grown, *(c[0] for c in admit.chunks)]
            if prompt is not None:
                grown = [*grown, prompt[0]]
            n_max = max([len(s.tokens) for s in grown]) if grown else 0
        else:
            n_max = max([len(s.tokens) for s in self.slots])
        if n_max > m.n_tokens_max:
            m.n_tokens_max = n_max
        self._launched = []
        events, self._events = self._events, []
        return events

    _last_commit_s: float = 0.0

    # ------------------------------------------------------------------ release
    def _fail(self, s: Slot, etype: ErrorType, message: str, now_s: float) -> None:
        s.task.error = TaskError(etype, message)
        self.rec.record(now_s, "error", task=s.task.id, slot=s.id, message=message)
        self._release(s, now_s)

    def _release(self, s: Slot, now_s: float) -> None:
        if s.lk0 >= 0:
            self._materialize(s)
        task = s.task
        s.t_last_used_s = now_s
        s.state = IDLE
        self._n_busy -= 1
        if task.is_parent:
            self._n_parents_busy -= 1
        s.task = None
        if task.is_child:
            self._prompt_clear(s)          # child slots keep no context
        task.n_tokens_cached = len(s.tokens)
        m = self.metrics
        gen_s = max(0.0, task.t_gen_last_s - task.t_prompt_last_s) if task.t_prompt_last_s >= 0 else 0.0
        n_gen = len(task.generated)
        m.n_tokens_predicted_total += n_gen
        m.n_tokens_predicted += n_gen
        m.t_tokens_generation_total_s += gen_s
        m.t_tokens_generation_s += gen_s
        self._finish(task, now_s)
        if task.is_parent:
            # children still waiting for the parent's prompt can never start: end them the same way
            for c in task.children:
                cs = self.slots[c.slot_id] if c.slot_id >= 0 else None
                if cs is not None and cs.task is c and cs.state == WAIT_OTHER:
                    c.error = task.error
                    self._release(cs, now_s)
        if self.deferred:
            i = self.policies.queue_order.pick_deferred(self.deferred, s, self._n_named_deferred > 0)
            t = self.deferred.pop(i)
            if t.id_slot >= 0:
                self._n_named_deferred -= 1
            self.queue.appendleft(t)

    def _finish(self, task: Task, now_s: float) -> None:
        task.done = True
        task.t_end_s = now_s
        if task.error is None:
            self.metrics.n_tasks_finished += 1
        else:
            self.metrics.n_tasks_errored += 1
        self.finished.append(task)
        if self.rec.enabled:
            self.rec.record(now_s, "finish", task=task.id, slot=task.slot_id, stop=task.stop_type,
                            n_gen=task.n_decoded, error=task.error.message if task.error else None)

    def _finish_unslotted(self, task: Task, now_s: float) -> None:
        task.done = True
        task.t_end_s = now_s

    def _new_id(self) -> int:
        i = self._next_task_id
        self._next_task_id += 1
        return i

    def slots_of(self, states: Iterable[SlotState]) -> list[Slot]:
        self.sync()
        st = set(states)
        return [s for s in self.slots if s.state in st]


class _Views:
    """`KVCells.split`'s sink for one batch: emits the calls into the batch's op list, clears idle slots."""

    __slots__ = ("core", "ops", "now_s", "busy")

    def __init__(self, core: ServerCore, ops: list, now_s: float) -> None:
        self.core = core
        self.ops = ops
        self.now_s = now_s
        self.busy = core._n_busy

    def emit(self, view: list[Chunk], n_tokens: int) -> list[int]:
        core = self.core
        self.ops.append(ForwardCall(tuple(view), n_tokens))
        core.metrics.n_decode_total += 1
        core.metrics.n_busy_slots_total += self.busy
        return core._after_forward(view, self.ops)

    def purge_idle(self) -> int:
        return self.core._clear_idle_slot(self.now_s)

    def halved(self, off: int, n_batch: int, used: int, cap: int) -> None:
        self.core.metrics.n_batch_halvings += 1
        self.core.rec.record(self.now_s, "batch_halved", off=off, n_batch=n_batch, used=used, cap=cap)
