"""Context-shift policies: what a full generating slot keeps and discards (`pre_decode`, step 1)."""

from __future__ import annotations


class Half:
    """Upstream: keep n_keep (+1 for BOS; -1 = whole prompt; at most n_ctx - 4), discard n_discard or half of
    the rest, clamped to [0, n_left - 1]."""

    def plan(self, n_tokens: int, n_ctx: int, n_keep: int, n_discard: int, n_prompt: int,
             add_bos: bool) -> tuple[int, int]:
        keep = n_prompt if n_keep < 0 else n_keep
        if add_bos:
            keep += 1
        keep = min(n_ctx - 4, keep)
        n_left = n_tokens - keep
        discard = n_discard if n_discard != 0 else n_left // 2
        discard = max(0, min(discard, max(0, n_left - 1)))
        return keep, discard


class SinkWindow:
    """StreamingLLM: keep `n_sink` attention-sink tokens and a recent window; discard everything between, so
    the slot is back to `window_frac` of its context after a shift."""

    def __init__(self, n_sink: int = 4, window_frac: float = 0.5) -> None:
        if n_sink < 0 or not 0.0 < window_frac < 1.0:
            raise ValueError("sink_window needs n_sink >= 0 and 0 < window_frac < 1")
        self.n_sink = n_sink
        self.window_frac = window_frac

    def plan(self, n_tokens: int, n_ctx: int, n_keep: int, n_discard: int, n_prompt: int,
             add_bos: bool) -> tuple[int, int]:
        keep = min(n_ctx - 4, self.n_sink)
        window = int(n_ctx * self.window_frac)
        n_left = n_tokens - keep
        discard = max(0, min(n_tokens - keep - window, max(0, n_left - 1)))
        return keep, max(discard, 1 if n_left > 1 else 0)
