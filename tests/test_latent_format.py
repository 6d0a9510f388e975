"""The latent cache formats (dcp_jax/attention/latent_format.py): the fp8 pool's arrays and bytes, prefill writing
and attending over the quantized latents, and bad formats refused up front."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dcp_jax.attention import latent_format, projections
from dcp_jax.config import DEEPSEEK_V32, TINY, EngineConfig, ParallelConfig
from dcp_jax.kv_cache import allocate_kv_cache, kv_bytes_per_rank
from dcp_jax.loading import load_model
from dcp_jax.mesh import make_mesh
from dcp_jax.model import Attention
from dcp_jax.rope import cos_sin, rope_tables
from pallas_kernels import quant
from pallas_kernels.quant import Fp8LatentCache

BATCH, TOKENS = 2, 40  # contexts 1..40, most of them past index_topk = 16


def test_fp8_pool_is_e4m3_latent_f32_tile_scales_and_bf16_rope():
    engine = EngineConfig(page_size=4, num_pages=8, latent_cache="fp8")
    cache = allocate_kv_cache(TINY, engine, 2, make_mesh(ParallelConfig(tp=2, dcp=2)))
    c, e = TINY.kv_lora_rank, TINY.qk_rope_head_dim
    for pool in cache.latent:
        assert isinstance(pool, Fp8LatentCache)
        assert pool.latent.dtype == jnp.float8_e4m3fn and pool.latent.shape == (2, 8, 4, c)
        assert pool.scales.dtype == jnp.float32 and pool.scales.shape == (2, 8, 4, c // 128)
        assert pool.rope.dtype == jnp.bfloat16 and pool.rope.shape == (2, 8, 4, e)
        for part in pool:
            assert part.sharding.shard_shape(part.shape)[:3] == (1, 8, 4)  # each DCP rank holds its pages
    assert (cache.num_pages, cache.page_size) == (8, 4)
    tokens_per_rank = TINY.num_hidden_layers * 8 * 4
    assert kv_bytes_per_rank(cache)["latent"] == tokens_per_rank * latent_format.bytes_per_token("fp8", TINY, 4)
    assert latent_format.bytes_per_token("fp8", TINY, 4) == c + 4 * (c // 128) + 2 * e
    assert latent_format.bytes_per_token("fp8", DEEPSEEK_V32, 2) == 656  # FlashMLA's format
    assert latent_format.bytes_per_token("exact", DEEPSEEK_V32, 2) == 1152


def _prefill(latent_cache: str, seed: int = 3):
    """Layer `Attention.prefill` of a random tiny layer on one device: BATCH prompts of TOKENS tokens, prompt b in
    page b (page size TOKENS). Returns (attention output, selected [B, T, K], the written latent cache, the
    layer's latents of the prompts)."""
    attention = Attention(TINY, rngs=nnx.Rngs(seed))
    x = jax.random.normal(jax.random.key(seed + 1), (BATCH, TOKENS, TINY.hidden_size), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(TOKENS, dtype=jnp.int32), (BATCH, TOKENS))
    rope = cos_sin(positions, *rope_tables(TINY))
    kv_cache = latent_format.zeros((BATCH, TOKENS), TINY, latent_cache, jnp.float32)
    index_cache = jnp.zeros((BATCH, TOKENS, TINY.index_head_dim))
    slots = jnp.arange(BATCH * TOKENS, dtype=jnp.int32).reshape(BATCH, TOKENS)

    def run(x, rope, kv_cache, index_cache):
        out, kv_cache, _, selected = attention.prefill(x, rope, kv_cache, index_cache, slots)
        return out, selected, kv_cache

    mesh = make_mesh(ParallelConfig(tp=1, dcp=1))
    out, selected, kv_cache = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P(), out_specs=P()))(
        x, rope, kv_cache, index_cache)
    rows = BATCH * TOKENS
    cos, sin = (a.reshape(rows, -1) for a in rope)
    latents = projections.mla_latent(attention.params(), x.reshape(rows, -1), cos, sin, TINY)
    return np.asarray(out), np.asarray(selected), kv_cache, latents.reshape(BATCH, TOKENS, -1)


def test_fp8_prefill_writes_the_quantized_latents_and_attends_over_them():
    out, selected, cache, latents = _prefill("fp8")
    assert isinstance(cache, Fp8LatentCache) and cache.latent.dtype == jnp.float8_e4m3fn
    # Each value rounded to e4m3 (3 mantissa bits: within 2**-4 relative, or 2**-10 of its scale below e4m3's
    # normals) times its tile's power-of-two scale; the rope rounded to bf16.
    got = np.asarray(quant.dequantize_latent_cache(cache))
    c = TINY.kv_lora_rank
    np.testing.assert_allclose(got[..., :c], latents[..., :c], rtol=2**-4, atol=float(cache.scales.max()) * 2**-10)
    np.testing.assert_allclose(got[..., c:], latents[..., c:], rtol=2**-8, atol=0)
    exact_out, exact_selected, exact_cache, _ = _prefill("exact")
    np.testing.assert_array_equal(selected, exact_selected)  # the exact index cache selects alike
    np.testing.assert_allclose(np.asarray(exact_cache), latents, rtol=1e-5, atol=1e-6)
    change = np.linalg.norm(out - exact_out) / np.linalg.norm(exact_out)
    assert 0 < change < 0.05  # e4m3's 3 mantissa bits, not more


def test_bad_latent_formats_are_refused_before_loading():
    with pytest.raises(ValueError, match="latent_cache='int4' must be one of"):
        load_model("tiny", latent_cache="int4")
    narrow = dataclasses.replace(TINY, kv_lora_rank=64)
    with pytest.raises(ValueError, match="needs kv_lora_rank a multiple of 128; this model's is 64"):
        latent_format.check_model("fp8", narrow)
    latent_format.check_model("exact", narrow)
