"""Synthetic workloads from an explicit seed: arrival processes, length distributions, open-loop traces
and closed-loop multi-turn chat sessions."""

from traces.synthetic.arrivals import ArrivalProcess, BurstArrivals, GammaArrivals, PoissonArrivals
from traces.synthetic.chat import (DEFAULT_CHAT, ChatSession, ChatWorkload, Turn, chat_sessions,
                                   default_chat_workload)
from traces.synthetic.chat_io import load_chat_workload, save_chat_workload
from traces.synthetic.lengths import (ConstantLength, EmpiricalLength, LengthDist, LengthLike, UniformLength,
                                      ZipfLength, as_length_dist)
from traces.synthetic.open_loop import open_loop, retime

__all__ = ["DEFAULT_CHAT", "ArrivalProcess", "BurstArrivals", "ChatSession", "ChatWorkload", "ConstantLength",
           "EmpiricalLength", "GammaArrivals", "LengthDist", "LengthLike", "PoissonArrivals", "Turn",
           "UniformLength", "ZipfLength", "as_length_dist", "chat_sessions", "default_chat_workload",
           "load_chat_workload", "open_loop", "retime", "save_chat_workload"]
