"""pallas_kernels.mla_decode (the Triton kernel) against reference.mla_decode: interpreted on CPU, lowered to
Triton IR for CUDA from abstract shapes (the interpreter does not apply Triton's rules), compiled on GPU.

Every test feeds poisoned inputs: cache tokens that no row of their sequence reaches (the rest of a sequence's
last page, pages no sequence owns) hold NaN, and block-table entries past the pages a sequence's longest row reaches
hold -1, ids far outside the cache or ids of the NaN pages, so any read past a length turns the output NaN (or
faults on the GPU). The interpreter fills unwritten outputs with NaN, so a finite result proves every element was
written.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import _mla_decode_triton, formats, reference
from tests.kernels.triton_ir import triton_modules

FP8 = jnp.float8_e4m3fn
SM_SCALE = 0.3

# name -> (M sequences, Y query rows each, H heads, value_dim, rope_dim, P pages a sequence, B page size): tiny for
# the interpreter, real for the GPU.
SHAPES = {
    "tiny": (3, 1, 16, 64, 16, 4, 16),
    "tiny_s2": (2, 2, 16, 64, 16, 4, 16),
    "tiny_s3": (3, 3, 16, 64, 16, 4, 16),          # 48 rows: one 64-row tile with 16 padding rows
    "tiny_h64": (2, 1, 64, 64, 16, 4, 16),
    "tiny_h128": (2, 1, 128, 64, 16, 4, 16),       # two 64-row tiles
    "tiny_long": (1, 1, 16, 64, 16, 16, 16),       # 256 tokens: the default splits (4 on f32, 2 on bf16)
    "tiny_d128": (3, 3, 16, 128, 16, 4, 16),       # the smallest latent an fp8 latent cache takes (one scale tile)
    "deepseek_tiny": (2, 1, 16, 512, 64, 2, 64),   # DeepSeek's widths and page, few tokens
    "deepseek_s2_h128": (2, 2, 128, 512, 64, 3, 64),  # MTP verify rows at TP 1: 256 rows in four tiles
    "deepseek_s3_h64": (2, 3, 64, 512, 64, 2, 64),     # 192 rows in three tiles
    "deepseek_512": (1, 1, 16, 512, 64, 32, 16),       # 512 tokens in pages of 16
    "deepseek_b64": (64, 1, 128, 512, 64, 64, 64),     # M = 64, L = 4K, H = 128
    "deepseek_l32k": (1, 1, 16, 512, 64, 512, 64),     # M = 1, L = 32K, H = 16 (a DCP-8 rank of 128 heads at TP 8)
    "deepseek_l32k_b16": (1, 1, 16, 512, 64, 2048, 16),
    "deepseek_mtp": (8, 2, 128, 512, 64, 64, 64),      # M = 8 MTP rows (Y = 2) at L = 4K, H = 128
}
# Relative Frobenius error of out; absolute and relative error of lse. f32: an lse near 20 is a sum of exp2 terms
# and a log2, a few f32 ulps from the reference (as in test_sparse_mla.py). bf16 (and the fp8 latent cache, which
# computes in bf16): q rounds to bf16 and the softmax weights round to bf16 before the value dot (~4e-3 relative);
# the scores are exact products summed in f32.
TOLERANCE = {jnp.float32: (1e-5, 1e-5, 2e-6), jnp.bfloat16: (1e-2, 1e-3, 0.0)}


def _make_inputs(seed, shape, lens, dtype):
    """q [M, Y, H, C+E], an f32 cache in `dtype` with NaN wherever no row of its sequence reaches, block tables of
    distinct random pages with garbage past the reached ones, lens [M, Y] as given."""
    seqs, queries, heads, value_dim, rope_dim, max_pages, page_size = shape
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens, np.int32)
    assert lens.shape == (seqs, queries)
    longest = np.clip(lens, 0, max_pages * page_size).max(axis=1)
    reached = -(-longest // page_size)  # pages of each sequence that its longest row reaches
    spare = 3  # pages no sequence owns
    num_pages = int(reached.sum()) + spare
    order = rng.permutation(num_pages)
    cache = rng.standard_normal((num_pages, page_size, value_dim + rope_dim)).astype(np.float32)
    cache[order[num_pages - spare:]] = np.nan
    garbage = np.concatenate([order[num_pages - spare:], [-1, 2**30, -(2**30)]])
    tables = np.empty((seqs, max_pages), np.int32)
    first = 0
    for m, count in enumerate(reached):
        tables[m, :count] = order[first:first + count]
        tables[m, count:] = rng.choice(garbage, size=max_pages - count)
        first += count
        if count:
            cache[tables[m, count - 1], longest[m] - (count - 1) * page_size:] = np.nan
    q = rng.standard_normal((seqs, queries, heads, value_dim + rope_dim)).astype(np.float32)
    return jnp.asarray(q, dtype), jnp.asarray(cache, dtype), jnp.asarray(tables), jnp.asarray(lens)


def _fp8_inputs(seed, shape, lens):
    """bf16 queries and the f32 cache quantized to an Fp8LatentCache (NaN tokens stay NaN in every part)."""
    q, cache, tables, lens = _make_inputs(seed, shape, lens, jnp.float32)
    return q.astype(jnp.bfloat16), formats.quantize_latent_cache(cache, value_dim=shape[3]), tables, lens


def _inputs(seed, shape, lens, cache):
    """(q, cache, block_tables, lens) and the dtype whose tolerance holds: cache is "f32", "bf16" or "fp8"."""
    if cache == "fp8":
        return _fp8_inputs(seed, shape, lens), jnp.bfloat16
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[cache]
    return _make_inputs(seed, shape, lens, dtype), dtype


def _decode(*args, backend="triton", **kwargs):
    return pallas_kernels.mla_decode(*args, backend=backend, **kwargs)


def _reference(q, cache, tables, lens, sm_scale, value_dim):
    return jax.jit(reference.mla_decode, static_argnames="value_dim")(q, cache, tables, lens, sm_scale,
                                                                      value_dim=value_dim)


def _check(out, lse, ref_out, ref_lse, lens, dtype):
    out_tol, lse_tol, lse_rtol = TOLERANCE[dtype]
    assert out.dtype == lse.dtype == jnp.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    out, lse, ref_out, ref_lse = map(np.asarray, (out, lse, ref_out, ref_lse))
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    is_empty = np.broadcast_to(np.asarray(lens)[..., None] <= 0, lse.shape)  # [M, Y, H]
    np.testing.assert_array_equal(out[is_empty], 0.0)
    np.testing.assert_array_equal(lse[is_empty], -np.inf)
    full = ~is_empty
    if full.any():
        err = np.linalg.norm(out[full] - ref_out[full]) / np.linalg.norm(ref_out[full])
        assert err < out_tol, f"{err=}"
        np.testing.assert_allclose(lse[full], ref_lse[full], rtol=lse_rtol, atol=lse_tol)


@pytest.mark.parametrize("cache", ["f32", "bf16"])
@pytest.mark.parametrize(
    ("shape_name", "lens", "knobs"),
    [
        # A pad sequence (lens 0, table all garbage), one token, 37 tokens (not a multiple of the 16-token page).
        ("tiny", [[0], [1], [37]], dict(splits=1)),
        # Lens at split ends: 64 over 2 splits of 32 tokens, 32 (16 + 16) and 48 over 3 of 16; 64 is P * B.
        ("tiny", [[64], [32], [48]], dict(splits=2)),
        ("tiny", [[48], [0], [16]], dict(splits=3)),
        # Row 0 ends exactly where split 0 (of the tile's 64 tokens) ends: split 1 is empty for it.
        ("tiny_s2", [[32, 64], [0, 1]], dict(splits=2)),
        # Y = 3 causal rows (base + s) packed with padding rows; one split ends mid-block, another is empty.
        ("tiny_s3", [[0, 1, 2], [30, 31, 32], [13, 14, 15]], dict(splits=3)),
        ("tiny_h64", [[47], [0]], dict()),
        ("tiny_h128", [[64], [5]], dict(splits=2)),
        ("tiny_long", [[200]], dict()),  # default splits (asserted > 1 below): the merge
        # block_t 64 spans 4 pages of 16; 16 query rows a tile: Y = 3 rows in three tiles.
        ("tiny_s3", [[5, 6, 7], [62, 63, 64], [0, 0, 1]], dict(block_t=64, block_r=16, splits=2)),
    ],
)
def test_matches_reference(shape_name, lens, knobs, cache):
    """Tolerance: TOLERANCE[f32] for an f32 cache (1e-5 relative out), TOLERANCE[bf16] for bf16 (1e-2)."""
    shape = SHAPES[shape_name]
    (q, kv_cache, tables, lens), dtype = _inputs(int(np.sum(lens)), shape, lens, cache)
    knobs = dict(dict(block_t=16), **knobs)
    if shape_name == "tiny_long":
        assert _mla_decode_triton.tiling(q, kv_cache, tables, lens, value_dim=64, block_t=16).splits > 1
    out, lse = _decode(q, kv_cache, tables, lens, SM_SCALE, value_dim=shape[3], **knobs)
    _check(out, lse, *_reference(q, kv_cache, tables, lens, SM_SCALE, shape[3]), lens, dtype)


@pytest.mark.parametrize(
    ("shape_name", "lens", "knobs"),
    [
        ("tiny_d128", [[0, 1, 2], [30, 31, 32], [13, 14, 15]], dict(splits=3)),
        ("tiny_d128", [[64, 64, 64], [0, 0, 0], [16, 17, 18]], dict(splits=1)),
        ("deepseek_tiny", [[100], [0]], dict(splits=2)),  # four scale tiles, page 64
    ],
)
def test_fp8_latent_cache_matches_reference(shape_name, lens, knobs):
    """Tolerance: TOLERANCE[bf16] (the kernel multiplies the exact bf16 values of the e4m3 latents)."""
    shape = SHAPES[shape_name]
    (q, cache, tables, lens), dtype = _inputs(7, shape, lens, "fp8")
    out, lse = _decode(q, cache, tables, lens, SM_SCALE, value_dim=shape[3], block_t=16, **knobs)
    _check(out, lse, *_reference(q, cache, tables, lens, SM_SCALE, shape[3]), lens, dtype)


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize(
    ("shape_name", "lens", "knobs"),
    [
        ("deepseek_tiny", [[128], [1]], dict()),
        ("deepseek_tiny", [[65], [64]], dict(splits=2, block_t=64)),  # a row one past the page, one at it
        pytest.param("deepseek_s2_h128", [[0, 1], [150, 151]], dict(splits=3), marks=pytest.mark.slow),
        pytest.param("deepseek_s3_h64", [[60, 61, 62], [7, 8, 9]], dict(), marks=pytest.mark.slow),
        pytest.param("deepseek_512", [[500]], dict(), marks=pytest.mark.slow),  # default splits: 4 bf16, 2 fp8
    ],
)
def test_deepseek_widths_match_reference(shape_name, lens, knobs, cache):
    """C = 512, E = 64, pages of 64 and 16, H 16, 64 and 128 (Y up to 3), the default knobs. Tolerance:
    TOLERANCE[bf16] (the fp8 cache computes in bf16)."""
    shape = SHAPES[shape_name]
    (q, kv_cache, tables, lens), dtype = _inputs(11, shape, lens, cache)
    if shape_name == "deepseek_512":
        assert _mla_decode_triton.tiling(q, kv_cache, tables, lens).splits == {"bf16": 4, "fp8": 2}[cache]
    out, lse = _decode(q, kv_cache, tables, lens, 0.1352, value_dim=512, **knobs)
    _check(out, lse, *_reference(q, kv_cache, tables, lens, 0.1352, 512), lens, dtype)


def test_lens_outside_the_table_act_as_clipped():
    """lens below 0 act as 0 and above P * B as P * B (the contract asks 0 <= lens <= P * B; the kernel never
    reads past the table either way). Tolerance: TOLERANCE[f32]."""
    shape = SHAPES["tiny_s2"]
    q, kv_cache, tables, lens = _make_inputs(3, shape, [[64, 64], [0, 20]], jnp.float32)
    out, lse = _decode(q, kv_cache, tables, jnp.array([[64, 99], [-5, 20]], jnp.int32), SM_SCALE, value_dim=64,
                       block_t=16, splits=2)
    _check(out, lse, *_reference(q, kv_cache, tables, lens, SM_SCALE, 64), lens, jnp.float32)


def test_reference_reads_nothing_past_lens():
    """The reference itself on the poisoned inputs: finite, and equal to attention over the reached tokens alone
    (written out per row)."""
    shape = SHAPES["tiny_s2"]
    q, kv_cache, tables, lens = _make_inputs(5, shape, [[17, 40], [0, 3]], jnp.float32)
    out, lse = reference.mla_decode(q, kv_cache, tables, lens, SM_SCALE, value_dim=64)
    assert np.isfinite(np.asarray(out)).all()
    for m, s in ((0, 0), (0, 1), (1, 1)):
        n = int(lens[m, s])
        kv = kv_cache[tables[m]].reshape(-1, 80)[:n]  # [n, C+E]
        scores = q[m, s] @ kv.T * SM_SCALE  # [H, n]
        np.testing.assert_allclose(lse[m, s], jax.nn.logsumexp(scores, axis=-1), rtol=1e-6)
        np.testing.assert_allclose(out[m, s], jax.nn.softmax(scores, axis=-1) @ kv[:, :64], rtol=1e-5, atol=1e-6)
    assert np.all(np.isneginf(np.asarray(lse[1, 0])))


def test_tiling_packs_rows_and_takes_knobs():
    """Y * H rows pack into tiles of up to block_r (a power of two >= 16); block_t and num_stages default per
    cache dtype; 1024 tokens give 2 splits of >= 512 (a 64-row tile's partial is 131 KB, times 4 over 1152 B)."""
    args = _abstract_args(8, 3, 16, 1024, 64, "bf16")
    assert _mla_decode_triton.tiling(*args) == _mla_decode_triton.Tiling(block_r=64, row_tiles=1, block_t=64,
                                                                        num_stages=3, splits=2)
    assert _mla_decode_triton.tiling(*args, block_r=16, splits=2).row_tiles == 3
    assert _mla_decode_triton.tiling(*_abstract_args(64, 2, 128, 4096, 64, "f32")) == _mla_decode_triton.Tiling(
        block_r=64, row_tiles=4, block_t=16, num_stages=1, splits=1)
    assert _mla_decode_triton.tiling(*_abstract_args(2, 1, 8, 1024, 64, "fp8")).block_r == 16  # 8 rows, padded


def test_default_splits_fill_the_gpu():
    """The docstring's examples (bf16, block_t 64): M = 1 splits to 256 (H = 16) and 64 (H = 128, two tiles) at
    L = 32K; 128 programs are not split; short tables cap the splits at one block's worth of partial bytes."""
    splits = _mla_decode_triton.default_splits
    assert splits(1, 1, 16, 512, 32768, 1152, 64) == 256
    assert splits(1, 2, 64, 512, 32768, 1152, 64) == 64
    assert splits(64, 2, 64, 512, 4096, 1152, 64) == 1
    assert splits(8, 2, 64, 512, 4096, 1152, 64) == 8   # 4096 // 512 tokens, under the 17 the programs want
    assert splits(64, 1, 16, 512, 4096, 1152, 64) == 5  # 64 programs want 5 for 264
    assert splits(1, 1, 16, 512, 100, 1152, 64) == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(q=jnp.zeros((2, 16, 80))), "want q"),
        (dict(kv_cache=jnp.zeros((4, 16, 96))), "mismatched"),
        (dict(lens=jnp.zeros((2, 2), jnp.int32)), "mismatched"),
        (dict(block_tables=jnp.zeros((3, 4), jnp.int32)), "mismatched"),
        (dict(kv_cache=jnp.zeros((4, 16, 80), jnp.float16)), "bf16 or f32"),
        (dict(q=jnp.zeros((2, 1, 16, 80), jnp.float16)), "q must be bf16 or f32"),
        (dict(block_tables=jnp.zeros((2, 4), jnp.float32)), "int32"),
        (dict(value_dim=48), "powers of two"),
        (dict(value_dim=80), "value_dim must be in"),
        (dict(block_r=24), "block_r"),
        (dict(block_t=8), "block_t"),
        (dict(splits=0), "splits"),
    ],
)
def test_rejects_bad_inputs(change, message):
    args = dict(q=jnp.zeros((2, 1, 16, 80)), kv_cache=jnp.zeros((4, 16, 80)),
                block_tables=jnp.zeros((2, 4), jnp.int32), lens=jnp.zeros((2, 1), jnp.int32), value_dim=64)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        _decode(args.pop("q"), args.pop("kv_cache"), args.pop("block_tables"), args.pop("lens"), 0.1, **args)


def test_fp8_latent_cache_rejects_bad_parts():
    (q, cache, tables, lens), _ = _inputs(0, SHAPES["tiny_d128"], [[1, 2, 3]] * 3, "fp8")
    with pytest.raises(ValueError, match="e4m3 latent, f32 scales, bf16 rope"):
        _decode(q, dataclasses.replace(cache, scales=cache.scales.astype(jnp.bfloat16)), tables, lens, 0.1,
                value_dim=128)
    with pytest.raises(ValueError, match="one scale per 128"):
        _decode(q, dataclasses.replace(cache, scales=cache.scales[..., :0]), tables, lens, 0.1, value_dim=128)


def test_backends():
    """"pallas" runs the Triton kernel (there is no Mosaic one), the reference is the reference, and a refusal says
    why; knobs need a named backend."""
    q, kv_cache, tables, lens = _make_inputs(1, SHAPES["tiny"], [[3], [0], [9]], jnp.float32)
    args = (q, kv_cache, tables, lens, SM_SCALE)
    assert pallas_kernels.choose("mla_decode", "pallas", *args, value_dim=64) == "triton"
    out, lse = pallas_kernels.mla_decode(*args, value_dim=64, backend="reference")
    ref_out, ref_lse = reference.mla_decode(*args, value_dim=64)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(lse, ref_lse)
    with pytest.raises(ValueError, match="mla_decode has no 'mosaic' implementation"):
        pallas_kernels.mla_decode(*args, value_dim=64, backend="mosaic")
    narrow = (q[..., :72], kv_cache[..., :72], tables, lens, SM_SCALE)  # rope width 8: under a Triton dot's 16
    with pytest.raises(ValueError, match="backend='pallas' cannot run mla_decode here: triton: value_dim and"):
        pallas_kernels.mla_decode(*narrow, value_dim=64)
    assert pallas_kernels.mla_decode(*narrow, value_dim=64, backend="reference")[0].shape == (3, 1, 16, 64)
    with pytest.raises(TypeError, match="need an explicit backend"):
        pallas_kernels.mla_decode(*args, value_dim=64, splits=2)


S = jax.ShapeDtypeStruct


def _abstract_args(seqs, queries, heads, tokens, page_size, cache):
    """Abstract inputs of DeepSeek's widths over a 4096-page pool."""
    if cache == "fp8":
        kv = formats.Fp8LatentCache(S((4096, page_size, 512), FP8), S((4096, page_size, 4), jnp.float32),
                                    S((4096, page_size, 64), jnp.bfloat16))
    else:
        kv = S((4096, page_size, 576), {"bf16": jnp.bfloat16, "f32": jnp.float32}[cache])
    q_dtype = jnp.float32 if cache == "f32" else jnp.bfloat16
    return (S((seqs, queries, heads, 576), q_dtype), kv, S((seqs, tokens // page_size), jnp.int32),
            S((seqs, queries), jnp.int32))


@pytest.mark.parametrize("cache", ["f32", "bf16", "fp8"])
@pytest.mark.parametrize(("seqs", "queries", "heads", "tokens", "page_size"),
                         [(64, 1, 128, 4096, 64), (1, 1, 16, 32768, 16), (8, 2, 128, 4096, 64), (4, 3, 16, 1024, 64)],
                         ids=["b64_h128", "b1_l32k_h16", "mtp_h128", "s3_h16"])
def test_lowers_for_cuda(monkeypatch, cache, seqs, queries, heads, tokens, page_size):
    """Triton IR for an H200 at the serving shapes (one split and several: the merge is XLA's)."""
    args = _abstract_args(seqs, queries, heads, tokens, page_size, cache)
    (module,) = triton_modules(monkeypatch, lambda *a: pallas_kernels.mla_decode(
        *a, 0.1352, backend="triton", interpret=False), *args)
    assert "tt.dot" in module


@functools.cache
def _gpu_case(shape_name, cache):
    """(inputs, dtype, reference (out, lse)) of a real shape, made once for all its knobs. Row s of a sequence attends
    base + s tokens (causal MTP rows); the bases are the full table first (so M = 1 is one long row), then 0, 1,
    around page and block edges, and random."""
    shape = SHAPES[shape_name]
    seqs, queries, _, _, _, max_pages, page_size = shape
    tokens = max_pages * page_size
    rng = np.random.default_rng(seqs + queries)
    base = np.concatenate([[tokens - queries + 1, 0, 1, 63, 65, 2047], rng.integers(0, tokens - queries + 2, seqs)])
    lens = base[:seqs, None] + np.arange(queries)[None, :]
    inputs, dtype = _inputs(9, shape, lens, cache)
    return inputs, dtype, _reference(*inputs, 0.1352, 512)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("shape_name", ["deepseek_b64", "deepseek_l32k", "deepseek_l32k_b16", "deepseek_mtp"])
def test_real_shapes_on_gpu(shape_name, splits, cache):
    """Compiled at M = 64, L = 4K, H = 128; M = 1, L = 32K, H = 16 (pages of 64 and 16); M = 8 MTP rows (Y = 2,
    causal) at H = 128 (`_gpu_case`'s lens). Tolerance: TOLERANCE[bf16]."""
    (q, kv_cache, tables, lens), dtype, (ref_out, ref_lse) = _gpu_case(shape_name, cache)
    out, lse = jax.jit(lambda *a: _decode(*a, 0.1352, value_dim=512, splits=splits))(q, kv_cache, tables, lens)
    _check(out, lse, ref_out, ref_lse, lens, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_the_default_backend_on_gpu(cache):
    """backend="pallas" (what a model would run) picks the Triton kernel and matches the reference."""
    (q, kv_cache, tables, lens), dtype = _inputs(2, SHAPES["deepseek_mtp"], [[4000, 4001]] * 4 + [[0, 1]] * 4,
                                                 cache)
    assert pallas_kernels.choose("mla_decode", "pallas", q, kv_cache, tables, lens, 0.1352) == "triton"
    out, lse = jax.jit(lambda *a: pallas_kernels.mla_decode(*a, 0.1352))(q, kv_cache, tables, lens)
    _check(out, lse, *_reference(q, kv_cache, tables, lens, 0.1352, 512), lens, dtype)
