"""Reuse workloads for the eviction study: deterministic, bounded, and sharing the prefixes they promise."""

from collections import Counter

from traces import PromptMaterializer, TokenSpace
from traces.synthetic.reuse import tenants, zipf_conversations


def test_zipf_conversations_revisit_popular_conversations_with_growing_prefixes():
    t = zipf_conversations(400, 50, 1.2, 1.0, max_context=3000, seed=3)
    assert t.requests == zipf_conversations(400, 50, 1.2, 1.0, max_context=3000, seed=3).requests
    assert all(r.n_prompt <= 3000 for r in t)
    visits = Counter(r.session_id.split(".")[0] for r in t)
    top, n_top = visits.most_common(1)[0]
    assert n_top > 400 / 50 * 2                 # skewed: the top rank gets far more than its even share
    by_conv: dict[str, list] = {}
    for r in t:
        by_conv.setdefault(r.session_id, []).append(r)
    for reqs in by_conv.values():               # each visit's prompt extends the previous one
        for a, b in zip(reqs, reqs[1:]):
            assert b.block_hashes[:len(a.block_hashes)] == a.block_hashes


def test_tenants_share_their_system_prompt_and_nothing_else():
    t = tenants(200, 8, 1.0, 1.0, seed=1)
    mat = PromptMaterializer(TokenSpace(), 0)
    by_tenant: dict[str, list] = {}
    for r in t:
        by_tenant.setdefault(r.session_id, []).append(r)
    assert len(set(Counter(r.session_id for r in t).values())) > 1      # unequal rates
    reqs = next(v for v in by_tenant.values() if len(v) >= 2)
    a, b = mat.prompt(reqs[0]), mat.prompt(reqs[1])
    n_sys = len(reqs[0].block_hashes) * reqs[0].block_size
    assert a[:n_sys] == b[:n_sys] and a[n_sys:n_sys + 8] != b[n_sys:n_sys + 8]
