"""Workload traces: one schema (`TraceRequest`, `Trace`), readers for public trace formats
(`read_trace`), deterministic prompt tokens (`PromptMaterializer`) and synthetic generators."""

from traces.errors import TraceFormatError
from traces.readers import FORMATS, detect_format, read_trace, write_native_jsonl
from traces.schema import Trace, TraceRequest
from traces.synthetic import (DEFAULT_CHAT, BurstArrivals, ChatSession, ChatWorkload, ConstantLength, EmpiricalLength,
                              GammaArrivals, PoissonArrivals, Turn, UniformLength, ZipfLength, chat_sessions,
                              default_chat_workload, load_chat_workload, open_loop, retime, save_chat_workload)
from traces.tokens import PromptMaterializer, TokenSpace, materialize_prompt

__all__ = ["DEFAULT_CHAT", "FORMATS", "BurstArrivals", "ChatSession", "ChatWorkload", "ConstantLength", "EmpiricalLength",
           "GammaArrivals", "PoissonArrivals", "PromptMaterializer", "TokenSpace", "Trace", "TraceFormatError",
           "TraceRequest", "Turn", "UniformLength", "ZipfLength", "chat_sessions", "default_chat_workload",
           "detect_format", "load_chat_workload", "materialize_prompt", "open_loop", "read_trace", "retime",
           "save_chat_workload", "write_native_jsonl"]
