"""Open-loop synthetic traces: arrivals from a process, lengths from distributions, all from one seed."""

from __future__ import annotations

from dataclasses import replace

from traces.schema import Trace, TraceRequest
from traces.synthetic import _rng
from traces.synthetic.arrivals import ArrivalProcess
from traces.synthetic.lengths import LengthLike, as_length_dist


def open_loop(n: int, arrivals: ArrivalProcess, prompt_lengths: LengthLike, output_lengths: LengthLike,
              seed: int) -> Trace:
    """`n` independent requests; arrivals, prompt and output lengths each use their own stream of `seed`."""
    if n < 0:
        raise ValueError(f"open_loop: n must be >= 0, got {n}")
    prompt_dist, output_dist = as_length_dist(prompt_lengths), as_length_dist(output_lengths)
    times = arrivals.times(n, _rng.stream(seed, _rng.ARRIVALS)).tolist()
    n_prompt = prompt_dist.sample(n, _rng.stream(seed, _rng.PROMPT)).tolist()
    n_output = output_dist.sample(n, _rng.stream(seed, _rng.OUTPUT)).tolist()
    requests = [TraceRequest(i, times[i], n_prompt[i], n_output[i]) for i in range(n)]
    source = f"open_loop(n={n}, arrivals={arrivals!r}, prompt={prompt_dist!r}, output={output_dist!r}, seed={seed})"
    return Trace(requests, "synthetic", source)


def retime(trace: Trace, arrivals: ArrivalProcess, seed: int) -> Trace:
    """The same requests (order, lengths, content) with new arrival times, e.g. for a length-only trace."""
    times = arrivals.times(len(trace), _rng.stream(seed, _rng.ARRIVALS)).tolist()
    requests = [replace(r, arrival_s=t) for r, t in zip(trace.requests, times)]
    return Trace(requests, trace.format, f"{trace.source} retimed by {arrivals!r} seed={seed}",
                 trace.n_skipped, trace.errors)
