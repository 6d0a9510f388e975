"""Sampling parameters and the host sampler (`dcp_jax/sampling.py`)."""

import numpy as np
import pytest

from dcp_jax.sampling import SamplingParams, log_softmax, sample, top_logprobs


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(seed=-1), "seed"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"),
])
def test_bad_params_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_is_normalized():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop_token_ids=[3]).stop_token_ids == (3,)


LOGITS = np.array([0.5, 2.0, 1.9, -1.0, 2.0 - 1e-3])


def test_greedy_and_degenerate_filters_pick_the_argmax():
    rng = np.random.default_rng(0)
    assert sample(LOGITS, SamplingParams(temperature=0), rng) == 1
    assert sample(LOGITS, SamplingParams(temperature=1.0, top_k=1), rng) == 1
    assert sample(LOGITS, SamplingParams(temperature=1.0, top_p=1e-6), rng) == 1


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    params = SamplingParams(temperature=0.7)
    draws = [sample(LOGITS, params, np.random.default_rng(7)) for _ in range(3)]
    assert len(set(draws)) == 1
    rng = np.random.default_rng(1)
    counts = np.bincount([sample(LOGITS, params, rng) for _ in range(4000)], minlength=len(LOGITS))
    expected = np.exp(log_softmax(LOGITS / 0.7)) * 4000
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected) + 5)


def test_top_k_and_top_p_restrict_the_support():
    rng = np.random.default_rng(2)
    top2 = {sample(LOGITS, SamplingParams(top_k=2), rng) for _ in range(300)}
    assert top2 == {1, 4}  # the two largest logits (index order breaks the 2.0 tie)
    # p = [.07, .315, .285, .016, .314]: tokens 1 and 4 reach 0.5, token 2 is left out.
    support = {sample(LOGITS, SamplingParams(top_p=0.5), rng) for _ in range(300)}
    assert support == {1, 4}


def test_logprobs_hold_the_sampled_token_and_the_best():
    lp = log_softmax(LOGITS)
    np.testing.assert_allclose(np.exp(lp).sum(), 1.0)
    out = top_logprobs(lp, token=3, n=2)
    assert set(out) == {3, 1, 4}
    assert out[3] == pytest.approx(lp[3])
    assert top_logprobs(lp, token=0, n=0) == {0: pytest.approx(lp[0])}
