"""dcp_jax/model/attention/exchange.py: candidate merge, owner filter and LSE merge."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from dcp_jax.host.layout import DcpLayout
from dcp_jax.model.attention import exchange
from dcp_jax.model.mesh import DCP
from pallas_kernels import reference


@pytest.mark.parametrize("dcp, interleave", [(1, 1), (2, 1), (3, 2), (4, 1), (8, 2)])
@pytest.mark.parametrize("has_ties", [False, True])
def test_local_topk_then_merge_is_the_global_topk(dcp, interleave, has_ties):
    rng = np.random.default_rng(dcp * 10 + interleave)
    k, rows, width = 8, 5, 64
    lengths = np.array([0, 3, 8, 29, 64])  # empty, < k, == k, not a multiple of dcp, full
    scores = rng.integers(0, 4, (rows, width)) if has_ties else rng.standard_normal((rows, width))
    scores = scores.astype(np.float32)
    _, expected = reference.topk(jnp.asarray(scores), jnp.asarray(lengths, jnp.int32), k=k)

    layout = DcpLayout(dcp, interleave, page_size=interleave)
    local_lens = layout.local_context_lens(lengths)
    values, ids = [], []
    for rank in range(dcp):
        local_width = -(-width // dcp) + interleave
        gpos = layout.global_index(np.arange(local_width), rank)
        local_scores = np.take(scores, np.minimum(gpos, width - 1), axis=1)
        v, li = reference.topk(jnp.asarray(local_scores), jnp.asarray(local_lens[rank]), k=k)
        values.append(v)
        ids.append(exchange.global_index(li, rank, layout=layout))
    _, merged = exchange.merge_candidates(jnp.stack(values), jnp.stack(ids), k=k)
    np.testing.assert_array_equal(merged, expected)


def test_merge_candidates_breaks_ties_by_global_id_and_pads():
    values = jnp.array([[[1.0, 1.0, -jnp.inf]], [[1.0, 2.0, -jnp.inf]]])
    ids = jnp.array([[[6, 2, -1]], [[1, 9, -1]]], jnp.int32)
    got_values, got_ids = exchange.merge_candidates(values, ids, k=6)
    np.testing.assert_array_equal(got_ids, [[9, 1, 2, 6, -1, -1]])
    np.testing.assert_array_equal(got_values, [[2.0, 1.0, 1.0, 1.0, -np.inf, -np.inf]])


@pytest.mark.parametrize("dcp, interleave, page_size", [(1, 1, 4), (2, 1, 4), (4, 2, 4), (8, 1, 2)])
def test_owner_filter_compacts_owned_slots_in_order(dcp, interleave, page_size):
    rng = np.random.default_rng(dcp)
    layout = DcpLayout(dcp, interleave, page_size)
    rows, k, max_blocks = 4, 12, 6
    tables = rng.permutation(rows * max_blocks).reshape(rows, max_blocks).astype(np.int32)
    span = max_blocks * page_size * dcp
    ids = np.stack([rng.permutation(span)[:k] for _ in range(rows)]).astype(np.int32)
    ids[1, 5:] = -1
    ids[2] = -1
    for rank in range(dcp):
        slots, counts = exchange.owner_filter(jnp.asarray(ids), jnp.asarray(tables), rank, layout=layout)
        for r in range(rows):
            mine = [p for p in ids[r] if p >= 0 and layout.owner(p) == rank]
            li = layout.local_index(np.array(mine, np.int64))
            want = tables[r, li // page_size] * page_size + li % page_size
            assert counts[r] == len(mine)
            np.testing.assert_array_equal(slots[r, : len(mine)], want)
            assert np.all(np.asarray(slots[r, len(mine):]) == -1)


@pytest.mark.parametrize("dcp, idle_rank", [(2, None), (2, 1), (4, None), (4, 3)],
                         ids=["dcp2-all-own", "dcp2-rank1-owns-none", "dcp4-all-own", "dcp4-rank3-owns-none"])
def test_merge_partial_attention_equals_attention_over_the_union(dcp, idle_rank):
    """Each rank attends over its own tokens for all W*h heads; the merge gives each rank its h heads of the
    attention over every token. Either every rank owns tokens (so each part needs its own rescale: one missing or
    wrong fails), or one rank owns none (its lse -inf must weigh 0)."""
    rng = np.random.default_rng(dcp)
    rows, heads, tokens, dim = 3, 2 * dcp, 24, 8
    # Scores of very different scale per rank: parts' lse differ by several units, so a sum without rescaling
    # is far from the union's softmax.
    scores = rng.standard_normal((rows, heads, tokens)) * 3
    values = rng.standard_normal((rows, tokens, dim))
    owner = np.arange(tokens) % dcp  # every rank owns tokens
    if idle_rank is not None:
        owner = np.where(owner == idle_rank, (idle_rank + 1) % dcp, owner)
    assert len(set(owner.tolist())) == (dcp if idle_rank is None else dcp - 1)
    outs, lses = [], []
    for w in range(dcp):
        mask = owner == w
        s = np.where(mask, scores, -np.inf)
        with np.errstate(divide="ignore"):
            lse = np.log(np.sum(np.exp(s), axis=-1))
        probs = np.exp(s - np.where(np.isfinite(lse), lse, 0)[..., None]) * mask
        outs.append(np.einsum("rht,rtd->rhd", probs, values))
        lses.append(lse)
    mesh = jax.make_mesh((dcp,), (DCP,), axis_types=(jax.sharding.AxisType.Auto,))
    merge = jax.shard_map(
        lambda o, l: exchange.merge_partial_attention(o[0], l[0]),
        mesh=mesh, in_specs=(P(DCP), P(DCP)), out_specs=P(None, DCP), check_vma=False,
    )
    out = merge(jnp.asarray(np.stack(outs), jnp.float32), jnp.asarray(np.stack(lses), jnp.float32))
    expected_lse = np.log(np.sum(np.exp(scores), axis=-1))
    expected = np.einsum("rht,rtd->rhd", np.exp(scores - expected_lse[..., None]), values)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
