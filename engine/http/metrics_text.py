"""Prometheus text for `/metrics` with llama-server's `llamacpp:` names, help texts, types and order
(`server_context` METRICS handler, server-task.cpp). Values use C++ ostream formatting (6 significant digits).

slotlab adds, under its own prefix (not upstream): two counters of the prompt and generated tokens of requests
whose client went away before receiving the final result (upstream counts those tokens in its totals too;
these counters let a client reconcile the totals with the responses it received), and for sleeping on idle
(`--sleep-idle-seconds`, for which upstream exports nothing) a counter of sleeps and an `is_sleeping` gauge.
"""

from __future__ import annotations

from dataclasses import dataclass

CONTENT_TYPE = "text/plain; version=0.0.4"


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    n_prompt_tokens_processed_total: int
    n_prompt_tokens_cached_total: int
    t_prompt_processing_total_s: float
    n_tokens_predicted_total: int
    t_tokens_generation_total_s: float
    n_decode_total: int
    n_tokens_max: int
    n_prompt_tokens_processed: int       # bucket since the last scrape
    t_prompt_processing_s: float
    n_tokens_predicted: int
    t_tokens_generation_s: float
    n_processing: int
    n_deferred: int
    n_busy_slots_per_decode: float
    n_cancelled_prompt_tokens: int
    n_cancelled_predicted_tokens: int
    n_sleeps: int = 0                    # times the server fell asleep (--sleep-idle-seconds)
    is_sleeping: int = 0


def _fmt(v: float) -> str:
    return f"{v:g}"


def render(m: MetricsSnapshot) -> str:
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed.", m.n_prompt_tokens_processed_total),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the KV or prompt cache.",
         m.n_prompt_tokens_cached_total),
        ("prompt_seconds_total", "Prompt process time", m.t_prompt_processing_total_s),
        ("tokens_predicted_total", "Number of generation tokens processed.", m.n_tokens_predicted_total),
        ("tokens_predicted_seconds_total", "Predict process time", m.t_tokens_generation_total_s),
        ("n_decode_total", "Total number of llama_decode() calls", m.n_decode_total),
        ("n_tokens_max", "Largest observed n_tokens.", m.n_tokens_max),
        ("spec_decode_num_draft_tokens_total", "Number of speculative draft tokens.", 0),
        ("spec_decode_num_accepted_tokens_total", "Number of accepted speculative draft tokens.", 0),
        ("spec_decode_num_drafts_total", "Number of speculative drafts.", 0),
    ]
    prompt_rate = (1.0 / m.t_prompt_processing_s * m.n_prompt_tokens_processed
                   if m.n_prompt_tokens_processed and m.t_prompt_processing_s > 0 else 0.0)
    gen_rate = (1.0 / m.t_tokens_generation_s * m.n_tokens_predicted
                if m.n_tokens_predicted and m.t_tokens_generation_s > 0 else 0.0)
    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s.", prompt_rate),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s.", gen_rate),
        ("requests_processing", "Number of requests processing.", m.n_processing),
        ("requests_deferred", "Number of requests deferred.", m.n_deferred),
        ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
         m.n_busy_slots_per_decode),
    ]
    lines = []
    for kind, items, prefix in (("counter", counters, "llamacpp:"), ("gauge", gauges, "llamacpp:"),
                                ("counter", [
                                    ("cancelled_prompt_tokens_total",
                                     "slotlab: prompt tokens of requests whose client left before the final result "
                                     "(included in llamacpp:prompt_tokens_total).", m.n_cancelled_prompt_tokens),
                                    ("cancelled_tokens_predicted_total",
                                     "slotlab: generated tokens of requests whose client left before the final "
                                     "result (included in llamacpp:tokens_predicted_total).",
                                     m.n_cancelled_predicted_tokens),
                                    ("sleeps_total", "slotlab: times the server unloaded the model after "
                                     "--sleep-idle-seconds without a task.", m.n_sleeps)], "slotlab:"),
                                ("gauge", [("is_sleeping", "slotlab: 1 while the model is unloaded "
                                            "(--sleep-idle-seconds), else 0.", m.is_sleeping)], "slotlab:")):
        for name, help_text, value in items:
            lines.append(f"# HELP {prefix}{name} {help_text}")
            lines.append(f"# TYPE {prefix}{name} {kind}")
            lines.append(f"{prefix}{name} {_fmt(value)}")
    return "\n".join(lines) + "\n"
