"""Latency models by name: `get_latency_model("constant:0.01")`, `"default"`, `"parametric:PATH.json"` (the
model the calibration file names), `"simple:PATH.json"` / `"physical:PATH.json"` (one of its two models),
`"roofline:MODEL@HW"`, `"scaled:FACTOR:SPEC"` (another spec's step times times FACTOR). The one registry every
command reads (`--latency SPEC`).

It sits above the models it names (`sim.latency` defines the constant and parametric models and their
shared step cost; `sim.roofline` builds on them), so imports point one way. Add a model by writing its
class and one `NAME -> factory(arg)` entry in `LATENCY_MODELS`.
"""

from __future__ import annotations

from collections.abc import Callable

from sim.latency import DEFAULT_CALIBRATION_PATH, ConstantLatency, LatencyModel, ScaledLatency, load_calibration
from sim.latency_physical import load_latency_file
from sim.roofline import roofline_from_spec


def _constant_from_arg(arg: str) -> LatencyModel:
    parts = arg.split(":") if arg else []
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"latency model 'constant:{arg}': expected constant:STEP_S[:PER_TOKEN_S]")
    try:
        values = [float(p) for p in parts]
    except ValueError as exc:
        raise ValueError(f"latency model 'constant:{arg}': not a number ({exc})") from exc
    return ConstantLatency(*values)


def _default_from_arg(arg: str) -> LatencyModel:
    if arg:
        raise ValueError(f"latency model 'default:{arg}': 'default' takes no argument")
    return load_calibration(DEFAULT_CALIBRATION_PATH)


def _parametric_from_arg(arg: str) -> LatencyModel:
    if not arg:
        raise ValueError("latency model 'parametric': expected parametric:PATH.json")
    return load_latency_file(arg)


def _simple_from_arg(arg: str) -> LatencyModel:
    if not arg:
        raise ValueError("latency model 'simple': expected simple:PATH.json (a calibration file)")
    return load_latency_file(arg, "simple")


def _physical_from_arg(arg: str) -> LatencyModel:
    if not arg:
        raise ValueError("latency model 'physical': expected physical:PATH.json (a calibration file)")
    return load_latency_file(arg, "physical")


def _table_from_arg(arg: str) -> LatencyModel:
    if not arg:
        raise ValueError("latency model 'table': expected table:PATH.json (a calibration file)")
    return load_latency_file(arg, "table")


def _roofline_from_arg(arg: str) -> LatencyModel:
    return roofline_from_spec(arg)


def _scaled_from_arg(arg: str) -> LatencyModel:
    factor, _, spec = arg.partition(":")
    if not factor or not spec:
        raise ValueError(f"latency model 'scaled:{arg}': expected scaled:FACTOR:SPEC, e.g. "
                         "scaled:1.2:parametric:cal.json")
    try:
        value = float(factor)
    except ValueError as exc:
        raise ValueError(f"latency model 'scaled:{arg}': FACTOR {factor!r} is not a number") from exc
    return ScaledLatency(get_latency_model(spec), value)


LATENCY_MODELS: dict[str, Callable[[str], LatencyModel]] = {
    "constant": _constant_from_arg,  # constant:STEP_S[:PER_TOKEN_S]
    "default": _default_from_arg,  # default (the shipped sim/data/default_calibration.json)
    "parametric": _parametric_from_arg,  # parametric:PATH.json (the file's `model`: simple, physical or table)
    "simple": _simple_from_arg,  # simple:PATH.json (ParametricLatency of a calibration file)
    "physical": _physical_from_arg,  # physical:PATH.json (PhysicalLatency of a calibration file)
    "table": _table_from_arg,  # table:PATH.json (PhysicalLatency with its per-call table, calibration file)
    "roofline": _roofline_from_arg,  # roofline:MODEL_PRESET_OR_GGUF[:WEIGHTS_DTYPE[:KV_DTYPE]]@HW_PRESET
    "scaled": _scaled_from_arg,  # scaled:FACTOR:SPEC (ScaledLatency: SPEC's step times times FACTOR)
}
LATENCY_MODEL_SYNTAX = (
    "constant:STEP_S[:PER_TOKEN_S]",
    "default",
    "parametric:PATH.json",
    "simple:PATH.json",
    "physical:PATH.json",
    "table:PATH.json",
    "roofline:MODEL_PRESET_OR_GGUF[:WEIGHTS_DTYPE[:KV_DTYPE]]@HW_PRESET",
    "scaled:FACTOR:SPEC",
)


def get_latency_model(spec: str) -> LatencyModel:
    """Build a latency model from a spec string such as "constant:0.01" or "roofline:llama-2-7b@a100-80gb"."""
    name, _, arg = spec.strip().partition(":")
    factory = LATENCY_MODELS.get(name)
    if factory is None:
        raise ValueError(f"unknown latency model {spec!r}; choices: {', '.join(LATENCY_MODEL_SYNTAX)}")
    return factory(arg)
