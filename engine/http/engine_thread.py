"""The engine thread: the only thread that touches the serving core, the slots and the KV memory.

Mirrors llama-server's `server_queue::start_loop` (process new tasks -> update_slots -> wait) with the HTTP
side talking to it through queues: handlers post submits, cancels, slot actions and reads into one thread-safe
inbox; results (tokens, progress, final results, errors) go back through each request's asyncio queue with
`loop.call_soon_threadsafe`. Time is `time.monotonic()`.

The engine thread drives the one serving loop (`engine.core.loop.step`) on wall time. Slot actions
(`/slots/{id}?action=save|restore|erase`) are operations of this thread too (`save_slot`, `restore_slot`,
`erase_slot`): they run between steps, on an idle slot (an action on a busy slot waits until the slot is
released, as upstream defers it), and keep the core's record of the slot's tokens and the KV memory in step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.backend import NumpyBackend, SamplingFailed
from engine.core import ServerCore, Step, StepFailed, Task, TokenEvent, step
from engine.core.errors import ErrorType
from engine.core.types import KVOp, SlotState, TaskError
from engine.http.responses import TokenOut, progress_json
from engine.model.kv import KVCacheFull
from engine.model.textstream import TextStream, complete_utf8_prefix_len

log = logging.getLogger("slotlab.engine")

IDLE_WAIT_S = 0.5


class Released(NamedTuple):
    """What one token released to the client: its text, and whether a stream may send it now."""

    text: str
    sendable: bool


class TextHook:
    """The core's `text_hook`: runs the request's TextStream (stop strings, UTF-8 hold-back) per token; what
    each token released comes back in the step's token events."""

    __slots__ = ("stream",)

    def __init__(self, stream: TextStream) -> None:
        self.stream = stream

    def push(self, token: int) -> tuple[str | None, Released]:
        text, word = self.stream.push(token)
        gen = self.stream.generated
        tail = bytes(gen[-4:])
        # upstream sends no partial result for a token that leaves an incomplete UTF-8 character
        sendable = word is not None or complete_utf8_prefix_len(tail) == len(tail)
        return word, Released(text, sendable)


class JobEvent(NamedTuple):
    """What a request's handler receives: kind "token" (data: TokenOut), "progress" (data: the
    prompt_progress dict) or "final" (data None; a failed task has `task.error` set)."""

    kind: str
    index: int          # the result's index in the response (prompt index x n_cmpl + child)
    task: Task
    data: Any = None


class SlotRestoreError(ValueError):
    """A slot state that cannot be restored (the slot has been cleared, as upstream's prompt_clear)."""


class _Msg(NamedTuple):
    """One message to the engine thread's inbox."""

    kind: str                      # submit | cancel | call | slot | wake
    job: "Job | None" = None
    fn: Callable[[], Any] | None = None
    fut: Future | None = None
    slot: int = -1


@dataclass(eq=False)
class Job:
    """One HTTP request: its tasks (one per prompt; n_cmpl children hang off them) and its result queue.

    Events put on `queue` are `JobEvent`s. Task errors arrive as "final" events with `task.error` set.
    """

    loop: asyncio.AbstractEventLoop
    tasks: list[Task]
    make_hook: Callable[[], TextHook]
    n_cmpl: int = 1
    return_progress: bool = False
    want_tokens: bool = True               # False: non-stream without probabilities, finals only
    params: Any = None                     # the request's CompletionParams (for /slots)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    _progress: dict[int, int] = field(default_factory=dict)

    def put(self, event: JobEvent) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:       # the event loop is closed: nobody is listening any more
            pass

    def index_of(self, task: Task) -> int:
        base = task.user[1]
        return base + task.child_index + 1 if task.is_child else base


class Engine:
    """Runs `ServerCore` + `NumpyBackend` in a background thread."""

    def __init__(self, core: ServerCore, backend: NumpyBackend) -> None:
        self.core = core
        self.backend = backend
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._slot_actions: list[_Msg] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slotlab-engine", daemon=True)
        self.n_cancelled_prompt_tokens = 0
        self.n_cancelled_predicted_tokens = 0
        self.n_steps = 0
        self.t_busy_s = 0.0
        self.last_task: list[Task | None] = [None] * len(core.slots)   # per slot: its current or last task
        # sleeping on idle (--sleep-idle-seconds), as server_queue::start_loop: when nothing is to be done and
        # `sleep_idle_s` (>= 0) passed since the last task, `may_sleep()` is asked; True ends the thread
        self.sleep_idle_s = -1.0
        self.may_sleep: Callable[[], bool] | None = None
        self.after_sleep: Callable[[], None] | None = None    # called once the thread has let go of the model
        self.t_last_task = time.monotonic()
        self.slept = False

    # --- called from other threads --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self.inbox.put(_Msg("wake"))
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        self.inbox.put(_Msg("submit", job))

    def cancel(self, job: Job) -> None:
        self.inbox.put(_Msg("cancel", job))

    def call(self, fn: Callable[[], Any], resets_idle: bool = True) -> Future:
        """Run `fn()` in the engine thread between steps; its result (or exception) lands in the Future.
        For reads of the core's state (`/slots`, `/metrics`). A call with `resets_idle=False` does not count as
        a task for the idle timer (upstream's METRICS task, `task_resets_idle_timer`)."""
        fut: Future = Future()
        self.inbox.put(_Msg("call" if resets_idle else "read", fn=fn, fut=fut))
        return fut

    def _slot_call(self, slot_id: int, fn: Callable[[], Any]) -> Future:
        """Like `call`, but waits until slot `slot_id` is idle (upstream defers slot actions on busy slots)."""
        fut: Future = Future()
        self.inbox.put(_Msg("slot", fn=fn, fut=fut, slot=slot_id))
        return fut

    # --- slot actions: the Future gives the result once the slot was idle and the action ran ------------------
    def erase_slot(self, slot_id: int) -> Future:
        """Drop the slot's KV and tokens; the Future gives how many tokens it held."""
        return self._slot_call(slot_id, lambda: self._erase(slot_id))

    def save_slot(self, slot_id: int) -> Future:
        """The slot's tokens and its KV state as bytes: Future of (tokens, state)."""
        def save() -> tuple[list[int], bytes]:
            self.flush_kv_ops()
            return list(self.core.slots[slot_id].tokens), self.backend.seq_state_save(slot_id)
        return self._slot_call(slot_id, save)

    def restore_slot(self, slot_id: int, tokens: list[int], state: bytes) -> Future:
        """Replace the slot's KV with `state` holding `tokens`; Future of the token count. A state that does
        not load clears the slot and raises SlotRestoreError."""
        def restore() -> int:
            self.flush_kv_ops()
            try:
                n = self.backend.seq_state_load(slot_id, state)
                if n != len(tokens):
                    raise SlotRestoreError("the KV state and the token list disagree")
            except (ValueError, KVCacheFull) as e:
                self._erase(slot_id)
                raise SlotRestoreError(str(e)) from None
            self.core.set_slot_tokens(slot_id, tokens)
            return len(tokens)
        return self._slot_call(slot_id, restore)

    def _erase(self, slot_id: int) -> int:
        self.flush_kv_ops()
        n = len(self.core.slots[slot_id].tokens)
        self.backend.apply(KVOp("seq_rm", seq=slot_id, p0=-1, p1=-1))
        self.core.set_slot_tokens(slot_id, [])
        return n

    # --- the loop ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        while not self._stop.is_set():
            try:
                busy = core.has_work()
                self._drain(block=not busy)
                self._run_slot_actions()
                if core.has_work():
                    t0 = time.monotonic()
                    self._step()
                    # a step is not idle time: shift the timer by the step's duration (start_loop does the
                    # same, so that reads which do not reset the timer cannot delay the sleep)
                    now = time.monotonic()
                    self.t_last_task = min(now, self.t_last_task + (now - t0))
                else:
                    self._route_finished(core.pop_finished())     # ended outside a step (cancels)
                    if self._sleep_due() and self.may_sleep is not None and self.may_sleep():
                        # the server dropped its references; let go of ours and end the thread
                        self.slept = True
                        self.core = self.backend = None    # type: ignore[assignment]
                        del core
                        if self.after_sleep is not None:
                            self.after_sleep()
                        return
            except Exception:      # noqa: BLE001 - keep serving; the failing step's tasks were answered
                log.error("engine loop error:\n%s", traceback.format_exc())

    def _sleep_due(self) -> bool:
        return (self.sleep_idle_s >= 0 and not self._slot_actions and not self.core.has_work()
                and time.monotonic() - self.t_last_task >= self.sleep_idle_s)

    def _drain(self, block: bool) -> None:
        timeout = IDLE_WAIT_S
        if self.sleep_idle_s >= 0:      # wake up in time to fall asleep when due
            timeout = min(timeout, max(0.0, self.t_last_task + self.sleep_idle_s - time.monotonic()) + 0.01)
        try:
            msg = self.inbox.get(timeout=timeout) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: _Msg) -> None:
        kind = msg.kind
        now = time.monotonic()
        if kind not in ("read", "wake"):
            self.t_last_task = now
        if kind == "submit":
            job = msg.job
            if job.cancelled:
                return
            for task in job.tasks:
                try:
                    self.core.submit(task, now)
                except Exception as e:  # noqa: BLE001 - the request gets an error instead of waiting forever
                    task.error = TaskError(ErrorType.INVALID_REQUEST if isinstance(e, ValueError)
                                           else ErrorType.SERVER, str(e))
                    task.done = True
                    job.put(JobEvent("final", job.index_of(task), task))
                    continue
                for child in task.children:
                    child.text_hook = job.make_hook()
        elif kind == "cancel":
            self._cancel(msg.job, now)
        elif kind in ("call", "read"):
            self._resolve(msg.fut, msg.fn)
        elif kind == "slot":
            self._slot_actions.append(msg)

    @staticmethod
    def _resolve(fut: Future, fn: Callable[[], Any]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting handler
            fut.set_exception(e)

    def _run_slot_actions(self) -> None:
        if not self._slot_actions:
            return
        waiting = []
        for msg in self._slot_actions:
            if self.core.slots[msg.slot].is_processing:
                waiting.append(msg)
            else:
                self._resolve(msg.fut, msg.fn)
        self._slot_actions = waiting

    def _cancel(self, job: Job, now: float) -> None:
        """The client went away: free its slots and account for what its tasks had already cost."""
        if job.cancelled:
            return
        job.cancelled = True
        for task in job.tasks:
            if not task.done or any(not c.done for c in task.children):
                self.core.cancel(task, now)
            for t in (task, *task.children):
                # what the core's totals already hold for it: prompt tokens once the first token was sampled,
                # generated tokens at release (see docs/http_api.md "metrics and cancelled requests")
                if t.t_prompt_last_s >= 0:
                    self.n_cancelled_prompt_tokens += t.n_prompt_processed
                self.n_cancelled_predicted_tokens += t.n_decoded
                self.backend.release(t)

    def _step(self) -> None:
        core = self.core
        t0 = time.monotonic()
        try:
            st = step(core, self.backend, t0, lambda _: time.monotonic())
        except StepFailed as e:
            self._abort(e.t_s, e.__cause__)
            return
        if st.plan.forwards:
            self.n_steps += 1
            self.t_busy_s += st.t_end_s - t0
        self._route(st)
        if not st.plan.program and core.has_work():
            time.sleep(0.001)       # nothing could run this round (should not happen); do not spin hot

    def _route(self, st: Step) -> None:
        now = st.t_end_s
        extra = st.result.extra or {}
        released: dict[int, list[TokenEvent]] = {}        # task id -> its tokens of this step
        for ev in st.tokens:
            released.setdefault(ev.task.id, []).append(ev)
        for sid, task in st.plan.tasks.items():
            if not isinstance(task.text_hook, TextHook) or task.user is None:
                continue
            job: Job = task.user[0]
            if job.cancelled:
                continue
            info = extra.get(sid)
            if isinstance(info, SamplingFailed) and not task.done:
                task.error = TaskError(ErrorType.SERVER, f"sampling failed: {info.message}")
                self.core.cancel(task, now)
                job.put(JobEvent("final", job.index_of(task), task))
                continue
            self.last_task[sid] = task
            if not job.want_tokens:
                continue
            idx = job.index_of(task)
            if job.return_progress and task.n_decoded == 1:
                self._progress(job, task, len(task.tokens), now)
            for ev in released.get(task.id, ()):
                job.put(JobEvent("token", idx, task, TokenOut(ev.token, ev.out.text, task.n_decoded, info,
                                                              ev.out.sendable)))
        for s in self.core.slots:
            t = s.task
            if t is None or t.user is None or s.state != SlotState.PROCESSING_PROMPT:
                continue
            job = t.user[0]
            if job.return_progress and not job.cancelled:
                self._progress(job, t, len(s.tokens), now)
        self._route_finished(st.finished + self.core.pop_finished())

    def _progress(self, job: Job, task: Task, processed: int, now: float) -> None:
        last = job._progress.get(task.id)
        if last is None:       # the first progress event reports only the cached part (processed == cache)
            last = task.n_prompt_cached
            job.put(JobEvent("progress", job.index_of(task), task, progress_json(task, last, now)))
        if processed != last:
            job.put(JobEvent("progress", job.index_of(task), task, progress_json(task, processed, now)))
        job._progress[task.id] = processed

    def _route_finished(self, finished: list[Task]) -> None:
        for task in finished:
            self.backend.release(task)
            if task.slot_id >= 0:
                self.last_task[task.slot_id] = task
            if task.user is None or task.cancelled:
                continue
            job: Job = task.user[0]
            if not job.cancelled:
                job.put(JobEvent("final", job.index_of(task), task))

    def _abort(self, now: float, exc: BaseException | None) -> None:
        """A forward pass failed (the loop committed its plan as empty): answer every running task with a
        500 and start from empty slots, since what the KV memory holds after a failed call is unknown."""
        log.error("decode failed:\n%s", "".join(traceback.format_exception(exc)) if exc else "")
        core = self.core
        victims = []
        for s in core.slots:
            if s.task is not None:
                top = s.task
                victims.append(top)
        for t in victims:
            if not t.done:
                t.error = TaskError(ErrorType.SERVER, f"decode() failed: {exc}")
                core.cancel(t, now)
                if t.user is not None and not t.user[0].cancelled:
                    t.user[0].put(JobEvent("final", t.user[0].index_of(t), t))
        self.flush_kv_ops()
        self.backend.apply(KVOp("clear"))
        for s in core.slots:
            core.set_slot_tokens(s.id, [])
        self._route_finished(core.pop_finished())

    # --- helpers for slot actions (run in the engine thread) ----------------------------------------------------
    def flush_kv_ops(self) -> None:
        """Apply KV operations the core queued outside a step (releases, cancels) right now.

        The core keeps such operations for the front of its next plan; running them early is equivalent
        and lets slot actions read or replace a sequence's KV directly.
        """
        for op in self.core.take_pending_ops():
            self.backend.apply(op)
