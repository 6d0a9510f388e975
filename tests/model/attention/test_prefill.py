"""dcp_jax/model/attention/prefill.py: query chunks change nothing; a bf16 prefill selects with the f32 scores
decode's indexer computes, and attends in f32 inside."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dcp_jax.config import TINY, ParallelConfig
from dcp_jax.model.attention import projections
from dcp_jax.model.attention.prefill import sparse_prefill_attention
from dcp_jax.model.deepseek_v32 import abstract_model, init_params, merge
from dcp_jax.model.mesh import make_mesh
from dcp_jax.model.rope import cos_sin, rope_tables
from pallas_kernels import reference


def _prefill_attention(batch, tokens, seed, dtype=jnp.bfloat16, **prefill_options):
    """Layer 0's prefill attention of a random model on random inputs (one device, `dtype`), and the inputs."""
    graphdef, abstract = abstract_model(TINY, dtype)
    params = init_params(TINY, seed=seed, dtype=dtype)
    attention = merge(graphdef, abstract, params).layers[0].attention.params()
    x = jax.random.normal(jax.random.key(seed + 1), (batch, tokens, TINY.hidden_size), jnp.float32)
    x = x.astype(dtype)
    rope = cos_sin(jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (batch, tokens)), *rope_tables(TINY))
    kv_cache = jnp.zeros((1, 16, TINY.latent_dim), dtype)
    index_cache = jnp.zeros((1, 16, TINY.index_head_dim), dtype)
    slots = jnp.full((batch, tokens), -1, jnp.int32)  # no writes: only the outputs matter here

    def run(x, rope):
        out, _, _, selected = sparse_prefill_attention(attention, x, kv_cache, index_cache, rope, slots, cfg=TINY,
                                                       **prefill_options)
        return out, selected

    mesh = make_mesh(ParallelConfig(tp=1, dcp=1))
    out, selected = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P())))(x, rope)
    return attention, x, rope, out, selected


@pytest.mark.parametrize("query_chunk", [1, 8, 13])
def test_prefill_query_chunks_give_the_one_chunk_result(query_chunk):
    """Chunks of 1, 8 and 13 queries (27 tokens: the last chunk is partial and padded) select the same keys and
    give the same outputs as one chunk of all the queries."""
    _, _, _, want_out, want_selected = _prefill_attention(2, 27, seed=5, dtype=jnp.float32, query_chunk=27)
    _, _, _, out, selected = _prefill_attention(2, 27, seed=5, dtype=jnp.float32, query_chunk=query_chunk)
    np.testing.assert_array_equal(np.asarray(selected), np.asarray(want_selected))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-6, atol=1e-6)


def test_bf16_prefill_selects_what_the_decode_indexer_selects():
    """Every prefill query s selects the top-k of the same f32 scores that decode's indexer (reference and kernel:
    f32 accumulation over the bf16 index cache) computes for that token over keys 0..s."""
    b, t = 3, 96
    p, x, (cos, sin), _, selected = _prefill_attention(b, t, seed=3)
    flat, cos, sin = x.reshape(b * t, -1), cos.reshape(b * t, -1), sin.reshape(b * t, -1)
    q_resid, _, _ = projections.mla_query(p, flat, cos, sin, TINY)
    index_q = projections.index_query(p, q_resid, cos, sin, TINY)
    weights = projections.index_weights(p, flat, TINY)
    index_cache = projections.index_key(p, flat, cos, sin, TINY).reshape(b, t, -1)  # one page of t per prompt
    assert index_cache.dtype == jnp.bfloat16
    block_tables = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)[:, None]
    lens = jnp.tile(jnp.arange(1, t + 1, dtype=jnp.int32), b)
    logits = reference.indexer_logits(index_q, weights, index_cache, block_tables, lens)
    _, want = reference.topk(logits, lens, k=TINY.index_topk)
    got = np.sort(np.asarray(selected).reshape(b * t, -1), axis=-1)
    np.testing.assert_array_equal(got, np.sort(np.asarray(want), axis=-1))


def test_bf16_prefill_attention_is_f32_inside():
    """The prefill's sparse MLA over its own selection equals f32 logits / softmax / value sums on the same bf16
    queries and latents, up to summation order (a bf16 softmax is ~10x further off)."""
    b, t = 2, 64
    p, x, rope, out, selected = _prefill_attention(b, t, seed=5)
    sel = np.asarray(selected)
    is_selected = np.zeros((b, t, t + 1), bool)
    np.put_along_axis(is_selected, np.where(sel >= 0, sel, t), True, axis=-1)

    @jax.jit  # jitted like the prefill, so the bf16 projections round the same way
    def f32_attention(x, rope, is_selected):
        flat = x.reshape(b * t, -1)
        cos, sin = (a.reshape(b * t, -1) for a in rope)
        _, q_nope, q_pe = projections.mla_query(p, flat, cos, sin, TINY)
        q = projections.absorb_query(p, q_nope, q_pe).reshape(b, t, -1, TINY.latent_dim).astype(jnp.float32)
        latent = projections.mla_latent(p, flat, cos, sin, TINY).reshape(b, t, -1).astype(jnp.float32)
        logits = jnp.einsum("bshc,btc->bhst", q, latent, precision="highest") * TINY.softmax_scale
        probs = jax.nn.softmax(jnp.where(is_selected[:, None], logits, -jnp.inf), axis=-1)
        latent_out = jnp.einsum("bhst,btc->bshc", probs, latent[..., : TINY.kv_lora_rank], precision="highest")
        latent_out = latent_out.astype(jnp.bfloat16).reshape(b * t, -1, TINY.kv_lora_rank)
        return projections.output_projection(p, latent_out).reshape(b, t, -1)

    want = np.asarray(f32_attention(x, rope, jnp.asarray(is_selected[..., :t])), np.float32)
    got = np.asarray(out, np.float32)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(f'prefill attention vs f32 math: relative error {err:.2e}')
    assert err < 1e-3, err
