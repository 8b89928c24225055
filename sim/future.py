"""The future requests of a workload, for the offline Belady eviction oracle (`policies.eviction.Belady`).

"Next use" of a prompt-cache entry E at simulated time t: the order key of the first request not yet
submitted at t whose prompt shares at least `ceil(F_KEEP_MIN * len(E))` leading tokens with E. That is
the least a load accepts (`server_prompt_cache::load` skips entries with f_keep < 0.25), so no request
earlier in the order can restore any part of E, and this one can. It ignores how much of the entry the
request reuses and whether a slot already holds the same tokens; a request that shares less than a
quarter of E does not count as a use.

Order keys:
- open loop (`Trace`): the arrival time; a request is submitted once the clock reaches it. Exact, and
  the same under every policy.
- closed loop (`ChatWorkload`): a turn's nominal time, session start + the think times up to it (service
  time left out, so it is policy-independent); a turn counts as submitted when the driver submits it.
  Real turns run later than nominal ones by their sessions' service times, and by different amounts under
  different policies, so in closed loop the oracle ranks future requests by a forecast, not by their
  real order: its victims are near-optimal, not optimal. The prompts themselves are exact (replies are
  the simulator's deterministic stand-in tokens; a turn that fails ends its session, and its later turns
  then look like future uses that never come).

Cost: every prompt is materialized once when the oracle is bound (memory ~ total prompt tokens).
Queries are amortized: an entry's answer is cached until that request is submitted, and the scan then
resumes where it stopped (requests scanned before it were not matches or were already submitted).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from engine.core.tokens import token_array

F_KEEP_MIN = 0.25   # upstream's load threshold


class FutureRequests:
    """`next_use(entry)` / `forget(entry)` for `Belady`; `mark_submitted(index)` from the driver."""

    def __init__(self, requests: Sequence[tuple[float, int, list[int]]], clock_ns: Callable[[], int],
                 *, by_time: bool) -> None:
        """`requests`: (order key in seconds, request index, prompt tokens). `by_time`: a request is
        submitted once `clock_ns()` reaches its key (open loop: the driver's integer-ns arrival time);
        otherwise when `mark_submitted` names it (closed loop)."""
        self.clock_ns = clock_ns
        self.by_time = by_time
        self._submitted: set[int] = set()
        buckets: dict[int, list[tuple[float, int, list[int], int]]] = {}
        for key, index, tokens in sorted(requests, key=lambda r: (r[0], r[1])):
            if tokens:
                buckets.setdefault(tokens[0], []).append((key, index, tokens, round(key * 1e9)))
        self._buckets = buckets
        self._answers: dict[int, tuple[int, int, float]] = {}   # entry id -> (m, bucket position, key)

    def mark_submitted(self, index: int) -> None:
        self._submitted.add(index)

    def _is_past(self, row: tuple[float, int, list[int], int]) -> bool:
        if self.by_time:
            return row[3] <= self.clock_ns()
        return row[1] in self._submitted

    def next_use(self, entry: Any, min_share: float = F_KEEP_MIN) -> float:
        tokens = entry.tokens
        bucket = self._buckets.get(tokens[0]) if tokens else None
        if not bucket:
            return math.inf
        m = max(1, math.ceil(min_share * len(tokens)))
        ans = self._answers.get(entry.id)
        pos = 0
        if ans is not None and ans[0] == m:
            _, pos, key = ans
            if key == math.inf or not self._is_past(bucket[pos]):
                return key
        head = tokens[:m]
        found = math.inf
        while pos < len(bucket):
            row = bucket[pos]
            prompt = row[2]
            if len(prompt) >= m and prompt[:m] == head and not self._is_past(row):
                found = row[0]
                break
            pos += 1
        self._answers[entry.id] = (m, min(pos, len(bucket) - 1), found)
        return found

    def forget(self, entry: Any) -> None:
        self._answers.pop(entry.id, None)


def chat_requests(workload: Any, space: Any, reply: Callable[[int, int], list[int]],
                  as_array: bool = False) -> list[tuple[float, int, list[int]]]:
    """(nominal time, request index, prompt) of every turn of a ChatWorkload, with the driver's replies;
    prompts as array('i') with `as_array` (a core keeping arrays: a list never equals an array)."""
    out = []
    index = 0
    for sess in workload.sessions:
        t = sess.start_s
        replies: list[list[int]] = []
        for k, turn in enumerate(sess.turns):
            if k > 0:
                t += turn.think_s
            prompt = workload.prompt_tokens(sess.session_id, k, space, replies)
            out.append((t, index, token_array(prompt) if as_array else prompt))
            replies.append(reply(index, turn.n_output))
            index += 1
    return out


def trace_requests(trace: Any, materializer: Any, as_array: bool = False) -> list[tuple[float, int, list[int]]]:
    prompt = materializer.prompt_array if as_array else materializer.prompt
    return [(r.arrival_s, r.index, prompt(r)) for r in trace.requests]
