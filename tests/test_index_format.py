"""The index cache formats (dcp_jax/attention/index_format.py): the fp8 pool's arrays and bytes, prefill and decode
scoring an fp8 cache alike, fp8 selections close to the exact ones, and bad format names refused up front."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dcp_jax import cli
from dcp_jax.attention import index_format, projections
from dcp_jax.attention.index_format import Fp8IndexKeys
from dcp_jax.config import TINY, EngineConfig, ParallelConfig
from dcp_jax.kv_cache import allocate_kv_cache, kv_bytes_per_rank
from dcp_jax.mesh import make_mesh
from dcp_jax.model import Attention
from dcp_jax.rope import cos_sin, rope_tables
from pallas_kernels import quant, reference

BATCH, TOKENS = 2, 96  # 96 queries over contexts 1..96, most of them past index_topk = 16


def test_fp8_pool_is_e4m3_keys_and_f32_scales_at_index_head_dim_plus_4_bytes_a_token():
    engine = EngineConfig(page_size=4, num_pages=8, index_cache="fp8")
    cache = allocate_kv_cache(TINY, engine, 2, make_mesh(ParallelConfig(tp=2, dcp=2)))
    j = TINY.index_head_dim
    for pool in cache.index_k:
        assert isinstance(pool, Fp8IndexKeys)
        assert pool.keys.dtype == jnp.float8_e4m3fn and pool.keys.shape == (2, 8, 4, j)
        assert pool.scales.dtype == jnp.float32 and pool.scales.shape == (2, 8, 4)
        assert pool.keys.sharding.shard_shape(pool.keys.shape) == (1, 8, 4, j)  # each DCP rank holds its pages
        assert pool.scales.sharding.shard_shape(pool.scales.shape) == (1, 8, 4)
    tokens_per_rank = TINY.num_hidden_layers * 8 * 4
    assert kv_bytes_per_rank(cache)["index_k"] == tokens_per_rank * (j + 4)
    assert index_format.bytes_per_token("fp8", 128, 2) == 132  # DeepSeek-V3.2's J = 128, whatever the model dtype
    assert index_format.bytes_per_token("exact", 128, 2) == 256
    exact = allocate_kv_cache(TINY, EngineConfig(page_size=4, num_pages=8), 2, make_mesh(ParallelConfig(tp=2, dcp=2)))
    assert kv_bytes_per_rank(exact)["index_k"] == tokens_per_rank * j * 4  # f32


def _prefill(index_cache: str, seed: int = 3):
    """Layer `Attention.prefill` of a random tiny layer on one device: BATCH prompts of TOKENS tokens, prompt b in
    page b (page size TOKENS). Returns (attention, x, rope, selected [B, T, K], the written index cache)."""
    attention = Attention(TINY, rngs=nnx.Rngs(seed))
    x = jax.random.normal(jax.random.key(seed + 1), (BATCH, TOKENS, TINY.hidden_size), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(TOKENS, dtype=jnp.int32), (BATCH, TOKENS))
    rope = cos_sin(positions, *rope_tables(TINY))
    kv_cache = jnp.zeros((BATCH, TOKENS, TINY.latent_dim))
    index_cache = index_format.zeros((BATCH, TOKENS, TINY.index_head_dim), index_cache, jnp.float32)
    slots = jnp.arange(BATCH * TOKENS, dtype=jnp.int32).reshape(BATCH, TOKENS)

    def run(x, rope, kv_cache, index_cache):
        _, _, index_cache, selected = attention.prefill(x, rope, kv_cache, index_cache, slots)
        return selected, index_cache

    mesh = make_mesh(ParallelConfig(tp=1, dcp=1))
    selected, index_cache = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P(), out_specs=P()))(
        x, rope, kv_cache, index_cache)
    return attention, x, rope, np.asarray(selected), index_cache


def test_fp8_prefill_selects_what_the_decode_indexer_selects_over_the_written_cache():
    """Every prefill query s selects the top-k of the scores decode's indexer gives its fp8 query over the fp8
    keys and scales the prefill wrote for tokens 0..s."""
    attention, x, (cos, sin), selected, index_cache = _prefill("fp8")
    assert isinstance(index_cache, Fp8IndexKeys) and index_cache.keys.dtype == jnp.float8_e4m3fn
    p, rows = attention.params(), BATCH * TOKENS
    flat, cos, sin = x.reshape(rows, -1), cos.reshape(rows, -1), sin.reshape(rows, -1)
    q_resid, _, _ = projections.mla_query(p, flat, cos, sin, TINY)
    q8, weights = quant.quantize_index_queries(projections.index_query(p, q_resid, cos, sin, TINY),
                                               projections.index_weights(p, flat, TINY))
    block_tables = jnp.repeat(jnp.arange(BATCH, dtype=jnp.int32), TOKENS)[:, None]
    lens = jnp.tile(jnp.arange(1, TOKENS + 1, dtype=jnp.int32), BATCH)
    logits = reference.indexer_logits(q8, weights, index_cache.keys, block_tables, lens, k_scale=index_cache.scales)
    _, want = reference.topk(logits, lens, k=TINY.index_topk)
    np.testing.assert_array_equal(np.sort(selected.reshape(rows, -1), axis=-1), np.sort(np.asarray(want), axis=-1))


def test_fp8_selection_overlaps_the_exact_selection():
    """Queries with more than index_topk keys to choose from: most of the fp8 top-k is the exact top-k."""
    k = TINY.index_topk
    exact, fp8 = _prefill("exact")[3], _prefill("fp8")[3]
    overlaps = [len(np.intersect1d(exact[b, s], fp8[b, s])) / k for b in range(BATCH) for s in range(k, TOKENS)]
    assert 0.8 <= np.mean(overlaps) < 1.0, np.mean(overlaps)  # < 1: the fp8 scores are not the exact ones


def test_bad_index_cache_formats_are_refused_before_anything_runs(capsys):
    with pytest.raises(ValueError, match=r"index_cache='fp16' must be one of \('exact', 'fp8'\)"):
        EngineConfig(index_cache="fp16")
    from dcp_jax import LLM
    from dcp_jax.decode_bench import Grid
    from dcp_jax.engine import Engine

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
