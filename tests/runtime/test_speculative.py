"""dcp_jax/runtime/speculative.py: greedy verification keeps drafts exactly while they are the argmax (so the output
is greedy decoding's), and rejection sampling emits tokens distributed as the target's draws (chi-square over many
seeds on a small vocabulary), a draft that is always wrong included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dcp_jax.runtime.speculative import accept_drafts


def verify(logits, drafts, *, greedy, seeds):
    r = len(seeds)
    logits = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (r, *np.shape(logits)))
    drafts = jnp.broadcast_to(jnp.asarray(drafts, jnp.int32), (r, len(drafts)))
    seeds = jnp.stack([jnp.asarray(seeds, jnp.uint32), jnp.zeros(r, jnp.uint32)], axis=1)
    positions = jnp.broadcast_to(jnp.arange(10, 10 + logits.shape[1], dtype=jnp.int32), logits.shape[:2])
    accepted, tokens = jax.jit(accept_drafts)(logits, drafts, is_greedy=jnp.full(r, greedy), seeds=seeds,
                                              positions=positions)
    return np.asarray(accepted), np.asarray(tokens)


def test_greedy_keeps_the_drafts_while_they_are_the_argmax_then_emits_the_argmax():
    logits = np.log(np.array([[0.1, 0.6, 0.2, 0.1], [0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7],
                              [0.2, 0.2, 0.5, 0.1]]))
    for drafts, accepted, tokens in (([1, 0, 3], 3, [1, 0, 3, 2]), ([1, 0, 1], 2, [1, 0, 3, -1]),
                                     ([2, 0, 3], 0, [1, -1, -1, -1]), ([1, 2, 3], 1, [1, 0, -1, -1])):
        got_accepted, got_tokens = verify(logits, drafts, greedy=True, seeds=[0])
        assert got_accepted.tolist() == [accepted] and got_tokens.tolist() == [tokens], drafts


def assert_distributed_as(samples, probs, vocab):
    counts = np.bincount(samples, minlength=vocab)
    expected = np.asarray(probs) * len(samples)
    kept = expected > 0
    assert counts[~kept].sum() == 0, counts
    assert stats.chisquare(counts[kept], expected[kept]).pvalue > 1e-3, (counts, expected)


def test_rejection_sampling_emits_the_targets_distribution():
    p = np.array([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    logits = np.log(np.where(p > 0, p, 1e-30)).astype(np.float32)
    logits[p == 0] = -np.inf
    seeds = np.arange(20000)
    accepted, tokens = verify(logits, [0, 3], greedy=False, seeds=seeds)
    assert_distributed_as(tokens[:, 0], p[0], 4)  # the first token emitted: the target's first draw
    assert abs((accepted >= 1).mean() - p[0, 0]) < 0.02  # draft 0 kept with probability p0(0)
    second = tokens[accepted >= 1, 1]  # after a kept first draft: the target's second draw
    assert_distributed_as(second, p[1], 4)
    bonus = tokens[accepted == 2, 2]
    assert_distributed_as(bonus, p[2], 4)
    # The same seeds decide the same way (counter-based draws).
    again = verify(logits, [0, 3], greedy=False, seeds=seeds[:50])
    assert (again[1] == tokens[:50]).all()


def test_a_draft_that_is_always_wrong_is_never_kept_and_the_output_is_still_the_targets():
    p = np.array([[0.6, 0.4, 0.0], [0.2, 0.3, 0.5]])
    logits = np.where(p > 0, np.log(np.where(p > 0, p, 1.0)), -np.inf).astype(np.float32)
    accepted, tokens = verify(logits, [2], greedy=False, seeds=np.arange(8000))
    assert (accepted == 0).all() and (tokens[:, 1] == -1).all()
    assert_distributed_as(tokens[:, 0], p[0], 3)


def test_rows_mixing_greedy_and_sampled_requests_and_bad_shapes():
    logits = np.log(np.array([[[0.1, 0.9], [0.9, 0.1]], [[0.5, 0.5], [0.5, 0.5]]], np.float32))
    seeds = jnp.zeros((2, 2), jnp.uint32)
    positions = jnp.array([[3, 4], [3, 4]], jnp.int32)
    accepted, tokens = accept_drafts(jnp.asarray(logits), jnp.array([[1], [1]], jnp.int32),
                                     is_greedy=jnp.array([True, False]), seeds=seeds, positions=positions)
    assert accepted[0] == 1 and tokens[0].tolist() == [1, 0]  # greedy: the draft is the argmax, then the argmax
    assert tokens[1, 0] in (0, 1) and (tokens[1, 1] == -1) == (accepted[1] == 0)
    with pytest.raises(ValueError, match="expected"):
        accept_drafts(jnp.asarray(logits), jnp.array([1, 1], jnp.int32), is_greedy=jnp.array([True, False]),
                      seeds=seeds, positions=positions)


def test_a_request_with_fewer_drafts_emits_a_plain_draw_after_them():
    """-1 drafts (a request near its max_tokens, or a prefill's sampled row): never kept; the row after the last
    real draft emits the target's own draw (the argmax when greedy), nothing excluded."""
    logits = np.log(np.array([[0.1, 0.6, 0.2, 0.1], [0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]]))
    for drafts, accepted, tokens in (([-1, -1], 0, [1, -1, -1]), ([1, -1], 1, [1, 0, -1]),
                                     ([2, -1], 0, [1, -1, -1])):
        got_accepted, got_tokens = verify(logits, drafts, greedy=True, seeds=[0])
        assert got_accepted.tolist() == [accepted] and got_tokens.tolist() == [tokens], drafts
    p = np.array([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]])
    logits = np.log(np.where(p > 0, p, 1e-30)).astype(np.float32)
    accepted, tokens = verify(logits, [-1], greedy=False, seeds=np.arange(20000))
    assert (accepted == 0).all()
    assert_distributed_as(tokens[:, 0], p[0], 4)
