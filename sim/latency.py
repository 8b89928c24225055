"""Latency models of the simulated backend: how long one `backend.execute(plan)` call takes.

One execute() mirrors one pass of llama-server's `update_slots` after scheduling: host prompt-cache copies,
K re-rotation of shifted cells, then one or more `llama_decode` calls on the batch. The simulated backend
counts that work as a `StepCost`; a `LatencyModel` turns it into seconds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

SMALL_K = 48        # decode stretches up to this many steps are timed in Python, longer ones with numpy
DEFAULT_CALIBRATION_PATH = Path(__file__).with_name("data") / "default_calibration.json"
CALIBRATION_KIND = "parametric"


@dataclass(frozen=True, slots=True)
class StepCost:
    """What one backend.execute() call does, as counted by the simulated backend.

    `kv_read_tokens` is optional: Σ over sequences of the KV cells its attention reads (once per layer):
    a decode token at context c reads c+1 cells, a prefill chunk of length L at pos0 reads pos0+L cells
    (a chunk's queries share one pass over its KV). `step_cost_from_chunks` fills it exactly; when it is
    None, `kv_read_tokens_or_estimate()` derives it from the other fields (exact for decode-only steps
    and for a single prefill chunk; see docs/latency_models.md).

    `calls` and `kv_save_bytes` are optional too; only the physical model (`sim.latency_physical`) reads
    them, and the simulated backend fills them only for a model that asks (`wants_layout`). `calls` holds
    each `llama_decode` call's chunks as `(seq, pos0, n_tokens)` in batch order: how the engine lays the
    work out (which one-token chunks it attends together, how a prompt chunk's queries are blocked) follows
    from it. `kv_save_bytes` is the part of `kv_copy_bytes` copied out to the host-RAM cache (`cache_save`;
    the rest is `cache_load`), which costs the engine several times more per byte than a restore.
    """

    n_prefill_tokens: int  # prompt tokens evaluated this step
    n_decode_tokens: int  # decode tokens this step (one per generating sequence)
    n_seqs: int  # sequences (chunks) in the batch
    attn_ctx_tokens: int  # Σ over every token of the KV length it attends to (see module docs)
    n_forward_calls: int = 1  # llama_decode calls (a batch may be split when n_batch halves)
    kv_copy_bytes: int = 0  # bytes moved between slot KV and the host-RAM prompt cache / seq_cp
    kv_shift_tokens: int = 0  # cached tokens whose K was re-rotated (context shift / cache reuse)
    kv_read_tokens: int | None = None  # Σ over sequences of KV cells read per layer; None → estimate
    calls: tuple[tuple[tuple[int, int, int], ...], ...] | None = None  # per call: (seq, pos0, n_tokens)
    kv_save_bytes: int | None = None  # the cache_save part of kv_copy_bytes; None → not counted

    @property
    def n_tokens(self) -> int:
        return self.n_prefill_tokens + self.n_decode_tokens

    def kv_read_tokens_or_estimate(self) -> float:
        """KV cells read per layer; if not counted, assume the batch's sequences have equal length.

        With T tokens in n sequences of equal length T/n, Σ(pos0+L) = attn_ctx·n/T + (T−n)/2.
        """
        if self.kv_read_tokens is not None:
            return float(self.kv_read_tokens)
        n_tokens = self.n_prefill_tokens + self.n_decode_tokens
        if n_tokens <= 0 or self.n_seqs <= 0:
            return 0.0
        return self.attn_ctx_tokens * self.n_seqs / n_tokens + (n_tokens - self.n_seqs) / 2


def step_cost_from_chunks(
    prefill_chunks: Iterable[tuple[int, int]] = (),
    decode_n_past: Iterable[int] = (),
    *,
    n_forward_calls: int = 1,
    kv_copy_bytes: int = 0,
    kv_shift_tokens: int = 0,
) -> StepCost:
    """StepCost of a batch from its prompt chunks `(pos0, n_tokens)` and its decoding sequences' n_past.

    A decode token of a sequence with n_past cached cells sits at position n_past and attends n_past+1.
    """
    n_prefill = n_seqs = attn_ctx = kv_read = 0
    for pos0, n_tokens in prefill_chunks:
        n_prefill += n_tokens
        n_seqs += 1
        attn_ctx += n_tokens * pos0 + n_tokens * (n_tokens + 1) // 2
        kv_read += pos0 + n_tokens
    n_decode = 0
    for n_past in decode_n_past:
        n_decode += 1
        attn_ctx += n_past + 1
        kv_read += n_past + 1
    return StepCost(
        n_prefill_tokens=n_prefill,
        n_decode_tokens=n_decode,
        n_seqs=n_seqs + n_decode,
        attn_ctx_tokens=attn_ctx,
        n_forward_calls=n_forward_calls,
        kv_copy_bytes=kv_copy_bytes,
        kv_shift_tokens=kv_shift_tokens,
        kv_read_tokens=kv_read,
    )


@runtime_checkable
class LatencyModel(Protocol):
    """Predicts the wall time of one backend.execute() call.

    Contract: `decode_only_times_s(n, ctx0, k)[i] == step_time_s(StepCost(0, n, n, ctx0 + i*n))` for
    every i < k (k decode-only steps of n sequences, every context growing by one per step), computed
    without a Python loop over steps — the simulator's fast-forward calls it with k in the thousands.
    """

    def step_time_s(self, cost: StepCost) -> float: ...

    def decode_only_times_s(self, n_seqs: int, attn_ctx0: int, k: int) -> list[float]: ...

    def describe(self) -> dict: ...


def check_decode_only_args(n_seqs: int, attn_ctx0: int, k: int) -> None:
    if n_seqs < 1:
        raise ValueError(f"decode_only_times_s: n_seqs must be >= 1, got {n_seqs}")
    if attn_ctx0 < n_seqs:
        raise ValueError(f"decode_only_times_s: attn_ctx0 must be >= n_seqs ({n_seqs}), got {attn_ctx0}")
    if k < 0:
        raise ValueError(f"decode_only_times_s: k must be >= 0, got {k}")


def decode_only_cost(n_seqs: int, attn_ctx_tokens: int) -> StepCost:
    """The StepCost of one decode-only step, as `decode_only_times_s` assumes it."""
    return StepCost(n_prefill_tokens=0, n_decode_tokens=n_seqs, n_seqs=n_seqs, attn_ctx_tokens=attn_ctx_tokens)


def _check_non_negative(owner: str, name: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}: {name} must be a finite number >= 0, got {value!r}")


# --- constant -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConstantLatency:
    """t = step_s + per_token_s · (n_prefill + n_decode). For tests and parity runs."""

    step_s: float
    per_token_s: float = 0.0

    def __post_init__(self) -> None:
        _check_non_negative("ConstantLatency", "step_s", self.step_s)
        _check_non_negative("ConstantLatency", "per_token_s", self.per_token_s)

    def step_time_s(self, cost: StepCost) -> float:
        return self.step_s + self.per_token_s * (cost.n_prefill_tokens + cost.n_decode_tokens)

    def decode_only_times_s(self, n_seqs: int, attn_ctx0: int, k: int) -> list[float]:
        check_decode_only_args(n_seqs, attn_ctx0, k)
        return [self.step_s + self.per_token_s * n_seqs] * k

    def describe(self) -> dict:
        return {"kind": "constant", "step_s": self.step_s, "per_token_s": self.per_token_s}


# --- scaled ---------------------------------------------------------------------------------------


class _Wrapper:
    """What a model wrapping another (`base`) forwards, so that the checks on a calibration see through it: the
    base's `wants_layout` (a physical base still gets the layout), `measured_on`, `source`, `load_moved`."""

    __slots__ = ()
    base: LatencyModel

    @property
    def wants_layout(self) -> bool:
        return bool(getattr(self.base, "wants_layout", False))

    @property
    def measured_on(self) -> MeasuredOn | None:
        return getattr(self.base, "measured_on", None)

    @property
    def source(self) -> str | None:
        return getattr(self.base, "source", None)

    @property
    def load_moved(self) -> bool | None:
        return getattr(self.base, "load_moved", None)

    def _base_decode_times(self, n_seqs: int, attn_ctx0: int, k: int,
                           decode: Sequence[tuple[int, int]] | None) -> list[float]:
        """The base's decode-stretch times; `decode` (the sequences' (seq, n_past)) goes to a base that prices
        the layout, as the simulator passes it."""
        if decode is None:
            return self.base.decode_only_times_s(n_seqs, attn_ctx0, k)
        return self.base.decode_only_times_s(n_seqs, attn_ctx0, k, decode)


@dataclass(frozen=True, slots=True)
class ScaledLatency(_Wrapper):
    """Another model's step times multiplied by `factor` (> 0): t = factor · base(cost).

    What `slotlab validate --speed-correct probe` simulates with, `factor` being the speed probe's ratio (the
    machine's step times now / at calibration, docs/validation_sim.md §6). One factor for every term: it
    corrects a machine that is uniformly slower or faster, not contention that slows some terms more than
    others. The base's `wants_layout` is kept (a physical base still gets the layout); its `measured_on`,
    `source` and `load_moved` are forwarded, so the checks on a calibration see through the wrapper."""

    base: LatencyModel
    factor: float

    def __post_init__(self) -> None:
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) \
                or not math.isfinite(self.factor) or self.factor <= 0:
            raise ValueError(f"ScaledLatency: factor must be a finite number > 0, got {self.factor!r}")
        if not isinstance(self.base, LatencyModel):
            raise ValueError(f"ScaledLatency: base must be a latency model, got {type(self.base).__name__}")

    def step_time_s(self, cost: StepCost) -> float:
        return self.factor * self.base.step_time_s(cost)

    def decode_only_times_s(self, n_seqs: int, attn_ctx0: int, k: int,
                            decode: Sequence[tuple[int, int]] | None = None) -> list[float]:
        """The base's times, each multiplied by the factor; `decode` (the sequences' (seq, n_past)) goes to a
        base that prices the layout, as the simulator passes it."""
        times = self._base_decode_times(n_seqs, attn_ctx0, k, decode)
        f = self.factor
        return [f * t for t in times]

    def describe(self) -> dict:
        base = self.base.describe()
        return {"kind": "scaled", "factor": self.factor, "base": base, "source": base.get("source")}


class TrackedLatency(_Wrapper):
    """Another model's step times multiplied by a factor that follows the simulated clock: t = f(now) · base(cost),
    f linear between the knots (times_s[i], factors[i]) and constant before the first and after the last. With
    `prompt_factors`, a step that processes prompt tokens takes those instead (one factor per compute path: a
    decode step streams the weights once for a few rows, a prompt chunk runs the dense products on many; the
    machine's speed moves them differently, docs/validation_sim.md §8).

    What `slotlab validate --speed-correct track` simulates with: the knots are the speed probe measured before,
    during (every few seconds of wall time, outside the run's clock) and after the real run, each the probe's
    step times / the latency model's own times of the same shapes. It follows a machine whose speed moves during
    the run, which one factor cannot. `now` is the clock the simulation binds with `bind_clock` (the server's
    last step start: within one step of the step priced, while the knots are seconds apart); unbound, the clock
    reads 0. In a fast-forwarded decode stretch the i-th step is placed at now + f(now) · Σ of the base times
    before it, so `decode_only_times_s` equals pricing the steps one by one up to that placement (not bit for
    bit: the one deviation from the LatencyModel contract, by design)."""

    def __init__(self, base: LatencyModel, times_s: Sequence[float], factors: Sequence[float],
                 prompt_factors: Sequence[float] | None = None) -> None:
        if not isinstance(base, LatencyModel):
            raise ValueError(f"TrackedLatency: base must be a latency model, got {type(base).__name__}")
        t = [float(x) for x in times_s]
        f = [float(x) for x in factors]
        fp = f if prompt_factors is None else [float(x) for x in prompt_factors]
        if not t or len(t) != len(f) or len(t) != len(fp):
            raise ValueError(f"TrackedLatency: needs as many factors as times, at least one (got {len(t)} times, "
                             f"{len(f)} factors, {len(fp)} prompt factors)")
        if any(not math.isfinite(x) for x in t) or any(b < a for a, b in zip(t, t[1:])):
            raise ValueError(f"TrackedLatency: times must be finite and non-decreasing, got {t}")
        if any(not math.isfinite(x) or x <= 0 for x in f + fp):
            raise ValueError(f"TrackedLatency: factors must be finite numbers > 0, got {f} and {fp}")
        self.base = base
        self.times_s = tuple(t)
        self.factors = tuple(f)
        self.prompt_factors = tuple(fp)
        self._t = np.array(t)
        self._f = np.array(f)
        self._fp = np.array(fp)
        self._clock: Callable[[], float] = lambda: 0.0

    def bind_clock(self, clock: Callable[[], float]) -> None:
        """Read the simulated time (seconds) from `clock` (the Simulation calls this with its own)."""
        self._clock = clock

    def factor_at(self, t_s: float, prompt: bool = False) -> float:
        """The factor at simulated time t_s: of a step that processes prompt tokens when `prompt`."""
        return float(np.interp(t_s, self._t, self._fp if prompt else self._f))

    def cost_factor_at(self, t_s: float, cost: StepCost) -> float:
        return self.factor_at(t_s, cost.n_prefill_tokens > 0)

    def step_time_s(self, cost: StepCost) -> float:
        return self.cost_factor_at(self._clock(), cost) * self.base.step_time_s(cost)

    def decode_only_times_s(self, n_seqs: int, attn_ctx0: int, k: int,
                            decode: Sequence[tuple[int, int]] | None = None) -> list[float]:
        times = np.asarray(self._base_decode_times(n_seqs, attn_ctx0, k, decode), dtype=float)
        if not times.size:
            return []
        t0 = self._clock()
        before = np.concatenate(([0.0], np.cumsum(times[:-1])))       # base time of the steps before each
        at = t0 + self.factor_at(t0) * before
        return (np.interp(at, self._t, self._f) * times).tolist()

    def describe(self) -> dict:
        base = self.base.describe()
        return {"kind": "tracked", "times_s": list(self.times_s), "factors": list(self.factors),
                "prompt_factors": list(self.prompt_factors), "base": base, "source": base.get("source")}


class JitteredLatency(_Wrapper):
    """Another model's step times, each multiplied by exp(x), x drawn with replacement from `prompt_log` for a step
    that processes prompt tokens and from `decode_log` for one that does not; one independent draw per step.

    A host whose single steps scatter around their expected time: what that scatter alone does to a run's figures,
    once the simulation re-decides everything that follows from it (batches, slots, cached prefixes, a closed
    loop's arrivals). `experiments.repeat_floor.dynamic_floor` draws from a real run's own replays. Seeded: the
    same seed and the same calls give the same times. A fast-forwarded decode stretch draws one value per step
    too, so it agrees with stepping one by one in distribution, not draw for draw (the one deviation from the
    LatencyModel contract, by design). The base's layout, calibration record and clock (`bind_clock`, which a
    TrackedLatency base needs) are forwarded."""

    def __init__(self, base: LatencyModel, prompt_log: Sequence[float], decode_log: Sequence[float],
                 seed: int = 0) -> None:
        if not isinstance(base, LatencyModel):
            raise ValueError(f"JitteredLatency: base must be a latency model, got {type(base).__name__}")
        p = np.asarray(prompt_log, dtype=float).ravel()
        d = np.asarray(decode_log, dtype=float).ravel()
        if not p.size or not d.size:
            raise ValueError(f"JitteredLatency: needs at least one value per path to draw from (got {p.size} for "
                             f"prompt steps, {d.size} for decode steps)")
        if not (np.isfinite(p).all() and np.isfinite(d).all()):
            raise ValueError("JitteredLatency: the values drawn (log factors) must be finite")
        self.base = base
        self.seed = int(seed)
        self._prompt = np.exp(p)
        self._decode = np.exp(d)
        self._rng = np.random.default_rng(self.seed)

    def bind_clock(self, clock: Callable[[], float]) -> None:
        """Hand the simulated clock on to a base that reads it (TrackedLatency); nothing for one that does not."""
        bind = getattr(self.base, "bind_clock", None)
        if bind is not None:
            bind(clock)

    def step_time_s(self, cost: StepCost) -> float:
        factors = self._prompt if cost.n_prefill_tokens > 0 else self._decode
        return float(factors[self._rng.integers(factors.size)]) * self.base.step_time_s(cost)

    def decode_only_times_s(self, n_seqs: int, attn_ctx0: int, k: int,
                            decode: Sequence[tuple[int, int]] | None = None) -> list[float]:
        times = np.asarray(self._base_decode_times(n_seqs, attn_ctx0, k, decode), dtype=float)
        if not times.size:
            return []
        return (self._decode[self._rng.integers(self._decode.size, size=times.size)] * times).tolist()

    def describe(self) -> dict:
        base = self.base.describe()
        return {"kind": "jittered", "n_prompt": int(self._prompt.size), "n_decode": int(self._decode.size),
                "seed": self.seed, "base": base, "source": base.get("source")}


def unscaled(latency: LatencyModel) -> LatencyModel:
    """The model under any wrappers (ScaledLatency, TrackedLatency, JitteredLatency)."""
    while isinstance(latency, _Wrapper):
        latency = latency.base
    return latency


# --- parametric -----------------------------------------------------------------------------------

COEFFICIENT_NAMES = (
    "a_s",
    "b_prefill_s",
    "c_decode_s",
    "d_attn_s",
    "e_copy_s_per_byte",
    "f_shift_s_per_token",
    "g_call_s",
    "h_kv_read_s",
)
# coefficients a calibration file may omit (added after the format's first version): default 0
OPTIONAL_COEFFICIENTS = {"h_kv_read_s": 0.0}
MEASURED_ON_FIELDS = ("machine", "cpu", "threads", "engine", "model", "date", "notes")
# fields a calibration file may omit (added after the format's first version): absent = not recorded
OPTIONAL_MEASURED_ON = ("mem_reserve_mib",)


@dataclass(frozen=True, slots=True)
class MeasuredOn:
    """Where and how a calibration was measured (or, for a derived one, what it was derived from)."""

    machine: str
    cpu: str
    threads: int | None  # BLAS/compute threads; None when not applicable (GPU, derived)
    engine: str
    model: str
    date: str  # ISO 8601
    notes: str
    # the engine's heap reserve during the measurement (`--mem-reserve`, engine/model/heap.py): 0 = the
    # allocator's defaults; None = not recorded (files written before it, which ran with the defaults)
    mem_reserve_mib: int | None = None

    @classmethod
    def from_dict(cls, data: object, where: str = "measured_on") -> MeasuredOn:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: field 'measured_on' must be a JSON object, got {type(data).__name__}")
        for name in MEASURED_ON_FIELDS:
            if name not in data:
                raise ValueError(f"{where}: missing field 'measured_on.{name}'")
        for name in MEASURED_ON_FIELDS:
            value = data[name]
            if name == "threads":
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ValueError(f"{where}: field 'measured_on.threads' must be an integer >= 1 or null, "
                                     f"got {value!r}")
            elif not isinstance(value, str):
                raise ValueError(f"{where}: field 'measured_on.{name}' must be a string, got {value!r}")
        reserve = data.get("mem_reserve_mib")
        if reserve is not None and (isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0):
            raise ValueError(f"{where}: field 'measured_on.mem_reserve_mib' must be an integer >= 0 or null, "
                             f"got {reserve!r}")
        known = MEASURED_ON_FIELDS + OPTIONAL_MEASURED_ON
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"{where}: unknown field 'measured_on.{unknown[0]}' (expected {known})")
        return cls(**{name: data[name] for name in MEASURED_ON_FIELDS}, mem_reserve_mib=reserve)


@dataclass(frozen=True, slots=True)
class ParametricLatency:
    """t = a + b·n_prefill + c·n_decode + d·attn_ctx + h·kv_read + e·kv_copy_bytes + f·kv_shift + g·(n_calls−1).

    `d` prices attention work (query-key pairs); `h` prices reading cached KV cells, which a decode token
    does alone for its whole context while a prompt chunk's tokens share one pass — one coefficient cannot
    fit both. All coefficients in seconds per unit, all >= 0. `measured_on` and `source` document the calibration
    and do not take part in equality.
    """

    a_s: float
    b_prefill_s: float
    c_decode_s: float
    d_attn_s: float
    e_copy_s_per_byte: float = 0.0
    f_shift_s_per_token: float = 0.0
    g_call_s: float = 0.0
    h_kv_read_s: float = 0.0
    measured_on: MeasuredOn | None = field(default=None, compare=False)
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in COEFFICIENT_NAMES:
            _check_non_negative("ParametricLatency", name, getattr(self, name))

    def coefficients(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in COEFFICIENT_NAMES}

    def step_time_s(self, cost: StepCost) -> float:
        return (
            self.a_s
            + self.b_prefill_s * cost.n_prefill_tokens
            + self.c_decode_s * cost.n_decode_tokens
            + self.d_attn_s * cost.attn_ctx_tokens
            + self.h_kv_read_s * cost.kv_read_tokens_or_estimate()
            + self.e_copy_s_per_byte * cost.kv_copy_bytes
            + self.f_shift_s_per_token * cost.kv_shift_tokens
            + self.g_call_s * max(cost.n_forward_calls - 1, 0)
        )

    def decode_step_time_s(self, n_seqs: int, attn_ctx: int) -> float:
        """`step_time_s(decode_only_cost(n_seqs, attn_ctx))` without building the StepCost: the same terms
        in the same order (kv_read estimated as step_time_s estimates it), so the result is bit-equal."""
        return (
            self.a_s
            + self.b_prefill_s * 0
            + self.c_decode_s * n_seqs
            + self.d_attn_s * attn_ctx
            + self.h_kv_read_s * (attn_ctx * n_seqs / n_seqs + (n_seqs - n_seqs) / 2)
            + self.e_copy_s_per_byte * 0
            + self.f_shift_s_per_token * 0
            + self.g_call_s * max(1 - 1, 0)
        )

    def one_call_step_time_s(self, n_prefill: int, n_decode: int, attn_ctx: int, kv_read: int,
                             copy_bytes: int = 0, shift_tokens: int = 0) -> float:
        """`step_time_s` of a one-call step with a counted kv_read (a prefill stretch's step,
        `SimBackend.prefill_stretch_costs`, or an admission stretch's first step with its KV copies and
        shifts) without building the StepCost: the same terms in the same order, so the result is bit-equal."""
        return (
            self.a_s
            + self.b_prefill_s * n_prefill
            + self.c_decode_s * n_decode
            + self.d_attn_s * attn_ctx
            + self.h_kv_read_s * float(kv_read)
            + self.e_copy_s_per_byte * copy_bytes
            + self.f_shift_s_per_token * shift_tokens
            + self.g_call_s * max(1 - 1, 0)
        )

    def decode_only_times_s(self, n_seqs: int, attn_ctx0: int, k: int) -> list[float]:
        check_decode_only_args(n_seqs, attn_ctx0, k)
        # Same left-to-right sum as step_time_s (the zero terms add exactly 0.0), so results are bit-equal.
        base = self.a_s + self.b_prefill_s * 0 + self.c_decode_s * n_seqs
        if k <= SMALL_K:
            # a short stretch costs less in Python than numpy's per-call overhead; the same float operations
            # (an int times a float is the int converted, then multiplied, as numpy does), so bit-equal
            d, h = self.d_attn_s, self.h_kv_read_s
            return [base + d * c + h * float(c) for c in range(attn_ctx0, attn_ctx0 + n_seqs * k, n_seqs)]
        attn_ctx = attn_ctx0 + n_seqs * np.arange(k, dtype=np.int64)  # [k]
        # a decode token at context c reads c+1 cells, as many as it attends: kv_read == attn_ctx here
        return (base + self.d_attn_s * attn_ctx + self.h_kv_read_s * attn_ctx.astype(np.float64)).tolist()

    def describe(self) -> dict:
        return {
            "kind": "parametric",
            "coefficients": self.coefficients(),
            "measured_on": None if self.measured_on is None else asdict(self.measured_on),
            "source": self.source,
        }


def _require_number(where: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: field '{name}' must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{where}: field '{name}' must be finite, got {value!r}")
    if value < 0:
        raise ValueError(f"{where}: field '{name}' must be >= 0 (a negative coefficient), got {value!r}")
    return float(value)


def _require_numbers(where: str, field: str, obj: object, names: tuple[str, ...]) -> dict[str, float]:
    """The JSON object `field` holding exactly the numbers `names` (each as `_require_number` takes it)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: field '{field}' must be a JSON object")
    for name in names:
        if name not in obj:
            raise ValueError(f"{where}: missing field '{field}.{name}'")
    unknown = sorted(set(obj) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown field '{field}.{unknown[0]}' (expected {names})")
    return {name: _require_number(where, f"{field}.{name}", obj[name]) for name in names}


def load_calibration(path: str | Path) -> ParametricLatency:
    """Read a parametric calibration file (format in docs/latency_models.md); ValueError names file and field."""
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{where}: cannot read calibration file: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{where}: top level must be a JSON object, got {type(data).__name__}")
    for name in ("kind", "coefficients", "measured_on"):
        if name not in data:
            raise ValueError(f"{where}: missing field '{name}'")
    if data["kind"] != CALIBRATION_KIND:
        raise ValueError(f"{where}: field 'kind' must be {CALIBRATION_KIND!r}, got {data['kind']!r}")
    coefficients = data["coefficients"]
    if not isinstance(coefficients, dict):
        raise ValueError(f"{where}: field 'coefficients' must be a JSON object")
    values = _require_numbers(where, "coefficients", {**OPTIONAL_COEFFICIENTS, **coefficients}, COEFFICIENT_NAMES)
    measured_on = MeasuredOn.from_dict(data["measured_on"], where)
    return ParametricLatency(**values, measured_on=measured_on, source=where)


def save_calibration(
    model: ParametricLatency,
    path: str | Path,
    measured_on: MeasuredOn | Mapping[str, object],
    fit: FitResult | None = None,
) -> None:
    """Write `model` as a calibration file that `load_calibration` reads back to an equal model."""
    if not isinstance(measured_on, MeasuredOn):
        measured_on = MeasuredOn.from_dict(dict(measured_on), "save_calibration")
    data: dict[str, object] = {
        "kind": CALIBRATION_KIND,
        "coefficients": model.coefficients(),
        "measured_on": asdict(measured_on),
    }
    if fit is not None:
        data["fit"] = fit.stats()
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# --- fitting --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FitResult:
    """A fitted model (ParametricLatency, or PhysicalLatency of sim.latency_physical) and how well it
    reproduces the rows it was fitted on."""

    model: LatencyModel
    r2: float  # coefficient of determination on elapsed_s (unweighted)
    mape: float  # mean |pred − elapsed| / elapsed, a fraction
    max_ape: float  # worst |pred − elapsed| / elapsed, a fraction
    rmse_s: float
    n_rows: int
    method: str  # which non-negative least-squares solver ran
    weighting: str  # "relative" (rows weighted by 1/elapsed) or "absolute"

    def stats(self) -> dict[str, object]:
        return {name.name: getattr(self, name.name) for name in fields(self) if name.name != "model"}


def _nnls_lawson_hanson(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a·x − b|| subject to x >= 0: the Lawson–Hanson active-set algorithm (Solving Least Squares
    Problems, 1974, ch. 23), for when scipy is not importable. Exact: it stops at a point that satisfies the
    Karush–Kuhn–Tucker conditions (within a tolerance scaled like scipy's)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * max(m, n) * np.finfo(np.float64).eps * max(np.abs(a).sum(axis=0).max(), 1.0)
    w = a.T @ (b - a @ x)                                            # [n] the negative gradient
    for _ in range(3 * n + 10):
        if passive.all() or not (w[~passive] > tol).any():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive], *_ = np.linalg.lstsq(a[:, passive], b, rcond=None)
            if (z[passive] > 0).all():
                break
            neg = passive & (z <= 0)
            alpha = float(np.min(x[neg] / (x[neg] - z[neg])))        # step back to the first bound hit
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = z
        w = a.T @ (b - a @ x)
    return x


def _solve_nnls(a: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, str]:
    try:
        from scipy.optimize import nnls  # optional dependency; the fallback solves the same problem
    except ImportError:
        return _nnls_lawson_hanson(a, y), "Lawson-Hanson NNLS (numpy)"
    x, _ = nnls(a, y)
    return x, "scipy.optimize.nnls"


WEIGHTINGS = ("relative", "absolute")


def fit_nonnegative(x: np.ndarray, t: np.ndarray, *, weighting: str = "relative",
                    where: str = "fit") -> tuple[np.ndarray, str]:
    """Non-negative coefficients c minimising Σ(w·(x·c − t))², w = 1/t ("relative") or 1 ("absolute").

    x [n_rows, n_terms] regressors, t [n_rows] measured seconds (finite, > 0). Columns are scaled to unit
    max for conditioning (regressors span ~10 orders of magnitude: 1 vs bytes). Returns (c, solver name)."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"{where}: weighting must be 'relative' or 'absolute', got {weighting!r}")
    if x.shape[0] == 0:
        raise ValueError(f"{where}: no rows")
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ValueError(f"{where}: every elapsed_s must be a finite number > 0")
    w = 1.0 / t if weighting == "relative" else np.ones_like(t)      # [n_rows]
    scale = np.abs(x).max(axis=0)                                    # [n_terms]
    scale[scale == 0] = 1.0
    coef_scaled, method = _solve_nnls((x / scale) * w[:, None], t * w)
    return np.maximum(coef_scaled / scale, 0.0), method             # nnls can return -0.0


def fit_stats(pred: np.ndarray, t: np.ndarray) -> dict[str, float]:
    """R² (unweighted), mean and worst |pred − t|/t (fractions) and RMSE (seconds) of predictions."""
    ss_res = float(np.sum((pred - t) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    ape = np.abs(pred - t) / t
    return {"r2": r2, "mape": float(ape.mean()), "max_ape": float(ape.max()), "rmse_s": math.sqrt(ss_res / len(t))}


def cost_features(cost: StepCost) -> list[float]:
    """The regressors of ParametricLatency, in COEFFICIENT_NAMES order."""
    return [
        1.0,
        cost.n_prefill_tokens,
        cost.n_decode_tokens,
        cost.attn_ctx_tokens,
        cost.kv_copy_bytes,
        cost.kv_shift_tokens,
        max(cost.n_forward_calls - 1, 0),
        cost.kv_read_tokens_or_estimate(),
    ]


def fit_parametric(rows: Iterable[tuple[StepCost, float]], *, weighting: str = "relative") -> FitResult:
    """Fit non-negative ParametricLatency coefficients to measured `(StepCost, elapsed_s)` rows.

    weighting="relative" minimises Σ((pred−t)/t)² so that short decode steps (most steps, and what TPOT is
    made of) count as much as long prefills; "absolute" minimises Σ(pred−t)².
    Uses scipy.optimize.nnls when scipy is importable, else a numpy Lawson–Hanson (see FitResult.method).
    """
    rows = list(rows)
    x = np.array([cost_features(cost) for cost, _ in rows], dtype=np.float64).reshape(len(rows), -1)
    t = np.array([elapsed for _, elapsed in rows], dtype=np.float64)  # [n_rows]
    coef, method = fit_nonnegative(x, t, weighting=weighting, where="fit_parametric")
    model = ParametricLatency(**dict(zip(COEFFICIENT_NAMES, coef.tolist())))
    return FitResult(model=model, **fit_stats(x @ coef, t), n_rows=len(t), method=method, weighting=weighting)


# --- cross-validation -----------------------------------------------------------------------------


def held_out_predictions(x: np.ndarray, t: np.ndarray, groups: Sequence[object], *,
                         weighting: str = "relative") -> np.ndarray:
    """Each row's prediction by a fit that did not see its group: for every group g, fit on the rows of the
    other groups and predict g's rows (one group per row = leave-one-out)."""
    groups = list(groups)
    if len(groups) != len(t):
        raise ValueError(f"held_out_predictions: {len(groups)} groups for {len(t)} rows")
    pred = np.empty(len(t))
    for held in held_out_folds(groups, "held_out_predictions"):
        coef, _ = fit_nonnegative(x[~held], t[~held], weighting=weighting, where="cross-validation")
        pred[held] = x[held] @ coef
    return pred


def held_out_folds(groups: Sequence[object], where: str):
    """For each group (in first-seen order), the boolean mask of its rows; ValueError when a single group
    would leave nothing to fit on."""
    groups = list(groups)
    for g in dict.fromkeys(groups):
        held = np.array([h == g for h in groups])
        if held.all():
            raise ValueError(f"{where}: a single group leaves nothing to fit on")
        yield held


def error_summary(pred: np.ndarray, t: np.ndarray, kinds: Sequence[str]) -> dict[str, dict[str, float]]:
    """|pred − t|/t over all rows ("all") and per kind: mean (mape), median, max (fractions) and count."""
    ape = np.abs(np.asarray(pred) - t) / t
    kinds = np.asarray(list(kinds))
    out = {}
    for name in ["all", *dict.fromkeys(kinds.tolist())]:
        sel = ape if name == "all" else ape[kinds == name]
        out[name] = {"mape": float(sel.mean()), "median_ape": float(np.median(sel)), "max_ape": float(sel.max()),
                     "n": int(sel.size)}
    return out


# --- registry -------------------------------------------------------------------------------------
