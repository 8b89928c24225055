"""The serving core: llama-server's scheduling semantics, written once, driven by any backend.

Pure Python: imports nothing of the project and never simpy, numpy or `time` (time is injected as now_s).
"""

from engine.core.config import PolicyNames, ResolvedConfig, ServerConfig
from engine.core.errors import ConfigError, ErrorType
from engine.core.recorder import NullRecorder, Recorder
from engine.core.loop import Step, StepFailed, run_until_idle, step
from engine.core.server import ServerCore
from engine.core.types import (BatchPlan, Chunk, ForwardCall, KVOp, SlotState, StepResult, Task, TaskError,
                               TokenEvent)

__all__ = [
    "BatchPlan", "Chunk", "ConfigError", "ErrorType", "ForwardCall", "KVOp", "NullRecorder", "PolicyNames",
    "Recorder", "ResolvedConfig", "ServerConfig", "ServerCore", "SlotState", "Step", "StepFailed", "StepResult",
    "Task", "TaskError", "TokenEvent", "run_until_idle", "step",
]
