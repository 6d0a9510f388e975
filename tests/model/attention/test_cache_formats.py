"""The cache formats (dcp_jax/model/attention/cache_formats.py). Index keys: the fp8 pool's arrays and bytes, a
prefill chunk's rows scoring an fp8 cache as decode's indexer does, fp8 selections close to the exact ones. Latents:
the fp8 pool's arrays and bytes, prefill writing and attending over the quantized latents. Bad formats refused up
front."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dcp_jax import cli
from dcp_jax.config import DEEPSEEK_V32, TINY, EngineConfig, ParallelConfig
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.step_metadata import build_step_metadata
from dcp_jax.model.attention import cache_formats, projections
from dcp_jax.model.deepseek_v32 import Attention
from dcp_jax.model.kv_cache import allocate_kv_cache
from tests.kv_pools import bytes_per_rank as kv_bytes_per_rank
from dcp_jax.model.mesh import make_mesh
from dcp_jax.model.rope import cos_sin, rope_tables
from dcp_jax.host.arrays import rank_view
from dcp_jax.runtime.context import StepContext
from dcp_jax.serving.engine_args import EngineArgs
from dcp_jax.serving.loading import load_model
from pallas_kernels import Fp8IndexKeys, Fp8LatentCache, formats, reference

# 96 queries over contexts 1..96, most of them past index_topk = 16.
INDEX_BATCH, INDEX_TOKENS = 2, 96


def _layer_over_prompts(attention, x, kv_cache, index_cache):
    """The attention layer over B prompts of T tokens (x [B, T, D]) as one step of B*T rows on one device, prompt
    b in page b of a pool of T-token pages. Returns (out [B, T, D], kv_cache, index_cache, selected [B, T, K],
    rope (cos, sin) [B*T, E/2])."""
    batch, tokens = x.shape[:2]
    layout = DcpLayout(1, 1, tokens)
    md = rank_view(build_step_metadata([tokens] * batch, [tokens] * batch, [[b] for b in range(batch)],
                                       rows=batch * tokens, seqs=batch, layout=layout, max_blocks=1))
    rope = cos_sin(jnp.asarray(md.positions), *rope_tables(TINY))
    ctx = StepContext(cfg=TINY, layout=layout, backend="reference")

    def run(x, kv_cache, index_cache):
        on_device = jax.tree.map(jnp.asarray, md)
        out, pools, selected = attention(x.reshape(batch * tokens, -1), rope,
                                         dict(latent=kv_cache, index_k=index_cache),
                                         dict(latent=on_device, index_k=on_device), ctx=ctx,
                                         selection=jnp.full((batch * tokens, TINY.indexer.topk), -1, jnp.int32))
        return out, pools["latent"], pools["index_k"], selected

    mesh = make_mesh(ParallelConfig(tp=1, dcp=1))
    out, kv_cache, index_cache, selected = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P(), out_specs=P(),
                                                                 check_vma=False))(
        x, kv_cache, index_cache)
    return (np.asarray(out).reshape(batch, tokens, -1), kv_cache, index_cache,
            np.asarray(selected).reshape(batch, tokens, -1), rope)


def test_fp8_pool_is_e4m3_keys_and_f32_scales_at_index_head_dim_plus_4_bytes_a_token():
    engine = EngineConfig(page_size=4, num_pages=8, index_cache="fp8")
    cache = allocate_kv_cache(TINY, engine, 2, make_mesh(ParallelConfig(tp=2, dcp=2)))
    j = TINY.indexer.head_dim
    pool, layers = cache.pools["index_k"], TINY.num_hidden_layers
    assert isinstance(pool, Fp8IndexKeys)
    assert pool.keys.dtype == jnp.float8_e4m3fn and pool.keys.shape == (2, layers, 8, 4, j)
    assert pool.scales.dtype == jnp.float32 and pool.scales.shape == (2, layers, 8, 4)
    assert pool.keys.sharding.shard_shape(pool.keys.shape) == (1, layers, 8, 4, j)  # each DCP rank holds its pages
    assert pool.scales.sharding.shard_shape(pool.scales.shape) == (1, layers, 8, 4)
    tokens_per_rank = TINY.num_hidden_layers * 8 * 4
    assert kv_bytes_per_rank(cache)["index_k"] == tokens_per_rank * (j + 4)
    assert cache_formats.index_key_bytes("fp8", 128, 2) == 132  # DeepSeek-V3.2's J = 128, whatever the model dtype
    assert cache_formats.index_key_bytes("exact", 128, 2) == 256
    exact = allocate_kv_cache(TINY, EngineConfig(page_size=4, num_pages=8), 2, make_mesh(ParallelConfig(tp=2, dcp=2)))
    assert kv_bytes_per_rank(exact)["index_k"] == tokens_per_rank * j * 4  # f32


def _prefill_index(index_cache: str, seed: int = 3):
    """A random tiny attention layer over INDEX_BATCH prompts of INDEX_TOKENS tokens (`_layer_over_prompts`).
    Returns (attention, x, rope, selected [B, T, K], the written index cache)."""
    batch, tokens = INDEX_BATCH, INDEX_TOKENS
    attention = Attention(TINY, 0, rngs=nnx.Rngs(seed))
    x = jax.random.normal(jax.random.key(seed + 1), (batch, tokens, TINY.hidden_size), jnp.float32)
    kv_cache = jnp.zeros((batch, tokens, TINY.latent_dim))
    index_cache = cache_formats.zero_index_keys((batch, tokens, TINY.indexer.head_dim), index_cache, jnp.float32)
    _, _, index_cache, selected, rope = _layer_over_prompts(attention, x, kv_cache, index_cache)
    return attention, x, rope, selected, index_cache


def test_fp8_prefill_selects_what_the_decode_indexer_selects_over_the_written_cache():
    """Every prefill query s selects the top-k of the scores decode's indexer gives its fp8 query over the fp8
    keys and scales the prefill wrote for tokens 0..s."""
    attention, x, (cos, sin), selected, index_cache = _prefill_index("fp8")
    batch, tokens = INDEX_BATCH, INDEX_TOKENS
    assert isinstance(index_cache, Fp8IndexKeys) and index_cache.keys.dtype == jnp.float8_e4m3fn
    p, rows = attention.params(), batch * tokens
    flat, cos, sin = x.reshape(rows, -1), cos.reshape(rows, -1), sin.reshape(rows, -1)
    q_a, _ = projections.low_rank_projections(p, flat, TINY, backend="reference")
    q_resid, _, _ = projections.mla_query(p, q_a, cos, sin, TINY, backend="reference")
    index_q = projections.index_query(p, q_resid, cos, sin, TINY, backend="reference")
    q8, weights = formats.quantize_index_queries(index_q, projections.index_weights(p, flat, TINY))
    block_tables = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), tokens)[:, None]
    lens = jnp.tile(jnp.arange(1, tokens + 1, dtype=jnp.int32), batch)
    logits = reference.indexer_logits(q8, weights, index_cache, block_tables, lens)
    _, want = reference.topk(logits, lens, k=TINY.indexer.topk)
    np.testing.assert_array_equal(np.sort(selected.reshape(rows, -1), axis=-1), np.sort(np.asarray(want), axis=-1))


def test_fp8_selection_overlaps_the_exact_selection():
    """Queries with more than index_topk keys to choose from: most of the fp8 top-k is the exact top-k."""
    k = TINY.indexer.topk
    exact, fp8 = _prefill_index("exact")[3], _prefill_index("fp8")[3]
    overlaps = [len(np.intersect1d(exact[b, s], fp8[b, s])) / k for b in range(INDEX_BATCH)
                for s in range(k, INDEX_TOKENS)]
    assert 0.8 <= np.mean(overlaps) < 1.0, np.mean(overlaps)  # < 1: the fp8 scores are not the exact ones


def test_bad_index_cache_formats_are_refused_before_anything_runs(capsys):
    with pytest.raises(ValueError, match=r"index_cache='fp16' must be one of \('exact', 'fp8'\)"):
        EngineConfig(index_cache="fp16")
    from dcp_jax import LLM
    from bench.bench_decode import Grid
    from dcp_jax.serving.engine import Engine

    with pytest.raises(ValueError, match="index_cache='int8'"):
        LLM("tiny", index_cache="int8")
    with pytest.raises(ValueError, match="index_cache='int8'"):
        Engine("tiny", index_cache="int8", progress=False)
    with pytest.raises(ValueError, match="index_cache='bf16'"):
        Grid(index_cache="bf16")
    for command in (["generate", "--prompt", "x"], ["serve"], ["bench", "decode"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(command + ["--index-cache", "fp16"])
        assert exit_info.value.code == 2
        assert "--index-cache: invalid choice: 'fp16'" in capsys.readouterr().err


# Contexts 1..40, most of them past index_topk = 16.
LATENT_BATCH, LATENT_TOKENS = 2, 40


def test_fp8_pool_is_e4m3_latent_f32_tile_scales_and_bf16_rope():
    engine = EngineConfig(page_size=4, num_pages=8, latent_cache="fp8")
    cache = allocate_kv_cache(TINY, engine, 2, make_mesh(ParallelConfig(tp=2, dcp=2)))
    c, e = TINY.kv_lora_rank, TINY.qk_rope_head_dim
    pool, layers = cache.pools["latent"], TINY.num_hidden_layers
    assert isinstance(pool, Fp8LatentCache)
    assert pool.latent.dtype == jnp.float8_e4m3fn and pool.latent.shape == (2, layers, 8, 4, c)
    assert pool.scales.dtype == jnp.float32 and pool.scales.shape == (2, layers, 8, 4, c // 128)
    assert pool.rope.dtype == jnp.bfloat16 and pool.rope.shape == (2, layers, 8, 4, e)
    for part in jax.tree.leaves(pool):
        assert part.sharding.shard_shape(part.shape)[:4] == (1, layers, 8, 4)  # each DCP rank holds its pages
    assert (cache.entries("latent"), cache.num_pages, cache.page_size) == (layers, 8, 4)
    tokens_per_rank = TINY.num_hidden_layers * 8 * 4
    assert kv_bytes_per_rank(cache)["latent"] == tokens_per_rank * cache_formats.latent_bytes("fp8", TINY, 4)
    assert cache_formats.latent_bytes("fp8", TINY, 4) == c + 4 * (c // 128) + 2 * e
    assert cache_formats.latent_bytes("fp8", DEEPSEEK_V32, 2) == 656  # FlashMLA's format
    assert cache_formats.latent_bytes("exact", DEEPSEEK_V32, 2) == 1152


def _prefill_latent(latent_cache: str, seed: int = 3):
    """A random tiny attention layer over LATENT_BATCH prompts of LATENT_TOKENS tokens (`_layer_over_prompts`).
    Returns (attention output, selected [B, T, K], the written latent cache, the layer's latents of the prompts)."""
    batch, tokens = LATENT_BATCH, LATENT_TOKENS
    attention = Attention(TINY, 0, rngs=nnx.Rngs(seed))
    x = jax.random.normal(jax.random.key(seed + 1), (batch, tokens, TINY.hidden_size), jnp.float32)
    kv_cache = cache_formats.zero_latents((batch, tokens), TINY, latent_cache, jnp.float32)
    index_cache = jnp.zeros((batch, tokens, TINY.indexer.head_dim))
    out, kv_cache, _, selected, (cos, sin) = _layer_over_prompts(attention, x, kv_cache, index_cache)
    _, ckv = projections.low_rank_projections(attention.params(), x.reshape(batch * tokens, -1), TINY,
                                              backend="reference")
    latents = projections.mla_latent(attention.params(), ckv, cos, sin, TINY)
    return out, selected, kv_cache, latents.reshape(batch, tokens, -1)


def test_fp8_prefill_writes_the_quantized_latents_and_attends_over_them():
    out, selected, cache, latents = _prefill_latent("fp8")
    assert isinstance(cache, Fp8LatentCache) and cache.latent.dtype == jnp.float8_e4m3fn
    # Each value rounded to e4m3 (3 mantissa bits: within 2**-4 relative, or 2**-10 of its scale below e4m3's
    # normals) times its tile's power-of-two scale; the rope rounded to bf16.
    got = np.asarray(formats.dequantize_latent_cache(cache))
    c = TINY.kv_lora_rank
    np.testing.assert_allclose(got[..., :c], latents[..., :c], rtol=2**-4, atol=float(cache.scales.max()) * 2**-10)
    np.testing.assert_allclose(got[..., c:], latents[..., c:], rtol=2**-8, atol=0)
    exact_out, exact_selected, exact_cache, _ = _prefill_latent("exact")
    np.testing.assert_array_equal(selected, exact_selected)  # the exact index cache selects alike
    np.testing.assert_allclose(np.asarray(exact_cache), latents, rtol=1e-5, atol=1e-6)
    change = np.linalg.norm(out - exact_out) / np.linalg.norm(exact_out)
    assert 0 < change < 0.05  # e4m3's 3 mantissa bits, not more


def test_bad_latent_formats_are_refused_before_loading():
    with pytest.raises(ValueError, match="latent_cache='int4' must be one of"):
        load_model(EngineArgs(model="tiny", latent_cache="int4"))
    narrow = dataclasses.replace(TINY, kv_lora_rank=64)
    with pytest.raises(ValueError, match="needs kv_lora_rank a multiple of 128; this model's is 64"):
        cache_formats.check_latent_format("fp8", narrow)
    cache_formats.check_latent_format("exact", narrow)
