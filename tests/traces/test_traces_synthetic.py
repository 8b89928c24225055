import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traces import (BurstArrivals, ConstantLength, EmpiricalLength, GammaArrivals, PoissonArrivals,
                    TraceFormatError, UniformLength, ZipfLength, open_loop, read_trace, retime)


def rng(seed=0):
    return np.random.default_rng(seed)


def test_arrivals_start_at_zero_and_never_decrease():
    t = GammaArrivals(3.0, cv=4.0).times(500, rng())
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)


@settings(max_examples=20, deadline=None)
@given(rate=st.floats(0.05, 200.0), seed=st.integers(0, 2**32))
def test_poisson_arrivals_have_the_requested_rate(rate, seed):
    n = 20_000
    t = PoissonArrivals(rate).times(n, rng(seed))
    assert (n - 1) / t[-1] == pytest.approx(rate, rel=5 / math.sqrt(n))


@settings(max_examples=20, deadline=None)
@given(rate=st.floats(0.1, 50.0), cv=st.floats(0.25, 3.0), seed=st.integers(0, 2**32))
def test_gamma_arrivals_have_the_requested_rate_and_cv(rate, cv, seed):
    gaps = np.diff(GammaArrivals(rate, cv).times(40_000, rng(seed)))
    assert gaps.mean() == pytest.approx(1 / rate, rel=6 * cv / 200)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)


def test_burst_arrivals_are_all_at_zero():
    assert BurstArrivals().times(3, rng()).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("dist", [ConstantLength(7), UniformLength(10, 30), ZipfLength(1, 4000, 1.1),
                                  EmpiricalLength((5, 10, 100))])
def test_length_samples_have_the_distribution_mean(dist):
    s = dist.sample(100_000, rng(1))
    assert s.dtype == np.int64 and s.mean() == pytest.approx(dist.mean, rel=0.03)


@settings(max_examples=30, deadline=None)
@given(lo=st.integers(1, 50), span=st.integers(0, 500), a=st.floats(0.3, 3.0))
def test_zipf_stays_within_bounds(lo, span, a):
    s = ZipfLength(lo, lo + span, a).sample(2000, rng(lo))
    assert s.min() >= lo and s.max() <= lo + span


def test_uniform_bounds_are_inclusive():
    assert set(UniformLength(3, 5).sample(1000, rng()).tolist()) == {3, 4, 5}


def test_empirical_lengths_from_a_csv_column(write):
    d = EmpiricalLength.from_csv(write("l.csv", "a,b\n1,10\n2,20\n"), column="b")
    assert d.values == (10, 20) and d.mean == 15


def test_empirical_lengths_bad_value_names_file_line_and_field(write):
    with pytest.raises(TraceFormatError, match=r"l.csv:3: field 'a'"):
        EmpiricalLength.from_csv(write("l.csv", "a\n1\nzz\n"))


def test_empirical_lengths_from_the_sharegpt_stats_file(shared_trace):
    d = EmpiricalLength.from_csv(shared_trace("sharegpt_8k_filtered_stats_llama2_tokenizer.csv"),
                                 column="num_prefill_tokens")
    assert len(d.values) == 30731


def test_open_loop_is_deterministic_per_seed():
    args = (200, GammaArrivals(2.0, 2.0), ZipfLength(16, 2048), (10, 300))
    assert open_loop(*args, seed=3).requests == open_loop(*args, seed=3).requests
    assert open_loop(*args, seed=3).requests != open_loop(*args, seed=4).requests


def test_open_loop_has_the_requested_means():
    t = open_loop(20_000, PoissonArrivals(4.0), UniformLength(100, 300), 50, seed=0)
    assert t.mean_rps == pytest.approx(4.0, rel=0.05)
    assert t.n_prompt_total / len(t) == pytest.approx(200, rel=0.02)
    assert {r.n_output for r in t} == {50}


def test_open_loop_streams_are_independent():
    a = open_loop(100, PoissonArrivals(1.0), 10, 10, seed=1)
    b = open_loop(100, PoissonArrivals(1.0), UniformLength(1, 99), 10, seed=1)
    assert [r.arrival_s for r in a] == [r.arrival_s for r in b]


def test_open_loop_fields_are_plain_python_numbers():
    r = open_loop(2, PoissonArrivals(1.0), 10, (1, 5), seed=0)[1]
    assert type(r.arrival_s) is float and type(r.n_prompt) is int and type(r.n_output) is int


def test_retime_gives_a_length_only_trace_arrivals(write):
    t = read_trace(write("s.csv", "num_prefill_tokens,num_decode_tokens\n5,6\n7,8\n9,10\n"))
    r = retime(t, PoissonArrivals(2.0), seed=0)
    assert [x.n_prompt for x in r] == [5, 7, 9] and r.duration_s > 0
