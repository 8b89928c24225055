"""Closed-loop multi-turn chat sessions: the workload where slot reuse and the host-RAM prompt cache matter.

A session sends turn 0 at `start_s`; turn k > 0 is sent `turns[k].think_s` seconds after the reply to
turn k-1 has finished, or, when the turn has a `send_at_s` (`slotlab validate --arrivals real`: the times a real
run's turns arrived), at that time, or as soon as the reply to turn k-1 has finished if that is later. Turn k's prompt is `system + u0 + g0 + u1 + g1 + ... + uk`, where u are the user
tokens below and g the tokens generated for the earlier turns (the simulator's, or `reply_tokens`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from traces.synthetic import _rng
from traces.synthetic.lengths import LengthLike, UniformLength, as_length_dist
from traces.tokens import DOMAIN_REPLY, DOMAIN_SYSTEM, DOMAIN_USER, PromptMaterializer, TokenSpace, stream_key


@dataclass(frozen=True, slots=True)
class Turn:
    n_user: int          # new user tokens appended in this turn
    n_output: int        # tokens the reply generates (the request's n_predict)
    think_s: float       # wait after the previous reply before sending this turn; 0.0 for turn 0
    send_at_s: float | None = None   # instead: sent at this time (not before the previous reply has finished)


@dataclass(frozen=True, slots=True)
class ChatSession:
    session_id: str
    start_s: float
    system_prompt_id: int          # index into ChatWorkload.system_prompt_lengths (shared prompts)
    turns: tuple[Turn, ...]


def session_key(session_id: str) -> int:
    """A stable 64-bit number for a session id (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(session_id.encode(), digest_size=8).digest(), "little")


@lru_cache(maxsize=8)
def _materializer(space: TokenSpace, seed: int) -> PromptMaterializer:
    """One shared materializer per (space, seed): building one costs a 49k-entry id table (milliseconds), and
    its state is only caches that never change a result, so every prompt of a workload can share it."""
    return PromptMaterializer(space, seed)


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """Sessions plus the shared system prompts; every token is a pure function of `seed`."""

    sessions: tuple[ChatSession, ...]
    system_prompt_lengths: tuple[int, ...]
    seed: int
    _by_id: dict[str, ChatSession] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_id = {s.session_id: s for s in self.sessions}
        if len(by_id) != len(self.sessions):
            raise ValueError("ChatWorkload: session ids must be unique")
        for s in self.sessions:
            if not 0 <= s.system_prompt_id < len(self.system_prompt_lengths):
                raise ValueError(f"ChatWorkload: session {s.session_id!r} names system prompt "
                                 f"{s.system_prompt_id}, but there are {len(self.system_prompt_lengths)}")
        object.__setattr__(self, "_by_id", by_id)

    @property
    def n_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def session(self, session_id: str) -> ChatSession:
        return self._by_id[session_id]

    def context_tokens(self, session_id: str) -> int:
        """Tokens in the session's context after its last reply (system + all user + all generated)."""
        s = self._by_id[session_id]
        return self.system_prompt_lengths[s.system_prompt_id] + sum(t.n_user + t.n_output for t in s.turns)

    @property
    def max_context_tokens(self) -> int:
        return max((self.context_tokens(s.session_id) for s in self.sessions), default=0)

    def system_prompt_tokens(self, i: int, space: TokenSpace) -> list[int]:
        key = stream_key(self.seed, DOMAIN_SYSTEM, i)
        return _materializer(space, self.seed).tokens(key, self.system_prompt_lengths[i])

    def user_tokens(self, session_id: str, turn_index: int, space: TokenSpace) -> list[int]:
        n = self._by_id[session_id].turns[turn_index].n_user
        key = stream_key(self.seed, DOMAIN_USER, session_key(session_id), turn_index)
        return _materializer(space, self.seed).tokens(key, n)

    def reply_tokens(self, session_id: str, turn_index: int, space: TokenSpace) -> list[int]:
        """A deterministic stand-in for the reply to a turn (n_output tokens), for drivers that do not
        generate their own."""
        n = self._by_id[session_id].turns[turn_index].n_output
        key = stream_key(self.seed, DOMAIN_REPLY, session_key(session_id), turn_index)
        return _materializer(space, self.seed).tokens(key, n)

    def prompt_tokens(self, session_id: str, turn_index: int, space: TokenSpace,
                      replies: list[list[int]] | None = None) -> list[int]:
        """Turn `turn_index`'s full prompt: system + u0 + g0 + ... + uk, with g_j = replies[j] if given
        (what was really generated) else `reply_tokens`."""
        s = self._by_id[session_id]
        out = self.system_prompt_tokens(s.system_prompt_id, space)
        for j in range(turn_index):
            out += self.user_tokens(session_id, j, space)
            out += replies[j] if replies is not None else self.reply_tokens(session_id, j, space)
        out += self.user_tokens(session_id, turn_index, space)
        return out


def chat_sessions(n_users: int, turns_per_user: int | tuple[int, int], think_time_s: float,
                  system_prompt_pool: int, system_prompt_len: LengthLike, user_tokens: LengthLike,
                  output_tokens: LengthLike, start_spread_s: float, seed: int) -> ChatWorkload:
    """Generate `n_users` sessions.

    turns_per_user: a count or an inclusive (lo, hi) range; think_time_s: mean of exponential think
    times (0 = none); system_prompt_pool: how many distinct system prompts exist (each user picks one
    uniformly); lengths: an int, an inclusive (lo, hi) range or a LengthDist; sessions start uniformly in
    [0, start_spread_s] and are numbered in start order (`user-000`, ...).
    """
    if n_users < 0 or system_prompt_pool < 1 or think_time_s < 0 or start_spread_s < 0:
        raise ValueError("chat_sessions: need n_users >= 0, system_prompt_pool >= 1, think_time_s >= 0, "
                         "start_spread_s >= 0")
    lo, hi = (turns_per_user, turns_per_user) if isinstance(turns_per_user, int) else turns_per_user
    if not 1 <= lo <= hi:
        raise ValueError(f"chat_sessions: turns_per_user must be >= 1, got {turns_per_user!r}")
    system_lengths = as_length_dist(system_prompt_len).sample(system_prompt_pool,
                                                              _rng.stream(seed, _rng.SYSTEM_LEN)).tolist()
    starts = np.sort(_rng.stream(seed, _rng.SESSION_START).uniform(0.0, start_spread_s, n_users)).tolist()
    n_turns = UniformLength(lo, hi).sample(n_users, _rng.stream(seed, _rng.SESSION_TURNS)).tolist()
    picks = _rng.stream(seed, _rng.SYSTEM_PICK).integers(0, system_prompt_pool, n_users).tolist()
    total = sum(n_turns)
    n_user = as_length_dist(user_tokens).sample(total, _rng.stream(seed, _rng.USER_LEN)).tolist()
    n_output = as_length_dist(output_tokens).sample(total, _rng.stream(seed, _rng.OUTPUT)).tolist()
    think = (_rng.stream(seed, _rng.THINK).exponential(think_time_s, total) if think_time_s > 0
             else np.zeros(total)).tolist()
    width = max(3, len(str(max(n_users - 1, 0))))
    sessions = []
    k = 0
    for u in range(n_users):
        turns = tuple(Turn(n_user[k + j], n_output[k + j], think[k + j] if j > 0 else 0.0)
                      for j in range(n_turns[u]))
        k += n_turns[u]
        sessions.append(ChatSession(f"user-{u:0{width}d}", starts[u], picks[u], turns))
    return ChatWorkload(tuple(sessions), tuple(system_lengths), seed)


# The workload of `slotlab simulate` with no arguments (docs/traces.md says why these numbers).
DEFAULT_CHAT = {"n_users": 32, "turns_per_user": (4, 8), "think_time_s": 30.0, "system_prompt_pool": 4,
                "system_prompt_len": (200, 500), "user_tokens": (20, 120), "output_tokens": (30, 150),
                "start_spread_s": 120.0}


def default_chat_workload(seed: int = 0) -> ChatWorkload:
    """32 users, 4-8 turns each, 4 shared system prompts of 200-500 tokens, think time 30 s (mean,
    exponential), user turns 20-120 tokens, replies 30-150 tokens, users arriving over 120 s."""
    return chat_sessions(**DEFAULT_CHAT, seed=seed)
