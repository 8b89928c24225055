"""y = x @ W.T over `Linear`s, and the only place the forward pass uses threads.

`Matmul` picks a layout by row count and splits products over its threads; the FFN (gate/up, SwiGLU,
down) is one call (`Matmul.ffn`), so its fused one-piece-per-thread form and the row split of the SwiGLU
stay behind the same interface; attention hands its independent blocks to `Matmul.parallel` / `split`.
"""

from __future__ import annotations

import functools
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable

import numpy as np

from engine.model.types import SMALL_M_MAX, Linear

_SPLIT_MIN_MACS = 1 << 19         # smaller products are not worth a thread hand-off (~20 µs)
_SPLIT_ALIGN = 16                 # column split points on 64-byte boundaries
_ELEMENTWISE_ROWS = 64            # rows per task when element-wise work is split over threads
_FUSED_FFN = True                 # FFN of 1..SMALL_M_MAX tokens as one piece per thread (_ffn_split)
_GEMV_PIECES_PER_THREAD = 2       # one-row products: pieces per thread (late workers leave fewer to wait for)

# act(g, u, out): out = silu(g) * u element-wise, the numerics' SwiGLU (out aliases neither g nor u)
SiluMul = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class Matmul:
    """y = x @ W.T for a `Linear`: picks the layout by row count and splits the product over `n_threads`
    threads (the caller plus n_threads - 1 workers; numpy releases the GIL inside BLAS).

    Meant to run with BLAS itself single-threaded: on a machine whose 2 cores are shared, OpenBLAS's own
    threads spin-wait and a step can take 10x longer when another process holds a core. Here the pieces of a
    split go to a shared queue that the caller drains too (`_Workers`): a worker that does not get a core in
    time simply takes no piece, and the step runs at one-thread speed instead of waiting for it.
    """

    def __init__(self, n_threads: int = 1):
        self.n_threads = max(1, int(n_threads))
        self._pool = _Workers(self.n_threads - 1) if self.n_threads > 1 else None

    def __call__(self, lin: Linear, x: np.ndarray) -> np.ndarray:
        """x [M, n_in] -> [M, n_out] float32."""
        m = x.shape[0]
        n_in, n_out = lin.t.shape
        split = self._pool is not None and m * n_in * n_out >= _SPLIT_MIN_MACS
        n_blk = lin.blocks.shape[0]
        if 1 < m <= SMALL_M_MAX and n_blk > 1:
            out = np.empty((n_blk, m, lin.blocks.shape[2]), np.float32)       # [n_blk, M, n_cols]
            self._run(lambda a, b: np.matmul(x, lin.blocks[a:b], out=out[a:b]), n_blk, 1, split)
            return out.transpose(1, 0, 2).reshape(m, n_out)                    # [M, n_out]
        if not split:
            return x @ lin.t                                                   # [M, n_out]
        if m == 1:
            # one row (gemv) is bandwidth-bound: split the input dimension, so that each piece streams a
            # contiguous band of t's rows, and add the partial results (a split by columns reads strided row
            # pieces and measured slower than no split at all)
            cuts = self._cuts(n_in, _SPLIT_ALIGN, self.n_threads * _GEMV_PIECES_PER_THREAD)
            n_pieces = len(cuts) - 1
            parts = np.empty((n_pieces, 1, n_out), np.float32)                # [pieces, 1, n_out]
            self._pool.run([lambda i=i: np.matmul(x[:, cuts[i]:cuts[i + 1]], lin.t[cuts[i]:cuts[i + 1]],
                                                  out=parts[i]) for i in range(n_pieces)])
            return parts.sum(axis=0)                                           # [1, n_out]
        out = np.empty((m, n_out), np.float32)                                 # [M, n_out]
        self._run(lambda a, b: np.matmul(x, lin.t[:, a:b], out=out[:, a:b]), n_out, _SPLIT_ALIGN, split)
        return out

    def ffn(self, gate_up: Linear, down: Linear, x: np.ndarray, act: SiluMul) -> np.ndarray:
        """down(act(gate, up)) with [gate | up] = x @ gate_up.T: the SwiGLU FFN, x [M, n_in] -> [M, n_out].

        With threads and 1..SMALL_M_MAX rows, one piece per thread over a range of hidden units when the
        layouts allow (`_ffn_split`); otherwise gate/up, the SwiGLU (long batches split by rows) and down as
        three steps. Equal up to float32 summation order."""
        n_ff = gate_up.n_out // 2
        m = x.shape[0]
        if (_FUSED_FFN and self.n_threads > 1 and 1 <= m <= SMALL_M_MAX
                and _ffn_splittable(gate_up, down, n_ff)):
            return _ffn_split(gate_up, down, x, n_ff, self, act)
        gu = self(gate_up, x)                                                  # [M, 2 * n_ff]
        h = np.empty((m, n_ff), np.float32)                                    # [M, n_ff]

        def rows(a: int, b: int) -> None:
            act(gu[a:b, :n_ff], gu[a:b, n_ff:], h[a:b])                        # [b-a, n_ff] each

        step = _ELEMENTWISE_ROWS
        if m <= step or self.n_threads == 1:
            rows(0, m)
        else:
            self.parallel([lambda a=a: rows(a, min(m, a + step)) for a in range(0, m, step)])
        return self(down, h)                                                   # [M, n_out]

    def split(self, part: Callable[[int, int], object], n: int, align: int = 1) -> None:
        """part(a, b) over [0, n) cut into n_threads near-equal ranges (bounds multiples of `align`), in
        parallel."""
        self._run(part, n, align, self._pool is not None)

    def _run(self, part: Callable[[int, int], object], n: int, align: int, split: bool) -> None:
        """part(a, b) over [0, n) cut into n_threads aligned ranges, run on the threads."""
        if not split:
            part(0, n)
            return
        cuts = self._cuts(n, align, self.n_threads)
        self._pool.run([lambda i=i: part(cuts[i], cuts[i + 1]) for i in range(len(cuts) - 1)])

    @staticmethod
    @functools.lru_cache(maxsize=1024)              # a model has a handful of shapes; 100+ calls per step
    def _cuts(n: int, align: int, n_pieces: int) -> tuple[int, ...]:
        """Boundaries splitting [0, n) into up to n_pieces near-equal non-empty ranges aligned to `align`."""
        inner = [min(n, round(n * i / n_pieces / align) * align) for i in range(1, n_pieces)]
        return tuple(sorted({0, n, *inner}))

    def parallel(self, tasks: list[Callable[[], object]]) -> None:
        """Run independent tasks on the threads, each thread taking the next task left (give them
        largest first for balance)."""
        if self._pool is None or len(tasks) == 1:
            for task in tasks:
                task()
            return
        self._pool.run(tasks)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class _Run:
    """One `_Workers.run`: the pieces not taken yet, and one message per piece a worker finished."""

    __slots__ = ("todo", "done")

    def __init__(self, tasks: list[Callable[[], object]]):
        self.todo = deque(tasks)
        self.done: queue.SimpleQueue = queue.SimpleQueue()


class _Workers:
    """n persistent daemon threads that share the pieces of a run with the calling thread.

    `run(tasks)` puts the tasks in a queue, wakes up to n workers, and the caller takes tasks from the same
    queue until it is empty (deque.popleft is atomic); then it waits only for the tasks workers actually
    took. A worker that wakes late finds nothing left, so a busy second core costs the wake-up message, not
    a wait: the run degrades to one-thread speed. Exceptions of any task are re-raised in the caller.

    Written instead of using `concurrent.futures.ThreadPoolExecutor` for latency and for that degradation: a
    split matmul is a hand-off and a join, 150+ per decode step, an executor round trip measured ~100 µs here
    against ~55 µs, and a future handed to a thread that does not get a core makes the caller wait for it.
    """

    def __init__(self, n: int):
        self._inboxes = [queue.SimpleQueue() for _ in range(n)]
        for i, inbox in enumerate(self._inboxes):
            threading.Thread(target=self._serve, args=(inbox,), name=f"slotlab-matmul-{i}", daemon=True).start()
        # the threads hold only their inbox: when this object is collected, they are told to exit
        self._finalizer = weakref.finalize(self, _Workers._stop, self._inboxes)

    @staticmethod
    def _stop(inboxes: list[queue.SimpleQueue]) -> None:
        for inbox in inboxes:
            inbox.put(None)

    @staticmethod
    def _serve(inbox: queue.SimpleQueue) -> None:
        while True:
            run = inbox.get()
            if run is None:
                return
            while True:
                try:
                    task = run.todo.popleft()
                except IndexError:
                    break
                try:
                    task()
                except BaseException as e:             # handed to the caller, re-raised there
                    run.done.put(e)
                else:
                    run.done.put(None)

    def run(self, tasks: list[Callable[[], object]]) -> None:
        run = _Run(tasks)
        for inbox in self._inboxes[:len(tasks) - 1]:
            inbox.put(run)
        n_own = 0
        error: BaseException | None = None
        while True:
            try:
                task = run.todo.popleft()
            except IndexError:
                break
            n_own += 1
            try:
                task()
            except BaseException as e:
                error = error or e
        for _ in range(len(tasks) - n_own):            # the tasks the workers took
            result = run.done.get()
            error = error or result
        if error is not None:
            raise error

    def close(self) -> None:
        self._finalizer()                              # runs _stop once


def _ffn_splittable(gate_up: Linear, down: Linear, n_ff: int) -> bool:
    """Both are `Linear`s, the column blocks of gate/up hold whole gate and whole up blocks, and down has
    column blocks."""
    return (isinstance(gate_up, Linear) and isinstance(down, Linear)
            and gate_up.blocks.shape[0] > 1 and n_ff % gate_up.blocks.shape[2] == 0
            and n_ff // gate_up.blocks.shape[2] >= 2 and down.blocks.shape[0] > 1)


def _ffn_split_row(gate_up: Linear, down: Linear, xn: np.ndarray, n_ff: int, mm: Matmul,
                   act: SiluMul) -> np.ndarray:
    """The FFN of one row (decode of a single sequence), one piece per thread.

    Each piece takes a range of the n_ff hidden units: its gate and its up columns of `gate_up.t` (two
    strided views, ~3 KB contiguous per row for SmolLM2 on 2 threads), their SwiGLU, and the matching rows
    (an input band) of `down.t`; the caller adds the partial outputs. One hand-off instead of three (gate/up,
    down, each split over input bands), and no serial SwiGLU between them: the FFN alone ~13% faster on 2
    threads, a decode step ~2% (interleaved A/B). More, narrower pieces measured slower (strided reads), so
    there is one piece per thread."""
    t, td = gate_up.t, down.t                                 # [n_in, 2 * n_ff], [n_ff, n_embd]
    partial: dict[int, np.ndarray] = {}                       # first hidden unit -> [1, n_embd]

    def piece(a: int, b: int) -> None:
        g = xn @ t[:, a:b]                                    # [1, b-a]
        u = xn @ t[:, n_ff + a:n_ff + b]                      # [1, b-a]
        partial[a] = act(g, u, np.empty_like(g)) @ td[a:b]        # [1, n_embd]
    mm.split(piece, n_ff, _SPLIT_ALIGN)
    parts = [partial[a] for a in sorted(partial)]             # a fixed summation order
    y = parts[0]
    for p in parts[1:]:
        y += p
    return y


def _ffn_split(gate_up: Linear, down: Linear, xn: np.ndarray, n_ff: int, mm: Matmul,
               act: SiluMul) -> np.ndarray:
    """act(xn @ Wgate.T, xn @ Wup.T) @ Wdown.T for 1..SMALL_M_MAX rows, one piece per thread.

    Each piece takes a range of the n_ff hidden units: its gate and up column blocks, their SwiGLU, and the
    product with the matching rows (input band) of every Wdown column block; the caller adds the pieces'
    partial outputs. One hand-off per FFN instead of two, and each piece's hidden units stay in its cache.
    Equal to the unfused path up to float32 summation order."""
    if xn.shape[0] == 1:
        return _ffn_split_row(gate_up, down, xn, n_ff, mm, act)
    gb, db = gate_up.blocks, down.blocks                      # [nb, n_in, cols], [nb_d, n_ff, cols_d]
    cols = gb.shape[2]
    n_half = n_ff // cols                                     # gate blocks 0..n_half-1, up blocks n_half..
    m = xn.shape[0]
    partial: dict[int, np.ndarray] = {}                       # first gate block -> [nb_d, M, cols_d]

    def piece(a: int, b: int) -> None:
        g = np.matmul(xn, gb[a:b])                            # [b-a, M, cols]
        u = np.matmul(xn, gb[n_half + a:n_half + b])          # [b-a, M, cols]
        h = act(g, u, np.empty_like(g))
        hm = h.transpose(1, 0, 2).reshape(m, (b - a) * cols)  # [M, (b-a)*cols]: hidden units a*cols..b*cols
        partial[a] = np.matmul(hm, db[:, a * cols:b * cols])
    mm.split(piece, n_half)
    parts = [partial[a] for a in sorted(partial)]             # a fixed summation order
    y = parts[0]
    for p in parts[1:]:
        y += p
    return y.transpose(1, 0, 2).reshape(m, db.shape[0] * db.shape[2])   # [M, n_embd]

