"""The engine thread: the only thread that touches the serving core, the slots and the KV memory.

Mirrors llama-server's `server_queue::start_loop` (process new tasks -> update_slots -> wait) with the HTTP
side talking to it through queues: handlers post submits, cancels, slot actions and reads into one thread-safe
inbox; results (tokens, progress, final results, errors) go back through each request's asyncio queue with
`loop.call_soon_threadsafe`. Time is `time.monotonic()`.

Slot actions (save/restore/erase) on a busy slot wait until the slot is released, as upstream defers them.
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
from typing import Any

from engine.backend import NumpyBackend, SamplingFailed
from engine.core import ServerCore, StepResult, Task
from engine.core.errors import ErrorType
from engine.core.types import SlotState, TaskError
from engine.http.responses import TokenOut, progress_json
from engine.model.textstream import TextStream, complete_utf8_prefix_len

log = logging.getLogger("slotlab.engine")

IDLE_WAIT_S = 0.5


class TextHook:
    """The core's `text_hook`: runs the request's TextStream (stop strings, UTF-8 hold-back) per token and
    keeps what each token released for the engine thread to forward."""

    __slots__ = ("stream", "pending")

    def __init__(self, stream: TextStream) -> None:
        self.stream = stream
        self.pending: list[tuple[int, str, bool]] = []    # (token, text released, sendable)

    def push(self, token: int) -> str | None:
        text, word = self.stream.push(token)
        gen = self.stream.generated
        tail = bytes(gen[-4:])
        # upstream sends no partial result for a token that leaves an incomplete UTF-8 character
        sendable = word is not None or complete_utf8_prefix_len(tail) == len(tail)
        self.pending.append((token, text, sendable))
        return word


@dataclass(eq=False)
class Job:
    """One HTTP request: its tasks (one per prompt; n_cmpl children hang off them) and its result queue.

    Events put on `queue`: ("token", index, task, TokenOut), ("progress", index, task, dict),
    ("final", index, task, None). Task errors arrive as "final" with `task.error` set.
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

    def put(self, event: tuple) -> None:
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
        self._slot_actions: list[tuple[int, Callable[[], Any], Future]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slotlab-engine", daemon=True)
        self.n_cancelled_prompt_tokens = 0
        self.n_cancelled_predicted_tokens = 0
        self.n_steps = 0
        self.t_busy_s = 0.0
        self.last_task: list[Task | None] = [None] * len(core.slots)   # per slot: its current or last task

    # --- called from other threads --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self.inbox.put(("wake",))
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        self.inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        self.inbox.put(("cancel", job))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` in the engine thread between steps; its result (or exception) lands in the Future."""
        fut: Future = Future()
        self.inbox.put(("call", fn, fut))
        return fut

    def slot_call(self, slot_id: int, fn: Callable[[], Any]) -> Future:
        """Like `call`, but waits until slot `slot_id` is idle (upstream defers slot actions on busy slots)."""
        fut: Future = Future()
        self.inbox.put(("slot", slot_id, fn, fut))
        return fut

    # --- the loop ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        while not self._stop.is_set():
            try:
                busy = core.has_work()
                self._drain(block=not busy)
                self._run_slot_actions()
                if core.has_work():
                    self._step()
                else:
                    self._route_finished()
            except Exception:      # noqa: BLE001 - keep serving; the failing step's tasks were answered
                log.error("engine loop error:\n%s", traceback.format_exc())

    def _drain(self, block: bool) -> None:
        try:
            msg = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        now = time.monotonic()
        if kind == "submit":
            job: Job = msg[1]
            if job.cancelled:
                return
            for task in job.tasks:
                try:
                    self.core.submit(task, now)
                except Exception as e:  # noqa: BLE001 - the request gets an error instead of waiting forever
                    task.error = TaskError(ErrorType.INVALID_REQUEST if isinstance(e, ValueError)
                                           else ErrorType.SERVER, str(e))
                    task.done = True
                    job.put(("final", job.index_of(task), task, None))
                    continue
                for child in task.children:
                    child.text_hook = job.make_hook()
        elif kind == "cancel":
            self._cancel(msg[1], now)
        elif kind == "call":
            fn, fut = msg[1], msg[2]
            self._resolve(fut, fn)
        elif kind == "slot":
            self._slot_actions.append((msg[1], msg[2], msg[3]))

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
        for slot_id, fn, fut in self._slot_actions:
            if self.core.slots[slot_id].is_processing:
                waiting.append((slot_id, fn, fut))
            else:
                self._resolve(fut, fn)
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
        plan = core.schedule(t0)
        if plan.program:
            try:
                result = self.backend.execute(plan)
            except Exception as e:  # noqa: BLE001
                self._abort(plan, e)
                return
        else:
            result = StepResult(0.0, {})
        t1 = time.monotonic()
        core.commit(plan, result, t1)
        if plan.forwards:
            self.n_steps += 1
            self.t_busy_s += t1 - t0
        self._route(plan, result, t1)
        if not plan.program and core.has_work():
            time.sleep(0.001)       # nothing could run this round (should not happen); do not spin hot

    def _route(self, plan, result: StepResult, now: float) -> None:
        extra = result.extra or {}
        for sid, task in plan.tasks.items():
            hook = task.text_hook
            if not isinstance(hook, TextHook) or task.user is None:
                continue
            job: Job = task.user[0]
            pending, hook.pending = hook.pending, []
            if job.cancelled:
                continue
            info = extra.get(sid)
            if isinstance(info, SamplingFailed) and not task.done:
                task.error = TaskError(ErrorType.SERVER, f"sampling failed: {info.message}")
                self.core.cancel(task, now)
                job.put(("final", job.index_of(task), task, None))
                continue
            self.last_task[sid] = task
            if not job.want_tokens:
                continue
            idx = job.index_of(task)
            if job.return_progress and task.n_decoded == 1:
                self._progress(job, task, len(task.tokens), now)
            for tok, text, sendable in pending:
                job.put(("token", idx, task, TokenOut(tok, text, task.n_decoded, info, sendable)))
        for s in self.core.slots:
            t = s.task
            if t is None or t.user is None or s.state != SlotState.PROCESSING_PROMPT:
                continue
            job = t.user[0]
            if job.return_progress and not job.cancelled:
                self._progress(job, t, len(s.tokens), now)
        self._route_finished()

    def _progress(self, job: Job, task: Task, processed: int, now: float) -> None:
        last = job._progress.get(task.id)
        if last is None:       # the first progress event reports only the cached part (processed == cache)
            last = task.n_prompt_cached
            job.put(("progress", job.index_of(task), task, progress_json(task, last, now)))
        if processed != last:
            job.put(("progress", job.index_of(task), task, progress_json(task, processed, now)))
        job._progress[task.id] = processed

    def _route_finished(self) -> None:
        for task in self.core.pop_finished():
            self.backend.release(task)
            if task.slot_id >= 0:
                self.last_task[task.slot_id] = task
            if task.user is None or task.cancelled:
                continue
            job: Job = task.user[0]
            if not job.cancelled:
                job.put(("final", job.index_of(task), task, None))

    def _abort(self, plan, exc: Exception) -> None:
        """A forward pass failed: answer every running task with a 500 and start from empty slots."""
        log.error("decode failed:\n%s", "".join(traceback.format_exception(exc)))
        core = self.core
        now = time.monotonic()
        core.commit(plan, StepResult(0.0, {}), now)
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
                    t.user[0].put(("final", t.user[0].index_of(t), t, None))
        self.flush_kv_ops()
        self.backend.kv.clear()
        for s in core.slots:
            reset_slot_tokens(core, s.id)

    # --- helpers for slot actions (run in the engine thread) ----------------------------------------------------
    def flush_kv_ops(self) -> None:
        """Apply KV operations the core queued outside a step (releases, cancels) right now.

        The core keeps such operations for the front of its next plan; running them early is equivalent
        and lets slot actions read or replace a sequence's KV directly.
        """
        for op in self.core.take_pending_ops():
            self.backend.apply(op)


def reset_slot_tokens(core: ServerCore, slot_id: int, tokens: list[int] | None = None) -> None:
    """Set what a slot's KV holds after the engine changed it directly (slot restore, abort).

    The slot must be idle (slot actions wait for a busy slot; an abort has released every slot).
    """
    core.set_slot_tokens(slot_id, list(tokens or []))
