"""Sampler: llama-server defaults, sampler chain semantics, probabilities and request parsing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.model.sampling import (
    DEFAULT_SAMPLERS, LLAMA_DEFAULT_SEED, Sampler, SamplingParams, make_rng,
)
from tests import numerics_bounds as nb


def row(*logits: float) -> np.ndarray:
    return np.array(logits, dtype=np.float32)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, seed=1, **kw)


def post_probs(params: SamplingParams, logits: np.ndarray, prev=()) -> dict[int, float]:
    params = SamplingParams(**{**params_dict(params), "n_probs": len(logits), "post_sampling_probs": True})
    result = Sampler(params, len(logits)).sample(logits, prev)
    return {t: math.exp(lp) for t, lp in result.probs}


def params_dict(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


def test_defaults_match_llama_server():
    p = SamplingParams()
    assert (p.seed, p.temperature, p.top_k, p.top_p, p.min_p) == (0xFFFFFFFF, 0.8, 40, 0.95, 0.05)
    assert (p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty) == (1.0, 64, 0.0, 0.0)
    assert (p.typical_p, p.n_probs, p.min_keep) == (1.0, 0, 0)
    assert DEFAULT_SAMPLERS == ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                                "temperature")


def test_mt19937_generator_matches_std_mt19937():
    # std::mt19937 seeded with 5489 (its default) starts 3499211612, and its 10000th output is 4123659995
    draws = make_rng(5489).bit_generator.random_raw(10000)
    assert draws[0] == 3499211612 and draws[-1] == 4123659995


def test_seeded_sampling_reproduces_llama_cpp_draws():
    # tokens chosen by llama.cpp's own chains (llama-cpp-python 0.3.36, seed 42) on the same rows
    rows = np.random.default_rng(0).normal(0, 3, (20, 1000)).astype(np.float32)
    defaults = Sampler(SamplingParams(seed=42), 1000)
    assert [defaults.sample(r).token for r in rows] == [
        662, 51, 385, 375, 796, 427, 800, 899, 247, 338, 477, 485, 786, 660, 396, 770, 219, 77, 418, 110]
    top_p = Sampler(SamplingParams(seed=42, top_k=0, top_p=0.9, min_p=0.0, temperature=1.0), 1000)
    assert [top_p.sample(r).token for r in rows] == [
        430, 94, 32, 252, 751, 427, 248, 164, 353, 87, 477, 759, 265, 660, 132, 460, 428, 77, 418, 843]


def test_single_candidate_still_consumes_a_random_draw():
    # llama.cpp's dist draws even when one candidate is left, so seeded streams stay aligned with it
    sampler = Sampler(SamplingParams(seed=9, top_k=1), 3)
    sampler.sample(row(1.0, 2.0, 3.0))
    reference = make_rng(9)
    reference.bit_generator.random_raw(2)
    assert sampler.rng.bit_generator.random_raw() == reference.bit_generator.random_raw()


def test_temperature_zero_picks_argmax():
    logits = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    assert Sampler(greedy(), 1000).sample(logits).token == int(np.argmax(logits))


def test_greedy_still_reports_pre_sampling_probs():
    result = Sampler(greedy(n_probs=2), 3).sample(row(1.0, 3.0, 2.0))
    expected = np.exp([1.0, 3.0, 2.0]) / np.exp([1.0, 3.0, 2.0]).sum()
    assert result.token == 1
    assert [t for t, _ in result.probs] == [1, 2]
    rel = nb.softmax_rel([1.0, 3.0, 2.0])                               # float32 softmax of exact logits
    assert math.exp(result.logprob) == pytest.approx(expected[1], rel=rel)
    assert math.exp(result.probs[1][1]) == pytest.approx(expected[2], rel=rel)


def test_greedy_post_sampling_probs_keep_only_the_chosen_token():
    assert post_probs(greedy(), row(1.0, 3.0, 2.0)) == {1: 1.0}


def test_same_seed_gives_same_tokens():
    logits = np.random.default_rng(1).normal(size=500).astype(np.float32)
    a = Sampler(SamplingParams(seed=7, top_k=0, min_p=0.0), 500)
    b = Sampler(SamplingParams(seed=7, top_k=0, min_p=0.0), 500)
    assert [a.sample(logits).token for _ in range(20)] == [b.sample(logits).token for _ in range(20)]


def test_sampling_frequencies_follow_the_softmax():
    logits = row(0.0, math.log(2.0), math.log(7.0))  # probabilities 0.1, 0.2, 0.7
    sampler = Sampler(SamplingParams(seed=3, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), 3)
    counts = np.bincount([sampler.sample(logits).token for _ in range(4000)], minlength=3) / 4000
    # 0.03 is over 4 standard deviations of a frequency out of 4000 draws (sqrt(0.7 * 0.3 / 4000) = 0.0072);
    # the seeded stream (PCG64, float32 compares) is the same on every machine
    assert counts == pytest.approx([0.1, 0.2, 0.7], abs=0.03)


def test_top_k_keeps_k_best_tokens():
    probs = post_probs(SamplingParams(top_k=2, top_p=1.0, min_p=0.0, temperature=1.0, seed=1),
                       row(0.0, 3.0, 1.0, 2.0))
    assert set(probs) == {1, 3}
    assert sum(probs.values()) == pytest.approx(1.0, rel=2 * nb.softmax_rel([0.0, 3.0, 1.0, 2.0], renormalized=True))


def test_top_p_keeps_smallest_prefix_reaching_p():
    logits = row(*np.log([0.5, 0.3, 0.15, 0.05]))
    probs = post_probs(SamplingParams(top_k=0, top_p=0.8, min_p=0.0, temperature=1.0, seed=1), logits)
    assert set(probs) == {0, 1}
    assert probs[0] == pytest.approx(0.5 / 0.8, rel=nb.softmax_rel(np.log([0.5, 0.3, 0.15, 0.05]), renormalized=True))


def test_min_p_drops_tokens_below_fraction_of_the_best():
    logits = row(*np.log([0.6, 0.3, 0.05, 0.05]))
    probs = post_probs(SamplingParams(top_k=0, top_p=1.0, min_p=0.1, temperature=1.0, seed=1), logits)
    assert set(probs) == {0, 1}  # 0.05 < 0.1 * 0.6
    probs = post_probs(SamplingParams(top_k=0, top_p=1.0, min_p=0.6, temperature=1.0, seed=1), logits)
    assert set(probs) == {0}


def test_filters_see_untempered_probabilities():
    logits = row(*np.log([0.5, 0.3, 0.15, 0.05]))
    hot = post_probs(SamplingParams(top_k=0, top_p=0.8, min_p=0.0, temperature=10.0, seed=1), logits)
    assert set(hot) == {0, 1}  # top-p ran before temperature flattened the distribution
    rel = nb.softmax_rel(np.log([0.5, 0.3, 0.15, 0.05]) / 10, roundings=2, renormalized=True)   # float32 logit, / T
    assert hot[0] == pytest.approx(0.5 ** 0.1 / (0.5 ** 0.1 + 0.3 ** 0.1), rel=rel)


def test_typical_p_keeps_tokens_closest_to_the_entropy():
    logits = row(*np.log([0.6, 0.2, 0.15, 0.05]))
    probs = post_probs(SamplingParams(top_k=0, top_p=1.0, min_p=0.0, typical_p=0.15, temperature=1.0, seed=1),
                       logits)
    assert set(probs) == {1}  # entropy 1.06 nats; token 1's surprise (1.61) is the closest, not token 0's (0.51)


def test_top_n_sigma_masks_tokens_far_below_the_max():
    probs = post_probs(SamplingParams(top_k=0, top_p=1.0, min_p=0.0, top_n_sigma=1.0, temperature=1.0, seed=1),
                       row(10.0, 9.5, 0.0, 0.0, 0.0, 0.0))
    assert set(probs) == {0, 1}


def test_xtc_removes_all_but_the_least_likely_top_choice():
    logits = row(*np.log([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(top_k=0, top_p=1.0, min_p=0.0, xtc_probability=1.0, xtc_threshold=0.1,
                            temperature=1.0, seed=1)
    assert set(post_probs(params, logits)) == {2, 3}


def test_logit_bias_false_bans_a_token():
    params = SamplingParams.from_request({"temperature": 0, "logit_bias": [[1, False]]})
    assert Sampler(params, 3).sample(row(0.0, 5.0, 1.0)).token == 2


def test_positive_logit_bias_can_make_a_token_win():
    params = SamplingParams.from_request({"temperature": 0, "logit_bias": {"0": 10}})
    assert Sampler(params, 3).sample(row(0.0, 5.0, 1.0)).token == 0


def test_pre_sampling_probs_ignore_logit_bias():
    params = SamplingParams.from_request({"temperature": 0, "n_probs": 1, "logit_bias": {"0": 10}})
    result = Sampler(params, 3).sample(row(0.0, 5.0, 1.0))
    assert result.token == 0 and result.probs[0][0] == 1  # reported distribution is the raw softmax


def test_ignore_eos_bans_every_eog_token():
    params = SamplingParams.from_request({"temperature": 0, "ignore_eos": True}, eog_ids={0, 2})
    assert Sampler(params, 4).sample(row(9.0, 1.0, 8.0, 0.0)).token == 1


def test_ignore_eos_in_params_bans_the_samplers_eog_ids():
    assert Sampler(greedy(ignore_eos=True), 4, eog_ids=frozenset({0, 2})).sample(row(9.0, 1.0, 8.0, 0.0)).token == 1


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    p = greedy(repeat_penalty=1.1)
    assert Sampler(p, 2).sample(row(2.0, 1.9), prev_tokens=[0]).token == 1  # 2.0 / 1.1 < 1.9
    assert Sampler(p, 2).sample(row(-1.0, -1.05), prev_tokens=[0]).token == 1  # -1.0 * 1.1 < -1.05


def test_presence_and_frequency_penalties_subtract_from_repeated_tokens():
    p = greedy(presence_penalty=0.5, frequency_penalty=0.3)
    assert Sampler(p, 2).sample(row(2.0, 1.0), prev_tokens=[0, 0]).token == 1  # 2 - 0.5 - 0.6 = 0.9
    assert Sampler(p, 2).sample(row(2.0, 1.0), prev_tokens=[0]).token == 0  # 2 - 0.5 - 0.3 = 1.2


def test_penalty_window_is_the_last_repeat_last_n_tokens():
    p = greedy(repeat_penalty=2.0, repeat_last_n=2)
    assert Sampler(p, 3).sample(row(2.0, 1.5, 0.0), prev_tokens=[0, 2, 2]).token == 0


def test_mirostat_samples_from_a_truncated_distribution():
    sampler = Sampler(SamplingParams(mirostat=2, mirostat_tau=1.0, seed=5), 50)
    logits = np.linspace(5.0, -5.0, 50, dtype=np.float32)
    tokens = {sampler.sample(logits).token for _ in range(50)}
    assert tokens <= set(range(10)) and math.isfinite(sampler.mirostat_mu)


def test_from_request_clamps_soft_limits():
    p = SamplingParams.from_request({"top_k": -3, "top_p": 1.7, "min_p": -0.2, "temperature": -1.0, "mirostat": 5})
    assert (p.top_k, p.top_p, p.min_p, p.temperature, p.mirostat) == (0, 1.0, 0.0, 0.0, 2)


def test_from_request_rejects_out_of_range_hard_limits():
    with pytest.raises(ValueError, match="Field 'repeat_last_n': Value must be between 0"):
        SamplingParams.from_request({"repeat_last_n": -2})
    with pytest.raises(ValueError, match="Field 'top_k': type must be number"):
        SamplingParams.from_request({"top_k": "many"})


def test_from_request_null_means_default():
    defaults = SamplingParams(top_k=7)
    assert SamplingParams.from_request({"top_k": None, "temperature": None}, defaults) == defaults


def test_from_request_seed_minus_one_is_the_random_seed():
    assert SamplingParams.from_request({"seed": -1}).seed == LLAMA_DEFAULT_SEED
    assert SamplingParams.from_request({"seed": 42}).seed == 42


def test_from_request_n_probs_falls_back_to_logprobs_alias():
    assert SamplingParams.from_request({"logprobs": 3}).n_probs == 3
    assert SamplingParams.from_request({"n_probs": 2, "logprobs": 3}).n_probs == 2


def test_from_request_logit_bias_string_keys_are_tokenized():
    p = SamplingParams.from_request({"logit_bias": [["hi", -2.0], [99, 1.0]], }, n_vocab=50,
                                    tokenize=lambda s: [5, 6])
    assert p.logit_bias == ((5, -2.0), (6, -2.0))  # id 99 is outside the vocabulary and dropped


def test_from_request_parses_sampler_chars_and_names():
    assert SamplingParams.from_request({"samplers": "kt"}).samplers == ("top_k", "temperature")
    assert SamplingParams.from_request({"samplers": ["top-p", "temp", "bogus"]}).samplers == ("top_p", "temperature")


def test_dry_sampling_is_rejected_instead_of_ignored():
    with pytest.raises(ValueError, match="DRY"):
        SamplingParams.from_request({"dry_multiplier": 0.8})


def test_logits_row_of_wrong_length_is_rejected():
    with pytest.raises(ValueError, match="n_vocab"):
        Sampler(greedy(), 4).sample(row(1.0, 2.0))
