"""One schema for every workload trace: a list of requests with arrival times, lengths and, when the
trace has them, real token ids or prefix-block hashes (what prompt-cache studies need)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    `arrival_s` is seconds from the trace start. Readers of absolute-time formats (Azure) put the first
    request at 0.0; relative-time formats (BurstGPT, Vidur, Mooncake, native) keep their own times.
    Prompt content, most specific first: `prompt_tokens` (real ids, then `n_prompt == len(prompt_tokens)`),
    else `block_hashes` (equal hash = identical block of `block_size` tokens; the prompt is its blocks in
    order, the last one cut so the total is `n_prompt`), else lengths only.

    Recorded requests (`slotlab record`) may also carry `output_tokens` (the ids the server generated, so a
    simulation generates exactly them), `sampling` (the request's generation parameters as sent: n_predict,
    temperature, seed, ignore_eos, id_slot, cache_prompt, ...) and `recorded` (the upstream's answer: timings,
    slot, cached tokens, end time; docs/traces.md §3).
    """

    index: int                                   # 0-based position in the trace
    arrival_s: float
    n_prompt: int
    n_output: int
    session_id: str | None = None
    prompt_tokens: tuple[int, ...] | None = None
    block_hashes: tuple[int, ...] = ()
    block_size: int = 0                          # tokens per hash in block_hashes; 0 = no blocks
    source_line: int = 0                         # 1-based line in the source file; 0 = generated
    # recorded traffic (native traces written by `slotlab record`); None for every other trace
    output_tokens: tuple[int, ...] | None = None  # the generated ids, EOS included; n_output == len(...)
    sampling: dict[str, Any] | None = field(default=None, hash=False)   # the request's generation fields
    recorded: dict[str, Any] | None = field(default=None, hash=False)   # what the upstream answered/measured


@dataclass(slots=True)
class Trace:
    """Requests in arrival order plus where they came from.

    `n_skipped` counts rows dropped by `skip_bad_rows=True`; `errors` keeps the first few of their
    messages so a caller can report what was wrong.
    """

    requests: list[TraceRequest]
    format: str
    source: str
    n_skipped: int = 0
    errors: tuple[str, ...] = field(default=(), repr=False)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def __getitem__(self, i: int) -> TraceRequest:
        return self.requests[i]

    @property
    def duration_s(self) -> float:
        """Time from the first to the last arrival (0.0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def mean_rps(self) -> float:
        """Mean request rate: inter-arrival gaps per second, (n - 1) / duration_s (the Poisson MLE).

        0.0 when the rate is undefined (fewer than two requests or all at the same instant).
        """
        d = self.duration_s
        return (len(self.requests) - 1) / d if d > 0 else 0.0

    @property
    def n_prompt_total(self) -> int:
        return sum(r.n_prompt for r in self.requests)

    @property
    def n_output_total(self) -> int:
        return sum(r.n_output for r in self.requests)

    def scaled(self, time_scale: float | None = None, target_rps: float | None = None) -> Trace:
        """A copy with every arrival time multiplied by a factor (order kept, lengths untouched).

        Give exactly one of: `time_scale` (2.0 = twice as slow, half the rate) or `target_rps` (the factor
        that makes `mean_rps` equal to it; needs at least two distinct arrival times).
        """
        if (time_scale is None) == (target_rps is None):
            raise ValueError("scaled(): give exactly one of time_scale or target_rps")
        if target_rps is not None:
            if not target_rps > 0:
                raise ValueError(f"scaled(): target_rps must be > 0, got {target_rps!r}")
            if self.mean_rps == 0.0:
                raise ValueError("scaled(): the trace has no duration, so it has no rate to rescale")
            factor = self.mean_rps / target_rps
        else:
            factor = float(time_scale)  # type: ignore[arg-type]
            if not factor > 0:
                raise ValueError(f"scaled(): time_scale must be > 0, got {time_scale!r}")
        requests = [replace(r, arrival_s=r.arrival_s * factor) for r in self.requests]
        return Trace(requests, self.format, self.source, self.n_skipped, self.errors)

    def head(self, n: int) -> Trace:
        """The first `n` requests (all of them if the trace is shorter)."""
        if n < 0:
            raise ValueError(f"head(): n must be >= 0, got {n}")
        return Trace(self.requests[:n], self.format, self.source, self.n_skipped, self.errors)
