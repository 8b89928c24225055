"""Token containers: `common_prefix` on lists, arrays and mixed pairs; the core's array mode."""

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.tokens import common_prefix, token_array


def naive_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# a shared head, then two tails that may differ anywhere (long heads reach the doubling and halving blocks)
pairs = st.tuples(st.integers(0, 3000), st.lists(st.integers(0, 5), max_size=80),
                  st.lists(st.integers(0, 5), max_size=80), st.integers(0, 2 ** 31 - 1))


@settings(max_examples=300, deadline=None)
@given(pairs)
def test_common_prefix_equals_the_naive_walk_for_lists_arrays_and_mixed(p):
    n_head, tail_a, tail_b, seed = p
    head = [(seed * 7 + 13 * i) % 49152 for i in range(n_head)]
    a, b = head + tail_a, head + tail_b
    want = naive_prefix(a, b)
    assert common_prefix(a, b) == want
    assert common_prefix(token_array(a), token_array(b)) == want
    assert common_prefix(a, token_array(b)) == want
    assert common_prefix(token_array(a), b) == want


def test_common_prefix_of_arrays_at_block_edges():
    base = list(range(5000))
    for k in (1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 4095, 4096, 4999):
        other = base[:k] + [-1] + base[k + 1:]
        assert common_prefix(token_array(base), token_array(other)) == k
    assert common_prefix(token_array(base), token_array(base)) == 5000
    assert common_prefix(token_array(base), token_array(base[:3001])) == 3001
    assert common_prefix(token_array(), token_array(base)) == 0


def test_token_array_is_a_compact_int_array_and_copies():
    src = token_array([1, 2, 3])
    cp = token_array(src)
    cp.append(4)
    assert isinstance(src, array) and src.typecode == "i" and list(src) == [1, 2, 3] and list(cp) == [1, 2, 3, 4]
