"""A heap reserved and touched once (`--mem-reserve`): the engine's steps and prompt-cache saves then take memory
the process already has, as llama.cpp's forward passes do.

Why. llama.cpp reserves its compute buffers once, for the worst-case graph, when the context is created
(`llama_context::llama_context`, src/llama-context.cpp), so no forward pass asks the system for memory. The
engine's numpy forward pass allocates its temporaries per step. They reuse what the previous step freed until a
prompt-cache save (`KVStore.state_save`, a kept blob of 6-35 MB for SmolLM2) takes that space; the next long
prompt's temporaries then get memory new to the process, and the kernel supplies it page by page inside the
step (2,000-3,000 faults of 4 KiB for a 400-token prompt; on a VM with transparent huge pages about 2 ns a
byte). Which step pays that is a property of the allocator's history, not of the step's shape, so no latency
model can price it (docs/validation_sim.md §16-§20).

What `reserve` does, on glibc (the documented `mallopt(3)` parameters):
- `M_ARENA_MAX` 1: every thread allocates from the main heap (a thread's own arena would be mapped on demand);
- `M_MMAP_MAX` 0: no allocation gets a mapping of its own (glibc maps any block above its mmap threshold, at
  most 32 MiB, afresh and unmaps it on free: new memory on every use);
- `M_TRIM_THRESHOLD` -1: freed memory is never given back to the system;
- then it allocates `mib` MiB, advises it for transparent huge pages (`MADV_HUGEPAGE`, as numpy advises every
  array of 4 MiB or more, so that the memory the steps then use is on the pages the allocator's defaults would
  have given them; on 4 KiB pages the same steps ran 7-14% slower), writes every page, and frees it: the heap's
  top now holds `mib` MiB of memory the process owns, which every later allocation takes from until the heap
  grows past it.

The process's resident memory then stays at its high-water mark (at least `mib`) until it exits. A reserve is
a difference from llama-server, whose prompt-cache states are `std::vector`s from the default allocator
(`server_prompt_cache::alloc`, tools/server/server-task.cpp), so `serve` and `replay` default to `--mem-reserve 0`:
the allocator's defaults. `calibrate` and `validate`, which measure the engine for the simulator, default to 2048
MiB: there the faults are noise no latency model can price (experiments/flags.py `MEASURE_MEM_RESERVE_MIB`,
docs/validation_sim.md §29).
Written here rather than taken from a library: it is four libc calls through ctypes, and no maintained Python
package exposes them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import threading
import time
from dataclasses import dataclass

# mallopt(3) parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
MADV_HUGEPAGE = 14
PAGE, HUGE = 4096, 2 << 20


@dataclass(frozen=True)
class Reservation:
    """What `reserve` did: `mib` reserved in this process so far (0 when not applied), the seconds the last call
    took, and why it did nothing when `applied` is false."""
    mib: int
    seconds: float
    applied: bool
    reason: str = ""

    def describe(self) -> str:
        if self.applied:
            return f"heap reserved and touched: {self.mib} MiB ({self.seconds:.2f} s)"
        return f"heap not reserved ({self.reason})"

    def note(self, requested: int) -> str | None:
        """The line a command prints when `requested` MiB were asked for and nothing was reserved, else None."""
        if not requested or self.applied:
            return None
        return (f"--mem-reserve {requested}: {self.describe()}; the engine's steps may take memory new to the "
                f"process, which the latency model cannot price")


_lock = threading.Lock()
_reserved_mib = 0
_libc: ctypes.CDLL | None = None


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            return None
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.restype = None
        libc.free.argtypes = [ctypes.c_void_p]
        libc.mallopt.restype = ctypes.c_int
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = libc
    return _libc


def heap_mib() -> float | None:
    """The size of the process's main heap in MiB (`[heap]` in /proc/self/maps), None where there is none to read.
    With a reserve, every allocation lives there, so its growth during a run is memory new to the process."""
    total = 0
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                # numpy's huge-page advice on an array inside the heap splits it into several such lines
                if line.rstrip().endswith("[heap]"):
                    lo, hi = line.split(None, 1)[0].split("-")
                    total += int(hi, 16) - int(lo, 16)
    except OSError:
        return None
    return total / 2**20 if total else None


def reserved_mib() -> int:
    """The MiB this process has reserved so far (0: the allocator's defaults)."""
    return _reserved_mib


def reserve(mib: int, huge_pages: bool = True) -> Reservation:
    """Reserve and touch `mib` MiB of heap (see the module's doc), advised for huge pages unless `huge_pages` is
    false. Call it before the engine's threads start allocating (the arena setting applies to threads that have
    not allocated yet). Idempotent: a second call takes new memory only for what exceeds what this process
    reserved already. `mib` 0 does nothing. Raises ValueError for a negative size and MemoryError when the system
    refuses the memory; on a C library other than glibc it does nothing and says why (`Reservation.applied`
    false)."""
    global _reserved_mib
    if mib < 0:
        raise ValueError(f"--mem-reserve: expected a size in MiB >= 0, got {mib}")
    if mib == 0:
        return Reservation(_reserved_mib, 0.0, _reserved_mib > 0, "" if _reserved_mib else "--mem-reserve 0")
    libc = _glibc()
    if libc is None:
        return Reservation(0, 0.0, False, f"needs glibc's mallopt; this is {platform.system()} "
                                          f"{'/'.join(platform.libc_ver()) or 'without glibc'}")
    with _lock:
        t0 = time.perf_counter()
        if _reserved_mib == 0:
            for param, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1)):
                if libc.mallopt(param, value) != 1:
                    return Reservation(0, 0.0, False, f"mallopt({param}, {value}) refused")
        if mib > _reserved_mib:
            n = mib << 20
            p = libc.malloc(n)
            if not p:
                raise MemoryError(f"--mem-reserve {mib}: the system refused {mib} MiB of heap")
            try:
                if huge_pages:      # the 2 MiB-aligned interior; refused (harmless) where THP is "never"
                    lo = (p + HUGE - 1) // HUGE * HUGE
                    if p + n - lo >= HUGE:
                        libc.madvise(lo, (p + n - lo) // HUGE * HUGE, MADV_HUGEPAGE)
                # one write per page is what makes the kernel supply the page; the rest of it costs nothing more
                buf = (ctypes.c_char * n).from_address(p)
                mv = memoryview(buf).cast("B")
                mv[::PAGE] = bytes(n // PAGE)
            finally:
                libc.free(p)
            _reserved_mib = mib
        return Reservation(_reserved_mib, time.perf_counter() - t0, True)
