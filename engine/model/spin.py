"""Worker threads that wait for compiled kernels by polling, the way ggml's CPU threadpool waits.

Why: a split product handed to a Python worker thread (`matmul._Workers`) pays three wake-ups on this kind of
VM, each ~20-55 µs: the worker's queue, the worker taking the GIL while the caller runs Python, and the join. A
one-row decode product takes 36-100 µs on one thread, so splitting it made it slower (docs/engine.md). ggml's own
pool does not sleep between the operations of a graph: its threads poll a shared counter
(`ggml_graph_compute_poll_for_work`, `ggml_barrier` in ggml/src/ggml-cpu/ggml-cpu.c). `SpinPool` does the same
for the numba kernels of the "ggml" and "q" numerics: its workers sit in a compiled loop without the GIL and take
pieces of a posted job by compare-and-swap.

Protocol (all shared words are int64 in `ctl`, each on its own 64-byte line; loads acquire, stores release,
read-modify-writes sequentially consistent):

- the caller writes a job's arguments (array addresses and shapes, `job`; piece ranges, `cuts`), sets DONE = 0,
  then publishes CLAIM = seq << 24 | n_pieces << 12 | 0;
- anyone (the caller included) claims piece `next` by CAS(CLAIM, w, w + 1) while next < n_pieces, runs it and
  adds 1 to DONE; arguments are read only after a successful claim, and a job cannot complete while one of its
  pieces is claimed and not done, so a claimant always reads the arguments of the job it claimed in;
- the caller waits only until DONE == n_pieces. Every piece is claimed by a running thread, and the caller
  claims all that are left, so the wait is at most one piece long and never depends on a worker waking up: a
  worker without a core costs nothing (the caller does its pieces), as with `_Workers`;
- a worker that found nothing to claim for `spin_us` goes to sleep, unless HOLD is set: it stores STATE = SLEEPING
  and returns to Python, where it blocks on its queue. A compiled caller, which cannot post wake-up tokens, wakes
  the sleepers from Python before its step and sets HOLD for the step's duration (its serial stretches, norms,
  quantizers, RoPE, can outlast the spin budget). A caller that sees SLEEPING when posting swaps it to WAKING and puts one
  token in that queue; the worker stores AWAKE when it enters the loop again. A job published while a worker
  falls asleep is simply done without it.

One caller at a time (a lock; a second thread that finds the pool taken runs its kernel inline). A kernel that
raises in a worker is recorded (ERROR) and the caller raises after the join.

Written here rather than taken from a library: numba's own threading layers (`parallel=True`) split statically
and wait for every thread, which on a shared 2-core machine measured 3x slower decode under load
(`quant.USE_NUMBA_THREADS`), and no library offers lock-free claiming of numba kernel calls.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from typing import Any

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# --- atomics and pointers (LLVM instructions through numba intrinsics) -------------------------------------


def _elem_ptr(context: Any, builder: Any, aryty: Any, ary: Any, idx: Any) -> Any:
    a = context.make_array(aryty)(context, builder, ary)
    return cgutils.get_item_pointer(context, builder, aryty, a, [idx], wraparound=False)


def _int64_array(arr: Any) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1


@intrinsic
def _load(typingctx, arr, i):
    """arr[i] read with acquire ordering (arr int64[:])."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.load_atomic(p, "acquire", 8)
    return types.int64(arr, i), codegen


@intrinsic
def _store(typingctx, arr, i, v):
    """arr[i] = v, a sequentially consistent store (at least the release ordering the publishers need)."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
        val = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store_atomic(val, p, "seq_cst", 8)
        return context.get_dummy_value()
    return types.void(arr, i, v), codegen


@intrinsic
def _cas(typingctx, arr, i, expected, new):
    """Compare-and-swap arr[i] from `expected` to `new`; True if it swapped."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
        e = context.cast(builder, args[2], sig.args[2], types.int64)
        n = context.cast(builder, args[3], sig.args[3], types.int64)
        res = builder.cmpxchg(p, e, n, "seq_cst", "seq_cst")
        return builder.extract_value(res, 1)
    return types.boolean(arr, i, expected, new), codegen


@intrinsic
def _add(typingctx, arr, i, v):
    """arr[i] += v atomically; returns the old value."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
        val = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", p, val, "seq_cst")
    return types.int64(arr, i, v), codegen


@intrinsic
def _pause(typingctx):
    """The x86 spin-wait hint (`pause`, what ggml's `ggml_thread_cpu_relax` issues)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                            "llvm.x86.sse2.pause")
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _cycles(typingctx):
    """llvm.readcyclecounter (rdtsc: a constant-rate counter on x86-64)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])
    return types.int64(), codegen


@intrinsic
def address(typingctx, arr):
    """The address of arr's first element, as an int64."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.ptrtoint(a.data, ir.IntType(64))
    return types.int64(arr), codegen


@intrinsic
def _voidptr(typingctx, addr):
    """An int64 address as a void pointer (for `numba.carray`)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(addr), codegen


# --- control words -------------------------------------------------------------------------------------------

CLAIM = 0           # seq << 24 | n_pieces << 12 | next piece
DONE = 8            # pieces done of the current job
STOP = 16           # 1: workers leave their loop for good
ERROR = 24          # 1: a piece raised (the caller raises after the join)
HOLD = 32           # 1: awake workers do not fall asleep (a compiled caller's step, which cannot wake them)
STATE = 40          # + 8 * worker: AWAKE, SLEEPING or WAKING
CTL_SIZE = STATE + 8 * 64
MAX_WORKERS = 64
AWAKE, SLEEPING, WAKING = 0, 1, 2
_LOW12 = (1 << 12) - 1
MAX_PIECES = _LOW12
JOB_SIZE = 64       # argument words of a job
_YIELD_SPINS = 1 << 14   # a caller that waited this many pauses for a worker's piece yields its core


@njit(cache=True, nogil=True, inline="always")
def _claim(ctl):
    """The next piece of the current job, claimed for this thread, or -1 when none is left."""
    while True:
        w = _load(ctl, CLAIM)
        nxt = w & _LOW12
        if nxt >= (w >> 12) & _LOW12:
            return -1
        if _cas(ctl, CLAIM, w, w + 1):
            return nxt


@njit(cache=True, nogil=True)
def serve(ctl, job, cuts, me, spin_cycles, piece):
    """A worker's loop: claim and run pieces until nothing was posted for spin_cycles (and HOLD is 0), then
    SLEEPING.
    `piece(job address, cuts address, i) -> 0, or nonzero if the piece failed` is the job module's piece runner as a
    C function (`spinjobs.piece_c`), called through its address: the kernels are compiled once, in it, and not again
    into every loop that runs pieces."""
    _store(ctl, STATE + 8 * me, AWAKE)
    ja = address(job)
    ca = address(cuts)
    t_last = _cycles()
    while True:
        i = _claim(ctl)
        if i >= 0:
            if piece(ja, ca, i) != 0:
                _store(ctl, ERROR, 1)
            _add(ctl, DONE, 1)
            t_last = _cycles()
            continue
        if _load(ctl, STOP) != 0:
            return
        if _cycles() - t_last > spin_cycles and _load(ctl, HOLD) == 0:
            _store(ctl, STATE + 8 * me, SLEEPING)
            return
        _pause()


@njit(cache=True, nogil=True)
def work_join(ctl, job, cuts, n, piece):
    """The caller's part of a published job: claim pieces until none is left, then wait for the others'. Returns
    False if it gave up waiting after _YIELD_SPINS pauses (the caller yields its core and calls `wait` again:
    a worker holding a piece was descheduled)."""
    ja = address(job)
    ca = address(cuts)
    while True:
        i = _claim(ctl)
        if i < 0:
            break
        if piece(ja, ca, i) != 0:
            _store(ctl, ERROR, 1)
        _add(ctl, DONE, 1)
    return wait(ctl, n)


@njit(cache=True, nogil=True)
def wait(ctl, n):
    """Spin until DONE == n (True), or False after _YIELD_SPINS pauses."""
    for _ in range(_YIELD_SPINS):
        if _load(ctl, DONE) >= n:
            return True
        _pause()
    return _load(ctl, DONE) >= n


@njit(cache=True, nogil=True)
def publish_quiet(ctl, n_pieces):
    """Publish the job whose arguments are written: DONE = 0, CLAIM = next seq with n_pieces. Sleeping workers are
    left asleep (the job is done without them): what compiled callers use, which cannot post wake-up tokens."""
    _store(ctl, DONE, 0)
    seq = (_load(ctl, CLAIM) >> 24) + 1
    _store(ctl, CLAIM, (seq << 24) | (n_pieces << 12))


@njit(cache=True, nogil=True)
def claim_sleepers(ctl, n_workers):
    """Swap every SLEEPING worker to WAKING; returns their mask (each needs one token in its queue)."""
    mask = 0
    for w in range(n_workers):
        if _load(ctl, STATE + 8 * w) == SLEEPING and _cas(ctl, STATE + 8 * w, SLEEPING, WAKING):
            mask |= 1 << w
    return mask


@intrinsic
def _sched_yield(typingctx):
    """The C library's sched_yield(), called by name (the JIT links it from the process, as it links libm's
    functions), so that compiled callers can give their core to a descheduled worker without returning to
    Python; a ctypes function would keep numba from caching them."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        return builder.sext(builder.call(fn, []), ir.IntType(64))
    return types.int64(), codegen


@njit(cache=True, nogil=True)
def yield_core():
    """`_sched_yield` (tests call it from Python)."""
    return _sched_yield()


@njit(cache=True, nogil=True)
def run_compiled(ctl, job, cuts, n, piece):
    """The caller's part of a published job (`SpinPool.run`, and compiled callers): `work_join`, then, while a
    claimed piece is still running after _YIELD_SPINS pauses, yield the core and wait again."""
    if not work_join(ctl, job, cuts, n, piece):
        while not wait(ctl, n):
            _sched_yield()


@njit(cache=True, nogil=True)
def set_cuts(cuts, n, align, n_pieces):
    """cuts[2i], cuts[2i+1] = the i-th of n_pieces near-equal ranges of [0, n) with bounds multiples of align
    (empty ranges dropped). Returns the number of pieces."""
    k = 0
    prev = 0
    for i in range(1, n_pieces + 1):
        b = n if i == n_pieces else min(n, ((n * i // n_pieces + align // 2) // align) * align)
        if b > prev:
            cuts[2 * k] = prev
            cuts[2 * k + 1] = b
            k += 1
            prev = b
    return k


def tsc_hz() -> float:
    """Rate of `_cycles` (rdtsc), measured over ~5 ms against time.perf_counter."""
    c0, t0 = _cycles_now(), time.perf_counter()
    time.sleep(0.005)
    c1, t1 = _cycles_now(), time.perf_counter()
    return max(1e6, (c1 - c0) / (t1 - t0))


@njit(cache=True, nogil=True)
def _cycles_now():
    return _cycles()


_tsc: float | None = None
_SPIN_US = float(os.environ.get("SLOTLAB_SPIN_US", "2000"))


class SpinPool:
    """n_workers threads that poll for pieces of jobs; `run(post_args)` is called by one caller at a time.

    `piece` is a job module's piece runner as a C function (`spinjobs.piece_c()`): `serve` and `work_join` call it
    by address. The caller writes the job (`job` argument words, `cuts` piece ranges), then calls `run(n_pieces)`
    holding `lock`."""

    def __init__(self, n_workers: int, piece: Any, spin_us: float | None = None):
        global _tsc
        if not 1 <= n_workers <= MAX_WORKERS:
            raise ValueError(f"SpinPool: 1..{MAX_WORKERS} workers, not {n_workers}")
        if _tsc is None:
            _tsc = tsc_hz()
        self.n_workers = n_workers
        self.ctl = np.zeros(CTL_SIZE, np.int64)
        self.ctl[STATE:STATE + 8 * n_workers:8] = SLEEPING
        self.job = np.zeros(JOB_SIZE, np.int64)
        self.jobf = np.zeros(8, np.float64)
        self.cuts = np.zeros(2 * MAX_PIECES, np.int64)
        self.lock = threading.Lock()
        self.piece = piece
        spin_cycles = int((_SPIN_US if spin_us is None else spin_us) * 1e-6 * _tsc)
        # compile both loops here (not in a worker's first wake-up): serve returns at once with a negative budget
        serve(self.ctl, self.job, self.cuts, 0, -1, piece)
        work_join(self.ctl, self.job, self.cuts, 0, piece)
        self._inboxes = [queue.SimpleQueue() for _ in range(n_workers)]
        self.threads = [threading.Thread(target=SpinPool._worker, args=(piece, self.ctl, self.job, self.cuts,
                                                                        i, spin_cycles, inbox),
                                         name=f"slotlab-spin-{i}", daemon=True)
                        for i, inbox in enumerate(self._inboxes)]
        for t in self.threads:
            t.start()
        self._finalizer = weakref.finalize(self, SpinPool._stop, self.ctl, self._inboxes)

    @staticmethod
    def _worker(piece: Any, ctl: np.ndarray, job: np.ndarray, cuts: np.ndarray, me: int, spin_cycles: int,
                inbox: queue.SimpleQueue) -> None:
        while True:
            if inbox.get() is None:
                return
            serve(ctl, job, cuts, me, spin_cycles, piece)
            if ctl[STOP]:
                return

    @staticmethod
    def _stop(ctl: np.ndarray, inboxes: list[queue.SimpleQueue]) -> None:
        ctl[STOP] = 1
        for inbox in inboxes:
            inbox.put(None)

    def run(self, n_pieces: int) -> None:
        """Publish the written job and take part in it until all n_pieces are done (caller holds `lock`)."""
        ctl = self.ctl
        ctl[ERROR] = 0
        publish_quiet(ctl, n_pieces)
        self.wake()
        run_compiled(ctl, self.job, self.cuts, n_pieces, self.piece)
        if ctl[ERROR]:
            raise RuntimeError("a compiled kernel raised in a SpinPool worker")

    def try_run(self, post: Any, n_pieces: int) -> bool:
        """Write a job by `post(job, cuts, n_pieces)` (returning the pieces it wrote) and run it, unless another
        thread holds the pool: then False, and the caller runs its product the usual way."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            self.run(post(self.job, self.cuts, n_pieces))
        finally:
            self.lock.release()
        return True

    def wake(self) -> None:
        """Post a wake-up token to every sleeping worker (caller holds `lock`): after `run` publishes a job, and before
        a compiled caller publishes its jobs with `publish_quiet`, which leaves sleepers asleep."""
        mask = claim_sleepers(self.ctl, self.n_workers)
        if mask:
            for w in range(self.n_workers):
                if mask >> w & 1:
                    self._inboxes[w].put(True)

    def close(self) -> None:
        self._finalizer()

    def state(self) -> list[int]:
        """Each worker's AWAKE / SLEEPING / WAKING (for tests)."""
        return [int(s) for s in self.ctl[STATE:STATE + 8 * self.n_workers:8]]


@njit(cache=True, nogil=True, inline="always")
def f32_at(addr, shape):
    """The C-contiguous float32 array at `addr` (from `address`)."""
    return carray(_voidptr(addr), shape, np.float32)


@njit(cache=True, nogil=True, inline="always")
def u8_at(addr, shape):
    return carray(_voidptr(addr), shape, np.uint8)


@njit(cache=True, nogil=True, inline="always")
def u16_at(addr, shape):
    return carray(_voidptr(addr), shape, np.uint16)


@njit(cache=True, nogil=True, inline="always")
def i8_at(addr, shape):
    return carray(_voidptr(addr), shape, np.int8)


@njit(cache=True, nogil=True, inline="always")
def i64_at(addr, shape):
    return carray(_voidptr(addr), shape, np.int64)
