"""SimPy discrete-event driver: one server process runs the core loop, client processes submit requests.

Time is integer nanoseconds inside SimPy (sums are exact, so fast-forwarding k steps lands on exactly the
time k single steps would) and seconds at the core's interface. An arrival at time t is seen by a step
that starts at t: the server yields a low-priority zero-delay event before draining its inbox.

Open-loop arrivals (a trace) are a sorted timestamp list the server process merges itself, rather than one
SimPy timeout per request: fast-forward can then run through arrivals that find every slot busy (they can
only be deferred, so they do not change the decode stretch). Closed-loop sessions are SimPy processes.
"""

from __future__ import annotations

import gc
import math
from collections import deque
import time
from bisect import bisect_left
from itertools import accumulate
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy
from simpy.events import NORMAL, Event

from engine.core import Recorder, ServerConfig, ServerCore, Task, step
from engine.core.tokens import token_array
from engine.core.types import Backend
from policies import make_policies
from sim.backend import SimBackend, standin_tokens
from sim.latency import LatencyModel
from traces import ChatWorkload, PromptMaterializer, TokenSpace, Trace
from traces.tokens import DOMAIN_REPLY, extend_key, stream_key
from sim.future import FutureRequests, chat_requests, trace_requests

NS = 1_000_000_000
LATE = NORMAL + 1          # SimPy priority after every normal event of the same instant
TIMELINE_MAX = 20_000
REPLY_POOL = 1 << 16       # stand-in reply tokens drawn once per simulation
SMALL_STRETCH = 64         # fast-forward stretches up to this many steps are timed with Python lists, not numpy
# request parameters of a recorded trace (TraceRequest.sampling) that the core acts on
RECORDED_TASK_FIELDS = ("ignore_eos", "id_slot", "cache_prompt", "n_keep", "n_discard", "n_cache_reuse")


@dataclass(slots=True)
class SimRequest:
    """What the simulator knows about a submitted request (carried in Task.user)."""

    index: int
    arrival_ns: int
    n_output_target: int
    reply: list[int]
    session_id: str | None = None
    turn: int = 0
    done: simpy.Event | None = None
    source: Any = None               # the trace request whose prompt is still to be drawn (lazy prompts)


@dataclass(slots=True)
class SimResult:
    requests: list[dict[str, Any]]
    timeline: list[dict[str, Any]]
    metrics: Any
    run: dict[str, Any]
    cache_stats: dict[str, Any]
    config: dict[str, Any]
    recorder: Recorder | None = None
    sessions_ended_early: list[str] = field(default_factory=list)


def _s(ns: int) -> float:
    return ns / NS


class Late(Event):
    """An event that fires at the current instant, after every normal-priority event of that instant.

    Built as SimPy's own `Timeout` and `Initialize` events are (`simpy/events.py`): triggered at creation
    and scheduled with a priority; the public `env.event().succeed()` can only schedule at NORMAL."""

    def __init__(self, env: simpy.Environment) -> None:
        super().__init__(env)
        self._ok = True
        self._value = None
        env.schedule(self, priority=LATE)


class Simulation:
    """Replays a workload (open-loop `Trace` or closed-loop `ChatWorkload`) through one `ServerCore`."""

    def __init__(self, server_config: ServerConfig, latency: LatencyModel | None, *, seed: int = 0,
                 fast_forward: bool = True, recorder: Recorder | None = None,
                 progress: Callable[[int, int], None] | None = None, vocab_size: int = 49152,
                 backend: Backend | None = None, reserved_tokens: frozenset[int] = frozenset(),
                 task_defaults: dict[str, Any] | None = None) -> None:
        """`backend=None` simulates with `latency`. Any other backend (e.g. the numpy engine) is driven by
        the same loop, the simulated clock advancing by the elapsed seconds it reports; fast-forward is
        then off. `reserved_tokens` never appear in materialized prompts (a real model's special tokens);
        `task_defaults` are extra Task fields for every request (e.g. ignore_eos, sampling)."""
        self.config = server_config
        self.resolved = server_config.resolve()
        self.latency = latency
        self.seed = seed
        self.fast_forward = fast_forward and backend is None
        self.task_defaults = task_defaults or {}
        self.recorder = recorder
        self.progress = progress
        self.env = simpy.Environment()
        # simulated, the core keeps token sequences as array('i') (engine/core/tokens.py: copies are memcpy);
        # a real backend gets the lists it expects
        self._token_arrays = backend is None
        self.core = ServerCore(self.resolved, make_policies(server_config.policies), recorder,
                               token_arrays=self._token_arrays)
        if backend is None and latency is None:
            raise ValueError("Simulation needs a latency model or a backend")
        self.backend = backend if backend is not None else SimBackend(latency, server_config.kv_bytes_per_token)
        bind_clock = getattr(latency, "bind_clock", None)
        if backend is None and bind_clock is not None:
            bind_clock(lambda: self.now_s)           # a model whose step times follow the clock (TrackedLatency)
        self.space = TokenSpace(vocab_size, frozenset(server_config.eog_ids) | reserved_tokens)
        self.materializer = PromptMaterializer(self.space, seed)
        draw = self.materializer.tokens_array if self._token_arrays else self.materializer.tokens
        self._reply_pool = draw(stream_key(seed, DOMAIN_REPLY, -1), REPLY_POOL)
        self._reply_key = stream_key(seed, DOMAIN_REPLY)
        # stand-in replies are drawn from the token space, which excludes the EOG ids: then no stretch can hold one
        self._reply_eog = any(t in server_config.eog_ids for t in self._reply_pool)
        # Open-loop prompts are drawn when their task may get a slot rather than on arrival (same ids: they are
        # a pure function of seed and request), so a saturated server holds a few prompts rather than every
        # waiting one. Only when nothing reads a waiting task's prompt: no recorder (its submit event counts
        # the tokens) and a deferred-queue order that declares it never reads them.
        self._lazy_prompts = (self._token_arrays and recorder is None
                              and getattr(self.core.policies.queue_order, "reads_deferred_prompts", True) is False)
        self._fast_admission = backend is None and self.backend.fast_admission
        # Lazy stretches (ServerCore.lazy_tokens): generating slots keep a stretch's stand-in tokens as a count,
        # written out when read; only while no stand-in token can be an EOG (none is checked in a stretch), with
        # no recorder or layout-priced model, and a slot selector that reads no busy slot's tokens.
        self._lazy_tokens = (self.fast_forward and recorder is None
                             and not self._reply_eog and not self.backend.wants_layout
                             and getattr(self.core.policies.slot_selector, "busy_tokens_read", True) is False)
        if self._lazy_tokens:
            self.core.lazy_tokens(standin_tokens)
        self._undrawn: deque[Task] = deque()         # lazy prompts not drawn yet, in arrival order (some drawn since)
        self._inbox: list[Task] = []
        self._wakeup: simpy.Event | None = None
        self._rows: list[dict[str, Any]] = []
        self._timeline: list[dict[str, Any]] = []
        self._tl_stride = 1
        self._n_steps = 0
        self._n_ff_steps = 0
        self._n_total = 0
        self._n_done = 0
        self._arrivals: list[tuple[int, Any]] = []   # open loop: (arrival_ns, TraceRequest), sorted
        self._arr_i = 0
        # load accounting: simulated time with requests waiting for a slot, and the requests finished in it
        self._backlog_ns = 0
        self._backlog_done = 0
        self._backlog_at_last_arrival = -1
        self._future = None                          # sim.future.FutureRequests for an oracle policy
        self._clock_ns = 0                           # the server's clock at its last step (oracle)

    # ------------------------------------------------------------------ clients
    def submit(self, tokens: list[int], n_output: int, *, index: int, session_id: str | None = None,
               turn: int = 0) -> simpy.Event:
        """Submit a request now; the returned event fires with the finished Task."""
        env = self.env
        reply = self._reply(index, n_output)
        if self._future is not None:
            self._future.mark_submitted(index)
        req = SimRequest(index, env.now, n_output, reply, session_id, turn, env.event())
        task = Task(id=-1, tokens=tokens, n_predict=n_output, user=req, **self.task_defaults)
        self._inbox.append(task)
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()
        return req.done

    def _reply(self, index: int, n_output: int) -> list[int]:
        """The stand-in tokens a request "generates": a slice of one seeded pool at an offset drawn from
        (seed, index). Slicing is far cheaper than drawing fresh ids per request, and replies need no
        uniqueness of their own: they only ever follow a request's own (unique) prompt."""
        n = max(1, n_output)
        pool = self._reply_pool
        if n >= len(pool):
            return (pool * (n // len(pool) + 1))[:n]
        off = extend_key(self._reply_key, index) % (len(pool) - n)    # stream_key(seed, DOMAIN_REPLY, index)
        return pool[off:off + n]

    def _next_arrival_ns(self) -> float:
        return self._arrivals[self._arr_i][0] if self._arr_i < len(self._arrivals) else math.inf

    def _take_arrivals(self, until_ns: int) -> list[Task]:
        """Open-loop requests arriving at or before `until_ns`, as tasks (arrival time = trace time). Nobody can
        wait on a trace request, so it gets no SimPy `done` event."""
        arr = self._arrivals
        i0 = i = self._arr_i
        n = len(arr)
        while i < n and arr[i][0] <= until_ns:
            i += 1
        if i == i0:
            return []
        self._arr_i = i
        taken = arr[i0:i]
        mat = self.materializer
        lazy = self._lazy_prompts
        if lazy:
            prompts = [token_array() for _ in taken]   # drawn by _draw_prompts before the task can get a slot
        else:
            prompts = (mat.prompt_arrays([r for _, r in taken]) if self._token_arrays
                       else [mat.prompt(r) for _, r in taken])
        out = []
        defaults = self.task_defaults
        reply = self._reply
        for (t_ns, r), tokens in zip(taken, prompts):
            if r.output_tokens:
                rep, kw = list(r.output_tokens), self._recorded_fields(r)
                self._reply_eog = True               # recorded replies end with the EOS they stopped at
                if self._lazy_tokens:                # stretches check the tokens for EOG from now on
                    self._lazy_tokens = False
                    self.core.lazy_tokens(None)
            else:
                rep, kw = reply(r.index, r.n_output), defaults
            req = SimRequest(r.index, t_ns, r.n_output, rep, r.session_id, 0, None, r if lazy else None)
            out.append(Task(id=-1, tokens=tokens, n_predict=r.n_output, user=req, **kw))
        if lazy:
            self._undrawn.extend(out)
        return out

    LOOKAHEAD = 32                   # waiting tasks whose prompts are drawn with those that may get a slot now

    def _draw_prompts(self) -> None:
        """Lazy prompts: draw the prompts of the queued tasks (the next schedule may give them a slot) and, when
        any is missing, those of the next LOOKAHEAD deferred tasks with them, in one pass (so the drawn tasks
        at the front of the deferred queue never number more than LOOKAHEAD)."""
        todo = [t for t in self.core.queue if t.user.source is not None]
        if todo:
            undrawn = self._undrawn          # lazy tasks in arrival order (the deferred order, Fifo)
            n = len(todo) + self.LOOKAHEAD
            while undrawn and len(todo) < n:
                t = undrawn.popleft()
                if t.user.source is not None and t not in todo:
                    todo.append(t)
            for t, tokens in zip(todo, self.materializer.prompt_arrays([t.user.source for t in todo])):
                t.tokens = tokens
                t.user.source = None

    def _recorded_fields(self, r) -> dict[str, Any]:
        """Task fields of a recorded request (its `output_tokens` are the reply, EOS included): the request's
        own slot and cache parameters from `sampling`, and ignore_eos as it was sent (default off), so a
        recorded EOS stops the task where it stopped upstream (with the config's eog_ids)."""
        kw = {**self.task_defaults, "ignore_eos": False}
        for key, value in (r.sampling or {}).items():
            if key in RECORDED_TASK_FIELDS and value is not None:
                kw[key] = value
        return kw

    def _session(self, wl: ChatWorkload, sess, index0: int):
        env = self.env
        space = self.space
        start = round(sess.start_s * NS)
        if start > env.now:
            yield env.timeout(start - env.now)
        replies: list[list[int]] = []
        for k, turn in enumerate(sess.turns):
            if k > 0 and turn.send_at_s is not None:       # pinned (validate --arrivals real)
                at = round(turn.send_at_s * NS)
                if at > env.now:
                    yield env.timeout(at - env.now)
            elif k > 0 and turn.think_s > 0:
                yield env.timeout(round(turn.think_s * NS))
            prompt = wl.prompt_tokens(sess.session_id, k, space, replies)
            task = yield self.submit(prompt, turn.n_output, index=index0 + k, session_id=sess.session_id, turn=k)
            if task.error is not None:
                self._ended_early.append(sess.session_id)   # the user gives up on this conversation
                self._n_total -= len(sess.turns) - k - 1
                if self._wakeup is not None and not self._wakeup.triggered:
                    self._wakeup.succeed()           # the server may be waiting for turns that never come
                return
            replies.append(task.generated[:turn.n_output] if turn.n_output > 0 else task.generated)

    # ------------------------------------------------------------------ server
    # The server keeps its own clock `now` (integer ns) and lets SimPy's clock catch up (one timeout) only
    # when another process could act at or before `now` (an event is due: env.peek() <= now) or a finished
    # task has a `done` event to fire. With nothing else scheduled -- an open-loop trace -- consecutive steps
    # run without a SimPy event each; the order of everything any process sees is unchanged.
    def _server(self):
        env = self.env
        core = self.core
        backend = self.backend
        ff = self.fast_forward
        now = env.now
        peek = env.peek
        has_work = core.has_work
        d_ns = [0]                                 # the last step's rounded duration (ns), set by end_s

        def end_s(r):                              # a step's end: its start (_clock_ns) + its rounded duration
            d = d_ns[0] = round(r.elapsed_s * NS)
            return (self._clock_ns + d) / NS

        while True:
            if not self._inbox and not has_work():
                if self._n_done >= self._n_total:
                    if now > env.now:
                        yield env.timeout(now - env.now)
                    return
                t_arr = self._next_arrival_ns()
                if t_arr < math.inf:
                    if t_arr > now:
                        now = t_arr
                else:
                    if now > env.now:
                        yield env.timeout(now - env.now)
                    self._wakeup = env.event()
                    yield self._wakeup
                    self._wakeup = None
                    now = env.now
            if peek() <= now:
                if now > env.now:
                    yield env.timeout(now - env.now)
                if peek() <= now:
                    yield Late(env)                 # let client events of this very instant run first
            now_s = now / NS
            if self._arr_i < len(self._arrivals) and self._arrivals[self._arr_i][0] <= now:
                self._inbox.extend(self._take_arrivals(now))
                if self._arr_i == len(self._arrivals):
                    self._backlog_at_last_arrival = len(core.deferred) + len(core.queue) + len(self._inbox)
            if self._inbox:
                for t in self._inbox:
                    core.submit(t, now_s)
                self._inbox = []
            if self._lazy_prompts and core.queue and core.n_processing < len(core.slots):
                self._draw_prompts()                # a queued task may get a slot in this step
            # the step commits at its end time, computed in integer ns; its tasks finish once the clock is there
            t0 = self._clock_ns = now
            if ff:
                # this step and the decode steps after it at once (a slot's last prompt chunk with the decodes, or
                # plain decode steps, e.g. after a completion with no task waiting)
                t_ff = self._try_admission(now)
                if t_ff == now:
                    t_ff = self._try_fast_forward(now)
                if t_ff > now:
                    now = yield from self._end_stretch(now, t_ff)
                    continue
            finished = step(core, backend, now_s, end_s).finished
            now += d_ns[0]                          # (end_s ran: the plan was committed at its end)
            self._n_steps += 1
            if core.deferred:                       # requests waiting for a slot: the server runs flat out
                self._backlog_ns += now - t0
                self._backlog_done += len(finished)
            if peek() <= now or (finished and self._has_waiters(finished)):
                if now > env.now:
                    yield env.timeout(now - env.now)
            if finished:
                self._finish_tasks(finished)
            if not self._n_steps % self._tl_stride:
                self._sample_timeline(now)
            if ff and not self._inbox:
                t_ff = self._try_fast_forward(now)
                if t_ff > now:
                    now = yield from self._end_stretch(now, t_ff)

    def _end_stretch(self, now: int, t_ff: int):
        """After a fast-forwarded stretch from `now` to `t_ff` (ns): backlog accounting, SimPy's clock caught up
        when another process could act, finished tasks handed back, the timeline sampled; returns `t_ff`."""
        core, env = self.core, self.env
        finished = core.pop_finished()
        if core.deferred:
            self._backlog_ns += t_ff - now
            self._backlog_done += len(finished)
        if env.peek() <= t_ff or (finished and self._has_waiters(finished)):
            yield env.timeout(t_ff - env.now)
        if finished:
            self._finish_tasks(finished)
        if not self._n_steps % self._tl_stride:
            self._sample_timeline(t_ff)
        return t_ff

    @staticmethod
    def _has_waiters(finished: list[Task]) -> bool:
        for t in finished:
            if t.user.done is not None:
                return True
        return False

    def _try_fast_forward(self, now: int) -> int:
        """Fast-forward a stretch of steps starting at `now` (ns) that are certain to be plain decode steps, or
        prompt-chunk steps of one slot with the others decoding; returns its end (`now` if none)."""
        core = self.core
        k, gen = core.decode_horizon()
        prompt = None
        if k >= 1:
            n = len(gen)
            attn0 = n + core.gen_ctx                 # Σ len(tokens) over gen, pending tokens included
            if self.backend.wants_layout:      # the model prices the engine's layout: sequence ids, contexts
                times = self.latency.decode_only_times_s(n, attn0, k, [(s.id, len(s.tokens)) for s in gen])
            else:
                times = self.latency.decode_only_times_s(n, attn0, k)
        else:
            k, gen, p, take = core.prefill_horizon()
            if k < 1:
                return now
            prompt = (p, take)
            times = self.backend.prefill_stretch_times_s([len(s.tokens) for s in gen], len(p.tokens), take, k,
                                                         [s.id for s in gen], p.id)
        return self._stretch(now, k, gen, times, prompt, None)

    def _try_admission(self, now: int) -> int:
        """The step at `now` (ns) as the first of a stretch (`ServerCore.admission_horizon`): the queued tasks
        taken, prompt chunks with the generating slots' decode tokens, then plain decode steps of all of them
        (or prompt-chunk steps of the prompt left unfinished, with those decodes). Returns the stretch's end,
        or `now` when the step must run normally (its queued tasks are then already taken, at `now`, as the
        step itself would have taken them first)."""
        core = self.core
        adm = core.admission_horizon(_s(now))
        if adm is None:
            return now
        gen = adm.gen
        latency = self.latency
        backend = self.backend
        chunks = [(s.id, pos0, take) for s, pos0, take in adm.chunks]
        if self._fast_admission:                     # priced from Σ positions (bit-equal, no StepCost)
            times = [backend.admission_time_s(adm.ops, len(gen), adm.gen_ctx, chunks)]
        else:
            lens = [core.slot_len(s) for s in gen] if self._lazy_tokens else [len(s.tokens) for s in gen]
            times = [latency.step_time_s(backend.admission_cost(adm.ops, lens, [s.id for s in gen], chunks))]
        k = adm.k
        if k > 1:
            # after the first step: every decoding slot one token longer, a prompt chunk's slot at its end
            dec = adm.dec
            q = adm.q
            if q is None and len(dec) == len(gen) + 1 and not backend.wants_layout:   # the common case
                n = len(dec)
                times += latency.decode_only_times_s(n, n + adm.gen_ctx + len(gen) + chunks[-1][1]
                                                     + chunks[-1][2], k - 1)
                return self._stretch(now, k, gen, times, None, adm)
            ctx = {s.id: core.slot_len(s) + 1 for s in gen}
            for sid, pos0, take in chunks:
                ctx[sid] = pos0 + take
            if q is not None:
                times += backend.prefill_stretch_times_s([ctx[s.id] for s in dec], ctx[q.id], adm.q_take, k - 1,
                                                         [s.id for s in dec], q.id)
            else:
                after = [(s.id, ctx[s.id]) for s in dec]
                n = len(dec)
                attn0 = n + sum([c for _, c in after])
                if backend.wants_layout:
                    times += latency.decode_only_times_s(n, attn0, k - 1, after)
                else:
                    times += latency.decode_only_times_s(n, attn0, k - 1)
        return self._stretch(now, k, gen, times, None, adm)

    def _stretch(self, now: int, k: int, gen: list, times: list[float], prompt, admit) -> int:
        """Apply the first steps of a stretch of k steps (durations `times`) starting at `now`, up to the next
        client event and (with a free slot) the next arrival; returns its end (`now` if none)."""
        core = self.core
        t_client = self.env.peek()                   # next client (closed-loop) event; math.inf if none
        if t_client <= now:
            return now
        all_busy = core.n_processing == len(core.slots)
        t_arr = self._next_arrival_ns()
        # step durations in ns exactly as single steps round them (round-half-even, as Python's round)
        if k <= SMALL_STRETCH:
            ends = list(accumulate([round(t * NS) for t in times], initial=now))
            starts = ends[:-1]                       # [k] start of each step
            del ends[0]                              # [k] end of each step
            kk = bisect_left(starts, t_client) if t_client < math.inf else k
            if not all_busy and kk and t_arr <= starts[kk - 1]:   # an arrival would get a slot: stop before it
                kk = bisect_left(starts, t_arr, 0, kk)
        else:
            dts_a = np.rint(np.asarray(times) * NS).astype(np.int64)
            ends_a = now + np.cumsum(dts_a)
            starts = ends_a - dts_a
            kk = int(np.searchsorted(starts, t_client, "left")) if t_client < math.inf else k
            if not all_busy and kk and t_arr <= starts[kk - 1]:
                kk = int(np.searchsorted(starts[:kk], t_arr, "left"))
            ends = ends_a[:kk].tolist()
            starts = starts[:kk].tolist()
        if kk == 0:
            return now
        del ends[kk:]
        arrivals: dict[int, list[Task]] = {}
        if all_busy and t_arr <= starts[kk - 1]:
            # arrivals during the stretch can only be deferred: hand each to the step that first sees it
            for task in self._take_arrivals(starts[kk - 1]):
                arrivals.setdefault(bisect_left(starts, task.user.arrival_ns, 0, kk), []).append(task)
            if self._arr_i == len(self._arrivals):   # deferred at once: all of them wait
                self._backlog_at_last_arrival = (len(core.deferred) + len(core.queue)
                                                 + sum(len(v) for v in arrivals.values()))
        if prompt is None and self._lazy_tokens:     # the core keeps them pending (ServerCore.lazy_tokens)
            self._clock_ns = ends[-1]
            core.fast_forward(gen, None, [e / NS for e in ends], arrivals, None, admit, _s(now))
            self._n_steps += kk
            self._n_ff_steps += kk
            return ends[-1]
        tokens = {}
        for s in (gen if admit is None else admit.dec):          # SimBackend.tokens_for, its common case inlined
            task = s.task
            reply = task.user.reply
            n = len(task.generated)
            tokens[s.id] = reply[n:n + kk] if n + kk <= len(reply) else SimBackend.tokens_for(task, kk)
        eog = self.config.eog_ids
        if eog and self._reply_eog and any(tok in eog for toks in tokens.values() for tok in toks[:-1]):
            self._arr_i -= sum(len(v) for v in arrivals.values())
            return now                               # an EOS inside the stretch: step normally
        self._clock_ns = ends[-1]
        core.fast_forward(gen, tokens, [e / NS for e in ends], arrivals, prompt, admit, _s(now))
        self._n_steps += kk
        self._n_ff_steps += kk
        return ends[-1]

    def _finish_tasks(self, finished: list[Task]) -> None:
        for task in finished:
            req: SimRequest = task.user
            if task.is_child:
                continue
            self._rows.append(self._row(task, req))
            self._n_done += 1
            if self.progress is not None:
                self.progress(self._n_done, self._n_total)
            if req.done is not None:
                req.done.succeed(task)

    def _row(self, task: Task, req: SimRequest) -> dict[str, Any]:
        if req.source is not None:                   # (a lazy prompt is drawn before its task gets a slot)
            raise AssertionError(f"request {req.index} finished with its prompt never drawn")
        arrival = _s(req.arrival_ns)
        first = task.t_prompt_last_s
        n_out = task.n_decoded
        err = task.error
        return {
            "request": req.index, "session_id": req.session_id, "turn": req.turn,
            "arrival_s": arrival,
            "launch_s": task.t_launch_s if task.t_launch_s >= 0 else math.nan,
            "first_token_s": first if first >= 0 else math.nan,
            "end_s": task.t_end_s,
            "slot": task.slot_id,
            "n_prompt": len(task.tokens), "n_cached": task.n_prompt_cached,
            "n_processed": task.n_prompt_processed if err is None else 0,
            "n_output": n_out, "n_output_target": req.n_output_target,
            "queue_s": task.t_launch_s - arrival if task.t_launch_s >= 0 else math.nan,
            "ttft_s": first - arrival if first >= 0 else math.nan,
            "tpot_s": (task.t_gen_last_s - first) / (n_out - 1) if n_out > 1 and first >= 0 else math.nan,
            "e2e_s": task.t_end_s - arrival,
            "finish": "error" if err is not None else task.stop_type,
            "error": err.message if err is not None else None,
            "n_deferred": task.n_deferred, "truncated": task.truncated,
        }

    def _sample_timeline(self, now_ns: int) -> None:
        """One timeline row (the caller samples every `_tl_stride`-th step)."""
        core = self.core
        cache = core.cache
        m = core.metrics
        self._timeline.append({
            "t_s": _s(now_ns), "busy_slots": core.n_processing, "deferred": len(core.deferred),
            "queued": len(core.queue) + len(self._inbox),
            # (an empty cache holds 0 bytes; `if cache` would call PromptCache.__len__ twice)
            "cache_bytes": cache.size_bytes() if cache is not None else 0,
            "cache_entries": len(cache.entries) if cache is not None else 0,
            "cum_prompt_cached": m.n_prompt_tokens_cached_total,
            "cum_prompt_processed": m.n_prompt_tokens_processed_total,
        })
        if len(self._timeline) >= TIMELINE_MAX:
            self._timeline = self._timeline[::2]
            self._tl_stride *= 2

    # ------------------------------------------------------------------ run
    def run(self, workload: Trace | ChatWorkload) -> SimResult:
        env = self.env
        self._ended_early: list[str] = []
        if isinstance(workload, ChatWorkload):
            index0 = 0
            for sess in workload.sessions:
                env.process(self._session(workload, sess, index0))
                index0 += len(sess.turns)
            self._n_total = workload.n_turns
            kind = "closed_loop_chat"
        elif isinstance(workload, Trace):
            reqs = sorted(workload.requests, key=lambda r: (r.arrival_s, r.index))
            self._arrivals = [(round(r.arrival_s * NS), r) for r in reqs]
            self._n_total = len(reqs)
            kind = "open_loop_trace"
        else:
            raise TypeError(f"workload must be a traces.Trace or traces.ChatWorkload, got {type(workload).__name__}")
        self._bind_future(workload)
        wall0 = time.perf_counter()
        server = env.process(self._server())
        # The run makes next to no reference cycles (a few per closed-loop session: SimPy processes), but holds
        # millions of token-list pointers that every collection would traverse again (on Mooncake, young-gen
        # collections cost ~15% of the run). The collector is off during the run, and the objects alive before
        # it (the workload) are frozen out of the collections that follow.
        was_enabled = gc.isenabled()
        gc.freeze()
        gc.disable()
        try:
            env.run(until=server)
        finally:
            if was_enabled:
                gc.enable()
            gc.unfreeze()
        wall = time.perf_counter() - wall0
        core = self.core
        core.sync()
        rows = sorted(self._rows, key=lambda r: r["request"])
        n_err = sum(1 for r in rows if r["finish"] == "error")
        cache = core.cache
        return SimResult(
            requests=rows,
            timeline=self._timeline,
            metrics=core.metrics,
            run={"workload": kind, "n_requests": len(rows), "n_finished": len(rows) - n_err, "n_errors": n_err,
                 "wall_s": wall, "sim_s": _s(env.now), "steps": self._n_steps,
                 "requests_per_wall_s": len(rows) / wall if wall > 0 else math.inf,
                 "steps_per_wall_s": self._n_steps / wall if wall > 0 else math.inf,
                 "fast_forward": self.fast_forward, "ff_steps": self._n_ff_steps,
                 "sessions_ended_early": len(self._ended_early),
                 "load": self._load(kind, len(rows))},
            cache_stats={"evictions": cache.n_evictions if cache else 0, "hits": cache.n_hits if cache else 0,
                         "saves": cache.n_saves if cache else 0, "misses": cache.n_misses if cache else 0,
                         "bytes_saved": cache.bytes_saved if cache else 0,
                         "bytes_loaded": cache.bytes_loaded if cache else 0},
            config=self.describe(),
            recorder=self.recorder,
            sessions_ended_early=self._ended_early,
        )

    def _load(self, kind: str, n_requests: int) -> dict[str, Any]:
        """Offered load against what the server served (open loop): arrival rate, the service rate measured
        while requests waited for a slot (the server's capacity on this workload), how many were still waiting
        when the last one arrived, and whether the queue grew without bound (saturated)."""
        arr = self._arrivals
        out: dict[str, Any] = {"arrival_rps": None, "service_rps": None, "backlog_at_last_arrival": None,
                               "saturated": False}
        if kind != "open_loop_trace" or len(arr) < 2:
            return out
        span = arr[-1][0] - arr[0][0]
        lam = (len(arr) - 1) / _s(span) if span > 0 else math.inf
        mu = self._backlog_done / _s(self._backlog_ns) if self._backlog_ns > 0 else None
        backlog = max(self._backlog_at_last_arrival, 0)
        out.update(arrival_rps=lam, service_rps=mu, backlog_at_last_arrival=backlog)
        # the queue grew without bound: a backlog of at least one slot-full and 5% of the trace when the last
        # request arrived, and requests arriving faster than the server finished them while it was flat out
        out["saturated"] = bool(mu is not None and lam > mu and backlog >= max(len(self.core.slots),
                                                                              0.05 * n_requests))
        return out

    def _bind_future(self, workload: Trace | ChatWorkload) -> None:
        """Give an oracle eviction policy (one with `bind_future`, e.g. Belady) the workload's future."""
        cache = self.core.cache
        bind = getattr(cache.policy, "bind_future", None) if cache is not None else None
        if bind is None:
            return

        if isinstance(workload, ChatWorkload):
            self._future = FutureRequests(chat_requests(workload, self.space, self._reply, self._token_arrays),
                                          self._oracle_clock, by_time=False)
        else:
            self._future = FutureRequests(trace_requests(workload, self.materializer, self._token_arrays),
                                          self._oracle_clock, by_time=True)
        bind(self._future)

    def _oracle_clock(self) -> int:
        """The simulated time (ns) the core's decisions are being taken at: the server's clock while it
        runs ahead of SimPy's (see _server), SimPy's otherwise."""
        return max(self._clock_ns, self.env.now)

    @property
    def now_s(self) -> float:
        """The simulated time in seconds, as the core and the backend see it (during a step: its start).
        `env.now` lags behind it while the server runs steps back to back with no other process to wait for."""
        return _s(max(self._clock_ns, self.env.now))

    def describe(self) -> dict[str, Any]:
        r = self.resolved
        base = {f: getattr(self.config, f) for f in self.config.__dataclass_fields__}
        base["eog_ids"] = sorted(base["eog_ids"])
        base["policies"] = {f: getattr(self.config.policies, f) for f in self.config.policies.__dataclass_fields__}
        return {
            "server": base,
            "resolved": {"n_slots": r.n_slots, "kv_unified": r.kv_unified, "n_ctx": r.n_ctx,
                         "n_ctx_slot": r.n_ctx_slot, "n_batch": r.n_batch, "n_ubatch": r.n_ubatch},
            "latency": self.latency.describe() if self.latency is not None else None,
            "backend": type(self.backend).__name__,
            "seed": self.seed,
            "fast_forward": self.fast_forward,
        }
