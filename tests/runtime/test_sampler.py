"""dcp_jax/runtime/sampler.py: the draws follow the distribution vLLM's semantics define (chi-square over many draws
on a small vocabulary, against a numpy sort-based oracle, and the same draws rejected by a deliberately wrong
one), greedy takes the lowest id among ties, a row's draw depends only on its seed and position, and the logprobs
are the raw logits' log-softmax."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcp_jax.runtime import sampler

scipy_stats = pytest.importorskip("scipy.stats")

VOCAB = 12
DRAWS = 20_000
LOGITS = np.array([2.0, 1.6, 1.5, 0.9, 0.8, 0.3, 0.0, -0.2, -0.9, -1.5, -2.5, -4.0], np.float32)


def _params(rows, **overrides):
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                repetition_penalty=1.0)
    base.update(overrides)
    out = {name: jnp.full((rows,), value, jnp.int32 if name == "top_k" else jnp.float32)
           for name, value in base.items()}
    out.update(stop_ids=jnp.full((rows, 2), -1, jnp.int32), stops_from=jnp.zeros((rows,), jnp.int32))  # none held
    return out


@functools.partial(jax.jit, static_argnames=("rows", "draws"))
def _draw(logits, counts, prompt_mask, params, *, rows, seed=7, draws=True):
    seeds = jnp.stack([jnp.full((rows,), seed, jnp.uint32), jnp.zeros((rows,), jnp.uint32)], axis=1)
    return sampler.sample(jnp.broadcast_to(logits, (rows, VOCAB)), **params, seeds=seeds,
                          positions=jnp.arange(rows, dtype=jnp.int32),
                          output_counts=jnp.broadcast_to(counts, (rows, VOCAB)),
                          prompt_mask=jnp.broadcast_to(prompt_mask, (rows, VOCAB)), draws=draws,
                          backend="reference").tokens


def expected(logits, counts=None, prompt_mask=None, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
             presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0):
    """vLLM's sampling distribution over one row, written the obvious way in float64 with a sort."""
    x = np.asarray(logits, np.float64).copy()
    counts = np.zeros(VOCAB, np.int64) if counts is None else np.asarray(counts)
    prompt_mask = np.zeros(VOCAB, bool) if prompt_mask is None else np.asarray(prompt_mask)
    seen = prompt_mask | (counts > 0)
    x[seen] = np.where(x[seen] > 0, x[seen] / repetition_penalty, x[seen] * repetition_penalty)
    x -= frequency_penalty * counts + presence_penalty * (counts > 0)
    x /= temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if 0 < top_k < VOCAB:
        kth = np.sort(np.where(keep, x, -np.inf))[::-1][top_k - 1]
        keep &= x >= kth
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    mass_before = np.cumsum(p[order]) - p[order]
    kept = np.zeros(VOCAB, bool)
    kept[order[mass_before < top_p - 1e-12]] = True
    p = np.where(kept, p, 0.0)
    return p / p.sum()


def chi_square_p_value(tokens, probs):
    """p-value of the draws under `probs` (cells of probability 0 must stay empty: else 0)."""
    observed = np.bincount(np.asarray(tokens), minlength=VOCAB)
    if np.any(observed[probs == 0] > 0):
        return 0.0
    support = probs > 0
    if support.sum() == 1:
        return 1.0
    return float(scipy_stats.chisquare(observed[support], DRAWS * probs[support]).pvalue)


CASES = {
    "temperature": (dict(temperature=0.7), dict(temperature=1.0)),
    "top_k": (dict(top_k=4), dict(top_k=5)),
    "top_p": (dict(top_p=0.7), dict(top_p=0.8)),
    "min_p": (dict(min_p=0.3), dict(min_p=0.1)),
    "presence_frequency": (dict(presence_penalty=0.6, frequency_penalty=0.4), dict(presence_penalty=0.6)),
    "repetition": (dict(repetition_penalty=1.8), dict(repetition_penalty=1.0)),
    "all_filters": (dict(temperature=0.8, top_k=6, top_p=0.85, min_p=0.05),
                    dict(temperature=0.8, top_k=6, top_p=0.95, min_p=0.05)),
}
COUNTS = np.array([3, 0, 1, 0, 0, 2, 0, 0, 0, 0, 0, 0], np.int32)  # generated so far: tokens 0, 2, 5
PROMPT = np.zeros(VOCAB, bool)
PROMPT[[1, 8]] = True  # negative-logit token 8: the repetition penalty pushes it further down


@pytest.mark.parametrize("name", list(CASES))
def test_draws_follow_the_distribution_and_reject_a_wrong_one(name):
    right, wrong = CASES[name]
    tokens = _draw(jnp.asarray(LOGITS), jnp.asarray(COUNTS), jnp.asarray(PROMPT), _params(DRAWS, **right), rows=DRAWS)
    assert chi_square_p_value(tokens, expected(LOGITS, COUNTS, PROMPT, **right)) > 1e-4
    # The same draws, against a plausible mistake (a filter off by one step, a penalty left out): rejected.
    assert chi_square_p_value(tokens, expected(LOGITS, COUNTS, PROMPT, **wrong)) < 1e-6


@pytest.mark.parametrize("draws", [False, True])  # the all-greedy program, and greedy rows of a drawing one
def test_greedy_is_the_argmax_of_the_penalized_logits_lowest_id_first(draws):
    logits = np.array([0.5, 3.0, -1.0, 3.0, 3.0, 0.0, 1.0, 2.0, 2.9, 0.1, 0.2, 0.3], np.float32)
    tokens = _draw(jnp.asarray(logits), jnp.zeros(VOCAB, jnp.int32), jnp.zeros(VOCAB, bool),
                   _params(4, temperature=0.0), rows=4, draws=draws)
    np.testing.assert_array_equal(tokens, [1, 1, 1, 1])  # tokens 1, 3, 4 tie: the lowest id wins
    counts = np.zeros(VOCAB, np.int32)
    counts[[1, 3]] = 1
    tokens = _draw(jnp.asarray(logits), jnp.asarray(counts), jnp.zeros(VOCAB, bool),
                   _params(2, temperature=0.0, presence_penalty=0.5), rows=2, draws=draws)
    np.testing.assert_array_equal(tokens, [4, 4])  # 1 and 3 penalized: 4 (3.0) beats 8 (2.9)


def test_a_rows_draw_depends_only_on_its_seed_and_position():
    """The same (seed, position) gives the same token in any row of any batch, beside any neighbours; another
    position or seed draws anew."""
    rows = 64
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((rows, VOCAB)), jnp.float32)
    seeds = jnp.asarray(rng.integers(0, 2**32, (rows, 2)), jnp.uint32)
    positions = jnp.asarray(rng.integers(0, 10_000, rows), jnp.int32)
    params = _params(rows, temperature=1.0, top_p=0.95)
    zeros, no_prompt = jnp.zeros((rows, VOCAB), jnp.int32), jnp.zeros((rows, VOCAB), bool)
    run = jax.jit(lambda lg, s, pos, prm, c, m: sampler.sample(lg, **prm, seeds=s, positions=pos, output_counts=c,
                                                               prompt_mask=m, draws=True, backend="reference").tokens)
    want = np.asarray(run(logits, seeds, positions, params, zeros, no_prompt))
    perm = rng.permutation(rows)
    shuffled = np.asarray(run(logits[perm], seeds[perm], positions[perm], jax.tree.map(lambda a: a[perm], params),
                              zeros, no_prompt))
    np.testing.assert_array_equal(shuffled, want[perm])
    half = {k: v[:8] for k, v in params.items()}
    np.testing.assert_array_equal(run(logits[:8], seeds[:8], positions[:8], half, zeros[:8], no_prompt[:8]),
                                  want[:8])
    moved = np.asarray(run(logits, seeds, positions + 1, params, zeros, no_prompt))
    assert np.mean(moved != want) > 0.5


def test_logprobs_are_the_raw_log_softmax():
    rows = 3
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((rows, VOCAB)).astype(np.float32)
    seeds = jnp.zeros((rows, 2), jnp.uint32)
    out = sampler.sample(jnp.asarray(logits), **_params(rows, temperature=0.5, presence_penalty=1.0), seeds=seeds,
                         positions=jnp.arange(rows, dtype=jnp.int32), output_counts=jnp.ones((rows, VOCAB), jnp.int32),
                         prompt_mask=jnp.zeros((rows, VOCAB), bool), draws=True, backend="reference")
    want = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprobs, want[np.arange(rows), np.asarray(out.tokens)], rtol=1e-5, atol=1e-6)
    n = min(sampler.TOP_LOGPROBS, VOCAB)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-want, axis=-1, kind="stable")[:, :n])
    np.testing.assert_allclose(out.top_logprobs, -np.sort(-want, axis=-1)[:, :n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("vocab", [7, 300])
def test_top_logprobs_by_the_kernel_equal_a_full_sort(vocab):
    """The drawing program's top logprobs (the Pallas top-k, interpreted) equal a sort of the row: largest first,
    the lower id first among exact ties, -inf entries (held-back ids) last; a vocabulary under TOP_LOGPROBS gives
    every id. f32."""
    rng = np.random.default_rng(3)
    rows = 5
    logprobs = np.round(rng.standard_normal((rows, vocab)), 1).astype(np.float32)  # many exact ties
    logprobs[1, : vocab // 2] = -np.inf
    logprobs[2] = -1.0  # a row of ties only
    values, ids = jax.jit(functools.partial(sampler.top_logprobs, backend="pallas"))(jnp.asarray(logprobs))
    n = min(sampler.TOP_LOGPROBS, vocab)
    order = np.argsort(-logprobs, axis=-1, kind="stable")[:, :n]
    np.testing.assert_array_equal(np.asarray(ids), order)
    np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(logprobs, order, axis=-1))


def test_add_history_restarts_fresh_slots_then_adds_the_rows_tokens():
    """A fresh slot forgets its previous request (a stale prompt token and count), then takes its rows' prompt
    tokens into the mask and generated ones into the counts; fed-back and pad rows add nothing; a fresh-slot pad
    (past the last slot) resets nothing."""
    from dcp_jax.host.step_inputs import FED_BACK, GENERATED, PAD, PROMPT

    state = sampler.SamplerState.zeros(2, VOCAB)  # slots 0, 1 and the scratch slot 2
    state = dataclasses.replace(state, prompt_mask=state.prompt_mask.at[:, 9].set(True),
                                output_counts=state.output_counts.at[:, 8].set(3))
    tokens = jnp.array([4, 5, 5, 7, 6, 1], jnp.int32)
    roles = jnp.array([PROMPT, PROMPT, GENERATED, GENERATED, FED_BACK, PAD], jnp.int32)
    slots = jnp.array([0, 0, 0, 0, 1, 2], jnp.int32)
    new = sampler.add_history(state, tokens, roles, slots, jnp.array([0, 3], jnp.int32))
    mask, counts = np.asarray(new.prompt_mask), np.asarray(new.output_counts)
    assert np.flatnonzero(mask[0]).tolist() == [4, 5]
    assert counts[0].tolist() == np.bincount([5, 7], minlength=VOCAB).tolist()
    assert mask[1, 9] and counts[1, 8] == 3 and counts[1].sum() == 3  # not fresh: kept; its fed-back token adds nothing
    assert mask[2].tolist() == np.asarray(state.prompt_mask[2]).tolist()  # the pad row adds nothing


def test_min_tokens_holds_the_stop_tokens_back_until_their_position():
    """Greedy rows whose best token is a stop token: it is not sampled while the row samples a position before
    stops_from (the second best is), and is from there on; its logprob stays the raw one; -1 pads hold nothing."""
    rows = 4
    params = _params(rows, temperature=0.0)
    params["stop_ids"] = jnp.array([[0, -1], [0, 1], [0, -1], [-1, -1]], jnp.int32)  # token 0 is the argmax
    params["stops_from"] = jnp.array([5, 5, 5, 5], jnp.int32)
    positions = jnp.array([4, 4, 5, 4], jnp.int32)
    out = sampler.sample(jnp.broadcast_to(jnp.asarray(LOGITS), (rows, VOCAB)), **params,
                         seeds=jnp.zeros((rows, 2), jnp.uint32), positions=positions,
                         output_counts=jnp.zeros((rows, VOCAB), jnp.int32),
                         prompt_mask=jnp.zeros((rows, VOCAB), bool), draws=True, backend="reference")
    assert np.asarray(out.tokens).tolist() == [1, 2, 0, 0]  # held; both held; from stops_from on; nothing held
    raw = LOGITS - np.log(np.exp(LOGITS).sum())
    np.testing.assert_allclose(np.asarray(out.logprobs), raw[[1, 2, 0, 0]], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.top_ids)[:, 0], [0] * rows)  # the raw top token still reported
