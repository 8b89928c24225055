"""engine/model/heap.py: `--mem-reserve` makes later allocations, from any thread and of any size, take memory the
process already touched. The reserve changes the allocator for the whole process, so each case runs in a child."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from engine.model.heap import Reservation, heap_mib, reserve
from experiments.replay import heap_growth_warning

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="the reserve needs glibc's mallopt")

# A 40 MiB array: above glibc's largest dynamic mmap threshold (32 MiB), so by default it gets a mapping of its
# own, new to the process; with the reserve it must come from the touched heap. Allocated from a thread that
# starts after the reserve, as the engine's workers do.
_CHILD = r"""
import json, resource, sys, threading
import numpy as np
from engine.model.heap import heap_mib, reserve
mib = int(sys.argv[1])
r = reserve(mib)
out = {"applied": r.applied, "mib": r.mib, "heap_before": heap_mib()}
def work():
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.empty(40 << 20, np.uint8)
    a[::4096] = 1
    out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    addr = a.ctypes.data
    with open("/proc/self/maps") as f:      # numpy's huge-page advice may split the heap into several lines
        heap = [[int(x, 16) for x in l.split()[0].split("-")] for l in f if l.rstrip().endswith("[heap]")]
    out["in_heap"] = bool(heap) and min(lo for lo, _ in heap) <= addr and addr + a.nbytes <= max(hi for _, hi in heap)
    del a
t = threading.Thread(target=work); t.start(); t.join()
with open("/proc/self/smaps") as f:       # the flags of the heap's mappings ("hg": advised for huge pages)
    flags, in_heap = [], False
    for line in f:
        if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:
            in_heap = line.rstrip().endswith("[heap]")
        elif in_heap and line.startswith("VmFlags:"):
            flags.append(line.split()[1:])
out["huge_advised"] = any("hg" in fl for fl in flags)
out["again"] = reserve(mib).seconds
out["heap_after"] = heap_mib()
print(json.dumps(out))
"""


def _child(mib: int) -> dict:
    res = subprocess.run([sys.executable, "-c", _CHILD, str(mib)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@glibc
def test_with_a_reserve_a_thread_s_large_array_comes_from_the_touched_heap_without_page_faults():
    on = _child(128)
    assert on["applied"] and on["mib"] == 128
    assert on["heap_before"] >= 128
    assert on["in_heap"]
    # 40 MiB written one byte a page is 10,240 pages new to a process without the reserve; with it, none should be
    # new (a few faults of the interpreter's own are allowed)
    assert on["faults"] < 256, on
    assert on["heap_after"] - on["heap_before"] < 1          # the array did not grow the heap: it was reserved
    assert on["again"] < 0.05                                # a second reserve of the same size touches nothing
    # advised for transparent huge pages, as numpy advises the fresh mappings it would otherwise get (4 KiB pages
    # made the engine's steps 7-14% slower: docs/validation_sim.md §20); a kernel without THP refuses the advice
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        assert on["huge_advised"]


@glibc
def test_without_a_reserve_the_same_array_is_memory_new_to_the_process():
    off = _child(0)                 # the control: what the first test rules out does happen by default
    assert not off["applied"] and off["mib"] == 0
    assert not off["in_heap"]
    assert not off["huge_advised"]


def test_a_negative_reserve_is_refused_and_zero_does_nothing():
    with pytest.raises(ValueError, match="--mem-reserve"):
        reserve(-1)
    r = reserve(0)
    assert isinstance(r, Reservation) and r.seconds == 0.0
    assert "not reserved" in r.describe() or "reserved" in r.describe()


def test_heap_mib_reads_this_process_s_heap():
    size = heap_mib()
    if platform.system() == "Linux":
        assert size is not None and size > 0


def test_a_run_whose_heap_grew_past_the_reserve_is_warned_about():
    msg = heap_growth_warning(1100.0, 1350.0, 1024)
    assert msg and "grew by 250 MiB" in msg and "--mem-reserve 1024" in msg
    assert heap_growth_warning(1100.0, 1100.5, 1024) is None     # glibc's own bookkeeping
    assert heap_growth_warning(100.0, 900.0, 0) is None          # no reserve: growth is the default allocator's
    assert heap_growth_warning(None, 900.0, 1024) is None


def test_a_reserve_asked_for_and_not_applied_is_noted_and_nothing_else_is():
    refused = Reservation(0, 0.0, False, "needs glibc's mallopt; this is Darwin")
    note = refused.note(64)
    assert note and "--mem-reserve 64" in note and "needs glibc's mallopt; this is Darwin" in note
    assert refused.note(0) is None                                   # nothing was asked for
    assert Reservation(64, 0.1, True).note(64) is None               # it was applied
