"""Study specs: what `slotlab study` runs. A spec is TOML (a file, or a built-in kept as TOML text here);
every key is checked before any cell runs, and an error names the file, the line and the key.

```toml
name = "my-study"                 # results/study/<name>/
description = "..."
seeds = 5                         # or a list [0, 1, 2, 3, 4]
baseline = "fifo"                 # differences are reported against this policy
oracle = "belady"                 # the gap to it is reported ("" = none)
latency = "default"               # a latency spec, as `slotlab simulate --latency`

[server]                          # ServerConfig fields, fixed for every cell
n_parallel = 4

[axes]                            # the grid: every combination x every workload x every seed
evict = ["fifo", "lru"]
cache_hit = ["move", "copy"]
cache_ram = [64, 256, 1024]       # MiB
load = [1, 2]                     # offered-load factor: x arrival rate (open loop), / think time (chat)

[workloads.NAME]                  # one table per workload; `kind` picks the generator
kind = "chat"                     # chat | zipf_conversations | tenants | trace

[quick]                           # what --quick changes (fewer seeds, sizes, loads; smaller workloads)
seeds = 3
```
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.core import ServerConfig
from policies import EVICTIONS, _make
from sim.latency_spec import get_latency_model


class SpecError(ValueError):
    """A bad study spec: `file:line: key 'a.b': message`."""

    def __init__(self, source: str, line: int | None, key: str, message: str) -> None:
        self.source, self.line, self.key = source, line, key
        where = f"{source}:{line}" if line else source
        super().__init__(f"{where}: key '{key}': {message}")


# --- workload kinds: parameter -> (type check, default, meaning) -----------------------------------------

LENGTH = "length"   # an int or [lo, hi]

WORKLOAD_PARAMS: dict[str, dict[str, tuple[str, Any]]] = {
    "chat": {"users": ("int", 32), "turns": (LENGTH, [4, 8]), "think_time": ("float", 30.0),
             "system_prompt_pool": ("int", 4), "system_prompt_len": (LENGTH, [200, 500]),
             "user_tokens": (LENGTH, [20, 120]), "output_tokens": (LENGTH, [30, 150]),
             "start_spread": ("float", 120.0)},
    "zipf_conversations": {"n_requests": ("int", 300), "n_conversations": ("int", 60), "zipf_s": ("float", 1.0),
                           "rate": ("float", 0.2), "system_tokens": (LENGTH, [100, 400]),
                           "user_tokens": (LENGTH, [30, 200]), "assistant_tokens": (LENGTH, [50, 300]),
                           "output_tokens": (LENGTH, [16, 64]), "max_context": ("int", 4096)},
    "tenants": {"n_requests": ("int", 300), "n_tenants": ("int", 24), "rate_s": ("float", 1.0),
                "rate": ("float", 0.15), "system_tokens": (LENGTH, [800, 3000]),
                "user_tokens": (LENGTH, [50, 400]), "output_tokens": (LENGTH, [16, 64])},
    "trace": {"path": ("str", None), "max_requests": ("int", 300), "rate": ("float", 0.0)},
}
# what says how much reuse a workload has (docs/study.md)
REUSE_PARAMS = {"chat": ("users", "think_time"), "zipf_conversations": ("zipf_s", "n_conversations"),
                "tenants": ("rate_s", "n_tenants"), "trace": ("path",)}
COMMON_WORKLOAD_KEYS = {"kind", "optional"}
TOP_KEYS = {"name", "description", "seeds", "baseline", "oracle", "latency", "server", "axes", "workloads", "quick"}
AXES = {"evict", "cache_hit", "cache_ram", "load"}
QUICK_KEYS = {"seeds", "cache_ram", "load", "scale", "evict"}
SCALED = ("users", "n_requests")   # workload sizes --quick multiplies by quick.scale
SERVER_FIELDS = {f.name for f in fields(ServerConfig)} - {"policies", "cache_hit", "cache_ram_mib", "eog_ids"}


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    kind: str
    params: dict[str, Any]
    optional: bool = False


@dataclass(frozen=True)
class StudySpec:
    name: str
    description: str
    seeds: tuple[int, ...]
    baseline: str
    oracle: str
    latency: str
    server: dict[str, Any]
    axes: dict[str, tuple[Any, ...]]
    workloads: tuple[WorkloadSpec, ...]
    source: str
    quick: dict[str, Any] = field(default_factory=dict)
    is_quick: bool = False

    @property
    def n_configs(self) -> int:
        return len(self.workloads) * math.prod(len(v) for v in self.axes.values())

    @property
    def n_cells(self) -> int:
        return self.n_configs * len(self.seeds)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "seeds": list(self.seeds),
                "baseline": self.baseline, "oracle": self.oracle, "latency": self.latency, "server": self.server,
                "axes": {k: list(v) for k, v in self.axes.items()},
                "workloads": [{"name": w.name, "kind": w.kind, "optional": w.optional, **w.params}
                              for w in self.workloads], "source": self.source, "quick": self.is_quick}


# --- locating keys in the text ---------------------------------------------------------------------------

_HEADER = re.compile(r"^\s*\[\s*([^\]]+?)\s*\]\s*(#.*)?$")
_KEYLINE = re.compile(r"^\s*([A-Za-z0-9_.\"'-]+)\s*=")


def _line_of(text: str, dotted: str) -> int | None:
    """The line where `a.b.c` is set: key `c` under table `[a.b]`, or `b.c = ` under `[a]`, etc."""
    table: list[str] = []
    want = dotted.split(".")
    for n, raw in enumerate(text.splitlines(), 1):
        m = _HEADER.match(raw)
        if m:
            table = [p.strip().strip("\"'") for p in m.group(1).split(".")]
            if table == want:
                return n
            continue
        m = _KEYLINE.match(raw)
        if m:
            key = [p.strip().strip("\"'") for p in m.group(1).split(".")]
            if table + key == want:
                return n
    return None


class _Checker:
    def __init__(self, source: str, text: str) -> None:
        self.source, self.text = source, text

    def error(self, key: str, message: str) -> SpecError:
        """The error for `key` (dotted), at its line; a key that is not in the text (missing) points at
        the nearest enclosing table that is."""
        line, probe = _line_of(self.text, key), key
        while line is None and "." in probe:
            probe = probe.rsplit(".", 1)[0]
            line = _line_of(self.text, probe)
        return SpecError(self.source, line, key, message)

    def unknown(self, where: str, table: dict[str, Any], known: set[str]) -> None:
        for k in table:
            if k not in known:
                raise self.error(f"{where}.{k}" if where else k,
                                 f"unknown key (known: {', '.join(sorted(known))})")

    def typed(self, key: str, value: Any, kind: str) -> Any:
        ok = {"int": type(value) is int, "float": isinstance(value, (int, float)) and not isinstance(value, bool),
              "str": isinstance(value, str), "bool": isinstance(value, bool),
              LENGTH: (type(value) is int and value >= 0) or (
                  isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)
                  and 0 <= value[0] <= value[1])}[kind]
        if not ok:
            what = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
                    LENGTH: "a length: an integer N or [LO, HI] with 0 <= LO <= HI"}[kind]
            raise self.error(key, f"expected {what}, got {value!r}")
        return float(value) if kind == "float" else value


def parse_spec(text: str, source: str, *, base_dir: Path | None = None) -> StudySpec:
    """Parse and check a spec (TOML text); `source` names it in errors (a path or "built-in:NAME")."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"line (\d+)", str(e))
        raise SpecError(source, int(m.group(1)) if m else None, "(syntax)", f"malformed TOML: {e}") from None
    ck = _Checker(source, text)
    ck.unknown("", data, TOP_KEYS)
    for req in ("name", "axes", "workloads"):
        if req not in data:
            raise ck.error(req, "missing (a spec needs name, [axes] and at least one [workloads.NAME])")
    name = ck.typed("name", data["name"], "str")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise ck.error("name", f"use letters, digits, '.', '_' and '-' (it names a directory), got {name!r}")
    seeds_v = data.get("seeds", 5)
    seeds = _seeds(ck, "seeds", seeds_v)
    latency = ck.typed("latency", data.get("latency", "default"), "str")
    _check_latency(ck, latency)
    # server
    server = data.get("server", {})
    if not isinstance(server, dict):
        raise ck.error("server", "expected a table [server]")
    ck.unknown("server", server, SERVER_FIELDS)
    try:
        ServerConfig(**{"n_ctx_train": 8192, **server}).resolve()
    except (TypeError, ValueError) as e:
        raise ck.error("server", f"invalid server settings: {e}") from None
    # axes
    axes_t = data["axes"]
    if not isinstance(axes_t, dict):
        raise ck.error("axes", "expected a table [axes]")
    ck.unknown("axes", axes_t, AXES)
    axes: dict[str, tuple[Any, ...]] = {}
    defaults = {"evict": ["fifo"], "cache_hit": ["move"], "cache_ram": [8192], "load": [1.0]}
    for ax in ("evict", "cache_hit", "cache_ram", "load"):
        v = axes_t.get(ax, defaults[ax])
        axes[ax] = _axis(ck, f"axes.{ax}", ax, v)
    baseline = ck.typed("baseline", data.get("baseline", axes["evict"][0]), "str")
    if baseline not in axes["evict"]:
        raise ck.error("baseline", f"{baseline!r} is not one of axes.evict {list(axes['evict'])}")
    oracle = ck.typed("oracle", data.get("oracle", "belady" if "belady" in axes["evict"] else ""), "str")
    if oracle and oracle not in axes["evict"]:
        raise ck.error("oracle", f"{oracle!r} is not one of axes.evict {list(axes['evict'])}")
    # workloads
    wls_t = data["workloads"]
    if not isinstance(wls_t, dict) or not wls_t:
        raise ck.error("workloads", "expected at least one table [workloads.NAME]")
    workloads = []
    for wname, wt in wls_t.items():
        key = f"workloads.{wname}"
        if not isinstance(wt, dict):
            raise ck.error(key, "expected a table")
        kind = wt.get("kind")
        if kind not in WORKLOAD_PARAMS:
            raise ck.error(f"{key}.kind", f"expected one of {', '.join(WORKLOAD_PARAMS)}, got {kind!r}")
        known = WORKLOAD_PARAMS[kind]
        ck.unknown(key, wt, set(known) | COMMON_WORKLOAD_KEYS)
        params = {}
        for p, (ptype, default) in known.items():
            if p in wt:
                params[p] = ck.typed(f"{key}.{p}", wt[p], ptype)
            elif default is None:
                raise ck.error(f"{key}.{p}", f"missing (a {kind} workload needs {p})")
            else:
                params[p] = default
        for p in ("users", "n_requests", "n_conversations", "n_tenants", "system_prompt_pool", "max_requests"):
            if p in params and params[p] < 1:
                raise ck.error(f"{key}.{p}", f"must be >= 1, got {params[p]}")
        if kind == "trace" and base_dir is not None and not Path(params["path"]).is_absolute():
            params["spec_dir"] = str(base_dir)
        optional = ck.typed(f"{key}.optional", wt.get("optional", False), "bool")
        workloads.append(WorkloadSpec(wname, kind, params, optional))
    quick = data.get("quick", {})
    if not isinstance(quick, dict):
        raise ck.error("quick", "expected a table [quick]")
    ck.unknown("quick", quick, QUICK_KEYS)
    if "seeds" in quick:
        _seeds(ck, "quick.seeds", quick["seeds"])
    for ax in ("cache_ram", "load", "evict"):
        if ax in quick:
            _axis(ck, f"quick.{ax}", ax, quick[ax])
    if "scale" in quick and not (ck.typed("quick.scale", quick["scale"], "float") > 0):
        raise ck.error("quick.scale", "must be > 0")
    return StudySpec(name, ck.typed("description", data.get("description", ""), "str"), seeds, baseline, oracle,
                     latency, dict(server), axes, tuple(workloads), source, dict(quick))


def _seeds(ck: _Checker, key: str, v: Any) -> tuple[int, ...]:
    if type(v) is int:
        if v < 1:
            raise ck.error(key, f"need at least 1 seed, got {v}")
        return tuple(range(v))
    if isinstance(v, list) and v and all(type(s) is int for s in v) and len(set(v)) == len(v):
        return tuple(v)
    raise ck.error(key, f"expected a count or a list of distinct integers, got {v!r}")


def _axis(ck: _Checker, key: str, ax: str, v: Any) -> tuple[Any, ...]:
    if not isinstance(v, list) or not v:
        raise ck.error(key, f"expected a non-empty list, got {v!r}")
    if len(set(map(str, v))) != len(v):
        raise ck.error(key, f"values repeat: {v!r}")
    for x in v:
        if ax == "evict":
            if not isinstance(x, str) or x.partition(":")[0] not in EVICTIONS:
                raise ck.error(key, f"unknown eviction policy {x!r}; choose from {', '.join(EVICTIONS)}")

            try:
                _make("eviction", x)
            except (ValueError, TypeError) as e:
                raise ck.error(key, str(e)) from None
        elif ax == "cache_hit":
            if x not in ("move", "copy"):
                raise ck.error(key, f"expected 'move' or 'copy', got {x!r}")
        elif ax == "cache_ram":
            if type(x) is not int or x <= 0:
                raise ck.error(key, f"cache sizes are positive integers (MiB), got {x!r}")
        elif ax == "load":
            if not isinstance(x, (int, float)) or isinstance(x, bool) or not x > 0:
                raise ck.error(key, f"loads are positive numbers, got {x!r}")
    return tuple(float(x) for x in v) if ax == "load" else tuple(v)


def _check_latency(ck: _Checker, latency: str) -> None:

    try:
        get_latency_model(latency)
    except (ValueError, OSError, KeyError) as e:
        raise ck.error("latency", f"bad latency spec: {e}") from None


def quick_version(spec: StudySpec) -> StudySpec:
    """The spec with its [quick] overrides: fewer seeds/sizes/loads and workloads scaled by quick.scale
    (default: 3 seeds, the smallest, middle and largest cache size, the first load, half-size workloads)."""
    q = spec.quick
    sizes = spec.axes["cache_ram"]
    seeds = tuple(range(q["seeds"])) if type(q.get("seeds")) is int else tuple(q.get("seeds", spec.seeds[:3]))
    axes = dict(spec.axes)
    axes["cache_ram"] = tuple(q.get("cache_ram", sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})))
    axes["load"] = tuple(float(x) for x in q.get("load", spec.axes["load"][:1]))
    if "evict" in q:
        axes["evict"] = tuple(q["evict"])
    scale = float(q.get("scale", 0.5))
    wls = tuple(WorkloadSpec(w.name, w.kind, {k: (max(1, round(v * scale)) if k in SCALED or k == "max_requests"
                                                  else v) for k, v in w.params.items()}, w.optional)
                for w in spec.workloads)
    return StudySpec(spec.name + "-quick", spec.description, seeds, spec.baseline, spec.oracle, spec.latency,
                     spec.server, axes, wls, spec.source, q, is_quick=True)


# --- built-in studies (TOML, parsed by the same code as a file) ------------------------------------------

FIFO_VS_LRU = """\
name = "fifo-vs-lru"
description = "Is LRU better than FIFO, and when? Every eviction policy x move/copy hits x cache size x load, on three reuse workloads, 5 seeds, against the Belady oracle."
seeds = 5
baseline = "fifo"
oracle = "belady"
latency = "default"

[server]             # 4 slots of 8192 cells each, SmolLM2-135M f16 KV (23,052 bytes per token)
n_parallel = 4
n_ctx = 32768
kv_unified = false

[axes]
evict = ["fifo", "lru", "lfu", "slru", "clock", "gdsf", "largest", "belady"]
cache_hit = ["move", "copy"]
cache_ram = [32, 128, 512, 2048, 8192]     # MiB: about one entry ... never evicts
load = [1, 2]

[workloads.chat]                 # the built-in multi-turn chat (closed loop); load 2 halves think times
kind = "chat"

[workloads.zipf]                 # 60 conversations, Zipf(1.0) popularity, open loop
kind = "zipf_conversations"

[workloads.tenants]              # 24 tenants with 800-3000-token system prompts at Zipf(1.0) rates
kind = "tenants"

[quick]
seeds = 3
cache_ram = [32, 512, 8192]
load = [1]
scale = 0.5
"""

MOONCAKE = """\
name = "mooncake"
description = "FIFO vs LRU vs the oracle on the first 300 requests of the shared Mooncake trace (prefix hash blocks); skipped when the trace is absent."
seeds = 5
baseline = "fifo"
oracle = "belady"

[server]
n_parallel = 4
n_ctx = 262144
kv_unified = false

[axes]
evict = ["fifo", "lru", "slru", "gdsf", "belady"]
cache_hit = ["move", "copy"]
cache_ram = [512, 2048, 8192, 32768]
load = [1]

[workloads.mooncake]
kind = "trace"
path = "mooncake_synthetic_trace.jsonl"
max_requests = 300
rate = 0.05
optional = true
"""

BUILTINS = {"fifo-vs-lru": FIFO_VS_LRU, "mooncake": MOONCAKE}


def load_spec(name_or_path: str) -> StudySpec:
    if name_or_path in BUILTINS:
        return parse_spec(BUILTINS[name_or_path], f"built-in:{name_or_path}")
    path = Path(name_or_path)
    if not path.is_file():
        raise SpecError(name_or_path, None, "(file)",
                        f"no such spec file and no built-in study of that name (built-ins: {', '.join(BUILTINS)})")
    return parse_spec(path.read_text(encoding="utf-8"), str(path), base_dir=path.resolve().parent)
