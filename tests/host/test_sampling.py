"""Sampling parameters and the host sampler (`dcp_jax/sampling.py`)."""

import numpy as np
import pytest

from dcp_jax.host.sampling import SamplingParams, kept_tokens, log_softmax, most_likely, sample, top_logprobs


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


@pytest.mark.parametrize("tied", [[3, 7], [0, 9], [2, 5, 6]])
def test_greedy_breaks_exact_ties_by_the_lowest_id(tied):
    """vLLM's rule (and HF's argmax): among equal largest logits the lowest token id wins, wherever they sit."""
    logits = np.linspace(-1.0, 0.0, 10)
    logits[tied] = 3.25
    rng = np.random.default_rng(0)
    assert sample(logits, SamplingParams(temperature=0), rng) == min(tied)
    assert sample(logits[::-1].copy(), SamplingParams(temperature=0), rng) == 9 - max(tied)


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


def test_most_likely_is_a_stable_descending_sort_cut_at_n():
    rng = np.random.default_rng(3)
    for scores in (rng.standard_normal(5000), np.round(rng.standard_normal(5000), 1)):  # the second: many ties
        for n in (0, 1, 7, 300, 1249, 1251, 4999, 5000, 6000):
            want = np.argsort(-scores, kind="stable")[:max(n, 0)]
            np.testing.assert_array_equal(most_likely(scores, n), want)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.3), (0, 0.999), (50, 1.0), (50, 0.2), (3000, 0.95), (-1, 0.9)])
def test_the_kept_tokens_are_the_stable_sorted_prefix(top_k, top_p):
    """What the sampler keeps equals the full-sort definition: sort by probability (stable), cut at top_k, keep
    the tokens whose more likely mass is below top_p; also with a nucleus larger than the first sorted prefix."""
    rng = np.random.default_rng(4)
    logits = np.round(rng.standard_normal(20000) * 2, 2)  # ties too
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    kept = probs[order]
    if top_p < 1:
        order = order[np.cumsum(kept) - kept < top_p]
    np.testing.assert_array_equal(kept_tokens(probs, top_k, top_p), order)
