"""Open-loop workloads with prompt reuse that eviction policies can tell apart, generated from a seed.

Prompts are prefix-hash blocks (`TraceRequest.block_hashes`, as the Mooncake trace), so equal blocks are
equal tokens and the host-RAM prompt cache sees real prefix sharing:

- `zipf_conversations`: many conversations of unequal popularity (Zipf over ranks); each request
  continues one of them, so its prompt is that conversation's earlier turns plus a new user turn. Popular
  conversations come back soon, the tail after long gaps. Reuse is controlled by `zipf_s` (skew: higher =
  fewer conversations get most requests) and `n_conversations` (more = longer gaps between revisits).
- `tenants`: many tenants, each with its own long system prompt, at unequal rates (Zipf weights); a
  request is its tenant's system prompt plus a unique user part. Reuse is controlled by `rate_s` (skew of
  the tenants' rates) and `n_tenants`.

Arrivals are Poisson at `rate` requests per second.
"""

from __future__ import annotations

import numpy as np

from traces.schema import Trace, TraceRequest
from traces.synthetic import _rng
from traces.synthetic.lengths import LengthLike, as_length_dist
from traces.tokens import stream_key

# stream tags of these generators (beyond traces.synthetic._rng's)
_PICK, _TURN_LEN, _SYS_LEN, _PERM = 21, 22, 23, 24
_DOMAIN_CONV, _DOMAIN_TENANT = 11, 12


def _zipf_weights(n: int, s: float) -> np.ndarray:
    w = np.arange(1, n + 1, dtype=np.float64) ** -float(s)
    return w / w.sum()


def _arrivals(n: int, rate: float, seed: int) -> list[float]:
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    gaps = _rng.stream(seed, _rng.ARRIVALS).exponential(1.0 / rate, n)
    return np.cumsum(gaps).tolist()


def _blocks(n_tokens: int, block_size: int) -> int:
    return max(1, -(-n_tokens // block_size))


def zipf_conversations(n_requests: int, n_conversations: int, zipf_s: float, rate: float, *,
                       system_tokens: LengthLike = (100, 400), user_tokens: LengthLike = (30, 200),
                       assistant_tokens: LengthLike = (50, 300), output_tokens: LengthLike = (16, 64),
                       max_context: int = 4096, block_size: int = 16, seed: int = 0) -> Trace:
    """`n_requests` turns spread over `n_conversations` conversations by Zipf(`zipf_s`) popularity.

    Visit j of a conversation sends its system prompt, the j earlier (user, assistant) turns and a new user
    turn. A conversation whose next prompt would pass `max_context` tokens ends; the next request for that
    popularity rank starts a fresh conversation (new content), so contexts stay bounded.
    """
    if n_conversations < 1 or n_requests < 0:
        raise ValueError("zipf_conversations: need n_conversations >= 1 and n_requests >= 0")
    times = _arrivals(n_requests, rate, seed)
    picks = _rng.stream(seed, _PICK).choice(n_conversations, size=n_requests,
                                            p=_zipf_weights(n_conversations, zipf_s)).tolist()
    lens = _rng.stream(seed, _TURN_LEN)
    sys_d, user_d, asst_d = (as_length_dist(x) for x in (system_tokens, user_tokens, assistant_tokens))
    n_out = as_length_dist(output_tokens).sample(n_requests, _rng.stream(seed, _rng.OUTPUT)).tolist()
    epoch = [0] * n_conversations                     # how many conversations this rank has started
    history: list[list[int] | None] = [None] * n_conversations  # block hashes of the current conversation
    requests = []
    for i, (t, c) in enumerate(zip(times, picks)):
        hist = history[c]
        user = int(user_d.sample(1, lens)[0])
        asst = int(asst_d.sample(1, lens)[0])
        key = stream_key(seed, _DOMAIN_CONV, c, epoch[c])
        if hist is not None and (len(hist) + _blocks(user, block_size)) * block_size > max_context:
            hist = None
            epoch[c] += 1
            key = stream_key(seed, _DOMAIN_CONV, c, epoch[c])
        if hist is None:
            n_sys = _blocks(int(sys_d.sample(1, lens)[0]), block_size)
            hist = [stream_key(key, 0, b) for b in range(n_sys)]
        turn = len(hist)
        user_blocks = [stream_key(key, 1, turn, b) for b in range(_blocks(user, block_size))]
        prompt = hist + user_blocks
        requests.append(TraceRequest(i, t, len(prompt) * block_size, n_out[i], session_id=f"conv-{c}.{epoch[c]}",
                                     block_hashes=tuple(prompt), block_size=block_size))
        # the conversation's record of this turn: the user turn and the assistant's reply
        history[c] = prompt + [stream_key(key, 2, turn, b) for b in range(_blocks(asst, block_size))]
    source = (f"zipf_conversations(n_requests={n_requests}, n_conversations={n_conversations}, zipf_s={zipf_s}, "
              f"rate={rate}, max_context={max_context}, seed={seed})")
    return Trace(requests, "synthetic", source)


def tenants(n_requests: int, n_tenants: int, rate_s: float, rate: float, *,
            system_tokens: LengthLike = (800, 3000), user_tokens: LengthLike = (50, 400),
            output_tokens: LengthLike = (16, 64), block_size: int = 16, seed: int = 0) -> Trace:
    """`n_requests` requests from `n_tenants` tenants whose shares of the traffic follow Zipf(`rate_s`) by a
    random rank; each request = the tenant's system prompt (shared blocks) + a unique user part."""
    if n_tenants < 1 or n_requests < 0:
        raise ValueError("tenants: need n_tenants >= 1 and n_requests >= 0")
    times = _arrivals(n_requests, rate, seed)
    weights = _zipf_weights(n_tenants, rate_s)[_rng.stream(seed, _PERM).permutation(n_tenants)]
    picks = _rng.stream(seed, _PICK).choice(n_tenants, size=n_requests, p=weights).tolist()
    sys_len = as_length_dist(system_tokens).sample(n_tenants, _rng.stream(seed, _SYS_LEN)).tolist()
    n_user = as_length_dist(user_tokens).sample(n_requests, _rng.stream(seed, _rng.USER_LEN)).tolist()
    n_out = as_length_dist(output_tokens).sample(n_requests, _rng.stream(seed, _rng.OUTPUT)).tolist()
    systems = [tuple(stream_key(seed, _DOMAIN_TENANT, k, b) for b in range(_blocks(n, block_size)))
               for k, n in enumerate(sys_len)]
    requests = []
    for i, (t, k) in enumerate(zip(times, picks)):
        blocks = systems[k]
        # the user part comes from the request's unique stream (the materializer fills past the blocks)
        requests.append(TraceRequest(i, t, len(blocks) * block_size + n_user[i], n_out[i], session_id=f"tenant-{k}",
                                     block_hashes=blocks, block_size=block_size))
    source = f"tenants(n_requests={n_requests}, n_tenants={n_tenants}, rate_s={rate_s}, rate={rate}, seed={seed})"
    return Trace(requests, "synthetic", source)
