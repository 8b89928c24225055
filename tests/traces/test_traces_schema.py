import pytest

from traces import Trace, TraceRequest


def make(times):
    return Trace([TraceRequest(i, t, 10 + i, 5) for i, t in enumerate(times)], "test", "mem")


def test_duration_is_first_to_last_arrival():
    assert make([2.0, 3.0, 7.5]).duration_s == 5.5


def test_mean_rps_counts_gaps_per_second():
    assert make([0.0, 1.0, 2.0, 4.0]).mean_rps == pytest.approx(3 / 4.0)


def test_single_request_has_zero_duration_and_rate():
    t = make([3.0])
    assert (t.duration_s, t.mean_rps) == (0.0, 0.0)


def test_scaled_time_scale_multiplies_arrivals():
    assert [r.arrival_s for r in make([0.0, 1.0, 3.0]).scaled(time_scale=2.0)] == [0.0, 2.0, 6.0]


def test_scaled_target_rps_hits_the_rate():
    assert make([0.0, 0.3, 0.35, 2.0, 9.0]).scaled(target_rps=12.5).mean_rps == pytest.approx(12.5)


def test_scaled_keeps_order_and_lengths():
    t = make([0.0, 0.5, 0.5, 4.0])
    s = t.scaled(target_rps=100.0)
    assert [r.index for r in s] == [0, 1, 2, 3]
    assert [(r.n_prompt, r.n_output) for r in s] == [(r.n_prompt, r.n_output) for r in t]
    assert [r.arrival_s for r in s] == sorted(r.arrival_s for r in s)


def test_scaled_needs_exactly_one_argument():
    with pytest.raises(ValueError):
        make([0.0, 1.0]).scaled()
    with pytest.raises(ValueError):
        make([0.0, 1.0]).scaled(time_scale=1.0, target_rps=1.0)


def test_scaled_to_a_rate_refuses_a_trace_without_duration():
    with pytest.raises(ValueError, match="no duration"):
        make([0.0, 0.0]).scaled(target_rps=1.0)


def test_head_keeps_the_first_requests():
    t = make([0.0, 1.0, 2.0]).head(2)
    assert [r.index for r in t] == [0, 1] and t.format == "test"


def test_requests_are_immutable():
    r = TraceRequest(0, 0.0, 1, 1)
    with pytest.raises(AttributeError):
        r.n_prompt = 5  # type: ignore[misc]
