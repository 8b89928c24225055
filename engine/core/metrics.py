"""Server counters with the meanings of llama-server's `/metrics` (`server_metrics` in server-context.cpp).

`*_total` fields never reset; the bucket fields feed the rate gauges and reset on each scrape, as upstream.
The slotlab extras (context shifts, purges, halvings, rejections) are not upstream metrics.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Metrics:
    n_prompt_tokens_processed_total: int = 0   # prompt tokens evaluated (cached ones excluded)
    n_prompt_tokens_cached_total: int = 0      # prompt tokens reused from the slot / RAM cache
    t_prompt_processing_total_s: float = 0.0
    n_tokens_predicted_total: int = 0
    t_tokens_generation_total_s: float = 0.0
    n_decode_total: int = 0                    # llama_decode calls
    n_busy_slots_total: int = 0                # Σ busy slots over decode calls
    n_tokens_max: int = 0
    # rate buckets (reset by `reset_bucket`)
    n_prompt_tokens_processed: int = 0
    t_prompt_processing_s: float = 0.0
    n_tokens_predicted: int = 0
    t_tokens_generation_s: float = 0.0
    # slotlab extras
    n_tasks_finished: int = 0
    n_tasks_errored: int = 0
    n_deferrals: int = 0
    n_context_shifts: int = 0
    n_kv_purges: int = 0
    n_batch_halvings: int = 0

    def reset_bucket(self) -> None:
        self.n_prompt_tokens_processed = 0
        self.t_prompt_processing_s = 0.0
        self.n_tokens_predicted = 0
        self.t_tokens_generation_s = 0.0

    @property
    def n_busy_slots_per_decode(self) -> float:
        return self.n_busy_slots_total / max(self.n_decode_total, 1)
