"""The sweep runner shared by `slotlab compare` and `slotlab study`: run `fn(item, shared)` for many items on
a local process pool (`jobs`), in this process (`jobs=1`), or on Dask distributed (a `LocalCluster` or an
existing scheduler), with the same code. Shared data (the workloads) is built once and shipped once per
worker; results stream back as items finish.

`run_cells` adds resumability: each cell's result is a small JSON file under a hash of its full config
(`cell_key`), written as soon as the cell finishes, so a rerun skips finished cells, a failed cell is
recorded with its error while the others go on, and Ctrl-C loses at most the cells that were running.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CELL_FORMAT = 1


class SweepError(ValueError):
    """A sweep cannot start (e.g. the Dask scheduler is unreachable): reported before anything is written."""


# --- executing ---------------------------------------------------------------------------------------

_SHARED: Any = None   # in pool workers: the shared data, set once by the initializer


def _init_worker(shared: Any) -> None:
    global _SHARED
    _SHARED = shared


def _call_shared(fn: Callable[[Any, Any], Any], item: Any) -> Any:
    return fn(item, _SHARED)


def _call_with(fn: Callable[[Any, Any], Any], item: Any, shared: Any) -> Any:
    return fn(item, shared)


def connect_dask(address: str, jobs: int) -> Any:
    """A `distributed.Client`: "local" starts a LocalCluster of `jobs` single-threaded worker processes;
    anything else is a scheduler address (tcp://HOST:8786). Unreachable -> SweepError."""
    try:
        from distributed import Client, LocalCluster
    except ImportError as e:  # pragma: no cover - a dependency of the project
        raise SweepError(f"--dask needs the 'distributed' package: {e}") from None
    if address == "local":
        cluster = LocalCluster(n_workers=max(1, jobs), threads_per_worker=1, processes=True,
                               dashboard_address=None)
        client = Client(cluster)
        client._slotlab_cluster = cluster
        return client
    try:
        return Client(address, timeout="3s")
    except (OSError, TimeoutError) as e:
        raise SweepError(f"cannot reach the Dask scheduler at {address}: {e}") from None


def close_dask(client: Any) -> None:
    """Close a client from `connect_dask` (and the LocalCluster it started)."""
    if client is None:
        return
    cluster = getattr(client, "_slotlab_cluster", None)
    client.close()
    if cluster is not None:
        cluster.close()


def execute(items: Sequence[Any], fn: Callable[[Any, Any], Any], shared: Any, *, jobs: int = 1,
            dask: Any = None) -> Iterable[tuple[int, Any, BaseException | None]]:
    """Yield (index, result, error) for every item as it finishes (any order).

    `fn(item, shared)` must be a module-level function (it is pickled by reference). `dask`: a
    `distributed.Client` (its workers get `shared` once, by scatter with broadcast), else a process pool
    of `jobs` workers (each gets `shared` once, through its initializer), else this process (`jobs <= 1`).
    """
    if not items:
        return
    if dask is not None:
        from distributed import as_completed as dask_completed

        [shared_f] = dask.scatter([shared], broadcast=True, hash=False)   # a list: one future for it all
        futures = {dask.submit(_call_with, fn, item, shared_f, pure=False): i for i, item in enumerate(items)}
        try:
            for fut in dask_completed(futures):
                i = futures[fut]
                try:
                    yield i, fut.result(), None
                except Exception as e:      # the cell's own exception, re-raised by Dask
                    yield i, None, e
        finally:
            dask.cancel(list(futures))
        return
    if jobs <= 1 or len(items) == 1:
        for i, item in enumerate(items):
            try:
                yield i, fn(item, shared), None
            except Exception as e:         # one failed item must not lose the others
                yield i, None, e
        return
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(items)), initializer=_init_worker, initargs=(shared,))
    try:
        futures = {pool.submit(_call_shared, fn, item): i for i, item in enumerate(items)}
        for fut in as_completed(futures):
            i = futures[fut]
            try:
                yield i, fut.result(), None
            except Exception as e:
                yield i, None, e
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# --- resumable cells ---------------------------------------------------------------------------------


def cell_key(config: Mapping[str, Any]) -> str:
    """The hash of a cell's full config (canonical JSON): its file name in the cell store."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True, slots=True)
class Cell:
    key: str
    config: dict[str, Any]       # everything that determines the result (hashed into `key`)
    shared_key: str              # which entry of the shared data (workload) the cell runs on


class CellStore:
    """One JSON file per finished cell: `<dir>/<key>.json` = {"key", "config", "status", "row"}."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def _file(self, key: str) -> Path:
        return self.path / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        try:
            return json.loads(self._file(key).read_text())
        except (OSError, ValueError):
            return None

    def put(self, key: str, record: Mapping[str, Any]) -> None:
        """Atomic: a cell interrupted while writing leaves no partial file."""
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(_finite(record), sort_keys=True) + "\n")
        os.replace(tmp, self._file(key))


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_cells(cells: Sequence[Cell], fn: Callable[[dict[str, Any], Any], dict[str, Any]],
              shared: Mapping[str, Any], store: CellStore, *, jobs: int = 1, dask: Any = None,
              progress: bool = True, desc: str = "cells",
              log: Callable[[str], None] | None = None) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Run every cell not already finished in `store`; return (records in `cells` order, counts).

    `fn(config, workload)` returns the cell's metrics; a cell that raises is stored with status
    "error: ..." (and its traceback) and is run again by the next call. counts: total, skipped (already
    finished), ran, failed.
    """
    from tqdm import tqdm

    log = log or (lambda msg: print(msg, file=sys.stderr))
    records: list[dict[str, Any] | None] = [None] * len(cells)
    todo: list[int] = []
    for i, c in enumerate(cells):
        rec = store.get(c.key)
        if rec is not None and rec.get("status") == "ok":
            records[i] = rec
        else:
            todo.append(i)
    n_skip = len(cells) - len(todo)
    if n_skip:
        log(f"{desc}: {n_skip} of {len(cells)} cells already finished (skipped); running {len(todo)}")
    # ship each worker only the workloads its cells need
    needed = {cells[i].shared_key for i in todo}
    shared_sub = {k: v for k, v in shared.items() if k in needed}
    items = [(cells[i].config, cells[i].shared_key) for i in todo]
    n_failed = 0
    bar = tqdm(total=len(cells), initial=n_skip, unit="cell", desc=desc, disable=not progress, file=sys.stderr,
               smoothing=0.1, dynamic_ncols=True)
    with bar:
        for j, row, exc in execute(items, _run_cell, (fn, shared_sub), jobs=jobs, dask=dask):
            c = cells[todo[j]]
            if exc is None:
                rec = {"format": CELL_FORMAT, "key": c.key, "config": c.config, "status": "ok", "row": row}
            else:
                n_failed += 1
                rec = {"format": CELL_FORMAT, "key": c.key, "config": c.config, "status": f"error: {_error_text(exc)}",
                       "row": {}, "traceback": "".join(traceback.format_exception(exc))[-4000:]}
            store.put(c.key, rec)
            records[todo[j]] = json.loads(json.dumps(_finite(rec)))   # exactly what a rerun reads back
            bar.update(1)
    return [r for r in records if r is not None], {"total": len(cells), "skipped": n_skip, "ran": len(todo),
                                                   "failed": n_failed}


def _run_cell(item: tuple[dict[str, Any], str], shared: tuple[Callable[..., dict[str, Any]], Mapping[str, Any]]):
    fn, workloads = shared
    config, key = item
    return fn(config, workloads[key])
