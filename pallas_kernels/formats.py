"""The quantized formats the kernels take, plain jnp: the lightning indexer's fp8 keys and queries as DeepSeek-V3.2
builds them (spec 1.2), the fp8 latent cache of sparse MLA (FlashMLA's), and MXFP4 expert weights (AMD Quark's
OCP microscaling fp4). The caches and the weights are registered dataclasses, passed to their kernels whole in
place of a plain array.

Formulas (J = index head dim, a power of two):
- `hadamard(x) = x @ Had_J * J^-0.5` with Had_J the J x J Sylvester Hadamard matrix: orthogonal and symmetric, so
  `hadamard(q) . hadamard(k) == q . k` in exact arithmetic. It spreads outlier channels before quantization.
- `quantize_e4m3_ue8m0(x)`: `scale = 2^ceil(log2(max(amax, 1e-4) / 448))` (ue8m0: a power of two, rounded up
  so `|x| / scale <= 448`, the largest e4m3 value), `x8 = e4m3(x / scale)`; dividing by a power of two is exact.
- Index keys (`Fp8IndexKeys`): one scale per token, `quantize(hadamard(k))`: 128 B fp8 + 4 B f32 = 132 B/token
  at J = 128.
- Index queries: one scale per (row, head), `q8, q_scale = quantize(hadamard(q))`, folded into the head weights.
  The weights are taken exactly as `dcp_jax.model.attention.projections.index_weights` returns them, i.e. with the
  I^-0.5 head scale and the J^-0.5 dot scale already folded in: `w[i] = weights_proj(x)[i] * I^-0.5 * J^-0.5`.
  Since relu(c * a) = c * relu(a) for c > 0,
  `sum_i w[i] * relu(q[i] . k) ~= k_scale * sum_i (w[i] * q_scale[i]) * relu(q8[i] . k8)`,
  which is what `indexer_logits(q8, folded_weights, Fp8IndexKeys(k8, k_scale), ...)` computes; the bf16 path
  passes the same `w` with the unquantized q and k.
- Latent cache (`Fp8LatentCache`, FlashMLA's fp8 sparse-decode format, 656 B/token at C = 512, E = 64): per
  token, the latent's C values in e4m3 with one ue8m0 scale per 128 columns (4 f32), and the roped key's E values
  in bf16, kept as three arrays. An e4m3 value times a power of two is exact in bf16, so dequantizing loses
  nothing.
- MXFP4 weights (`Mxfp4Weight`, OCP Microscaling Formats v1.0 as AMD Quark exports them, e.g. amd/GLM-5.2-MXFP4):
  per matrix [out, in], `packed` uint8 [out, in / 2] (element 2i of a row in the low nibble of byte i, element
  2i + 1 in the high nibble) and `scales` uint8 [out, in / 32] (one e8m0 code per 32 consecutive inputs of a row):
  `w[o, i] = e2m1(code[o, i]) * 2^(scales[o, i // 32] - 127)`, where an e2m1 code has the sign in bit 3 and
  magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0..7, and e8m0 code 255 is NaN. 0.5 + 1/32 = 0.53 B a weight.
  Every value is exact in bf16 (1 mantissa bit) but for scales near the ends of its range.
- `quantize_mxfp4(w)`, the OCP spec's conversion (section 6.3): per block of 32, `shared = floor(log2(amax)) - 2`
  (2: e2m1's largest exponent, 6 = 1.5 * 2^2) clamped to e8m0's [-127, 127] (-127 for an all-zero block), then
  each `w / 2^shared` clamped to +-6 (the spec saturates to the largest normal) and rounded to the nearest e2m1
  value, ties to the even code. Quark's Triton quantizer (quark/torch/kernel/mx/triton.py,
  `_compute_quant_and_scale`) takes this exponent after rounding amax's mantissa to e2m1's precision (its "even"
  mode) or 2^ceil / 2^floor of amax / 6 (its other modes), and breaks element ties away from zero: a block may
  land one scale apart, a halfway value one code apart. Dequantizing is the same for all.
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
AMAX_FLOOR = 1e-4  # keeps all-zero vectors at a finite scale
LATENT_TILE = 128  # latent columns per scale in the fp8 latent cache
MX_BLOCK = 32  # inputs of a row per e8m0 scale (OCP MX)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of the e2m1 codes 0..7; bit 3 is the sign
E2M1_MAX = 6.0
E2M1_MAX_EXPONENT = 2  # 6 = 1.5 * 2^2
E8M0_BIAS = 127
E8M0_NAN = 255
F32_MIN_NORMAL = 2.0**-126


def hadamard(x):
    """Normalized Walsh-Hadamard transform of the last dim (a power of two), in f32; orthogonal."""
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard needs a power-of-two last dim, got {x.shape=}")
    y = x.astype(jnp.float32)
    lead = y.shape[:-1]
    half = 1
    while half < n:
        # Butterfly over pairs (i, i + half) inside blocks of 2*half: (a + b, a - b).
        pairs = y.reshape(*lead, n // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, n)
        half *= 2
    return y * n**-0.5


def kept_e4m3(quantized):
    """e4m3 arrays (any pytree of them) kept as such under jit when jnp code reads them back in the same program:
    XLA's GPU compiler drops an f32 -> e4m3 -> f32 round trip as excess precision (measured on an H100:
    docs/performance.md, "Correct on the GPU"), which would compute with the unrounded values."""
    return jax.lax.optimization_barrier(quantized)


def quantize_e4m3_ue8m0(x, axis=-1):
    """fp8 e4m3 values and power-of-two scales over `axis`.

    Returns (x8 float8_e4m3fn of x's shape, scale f32 of x's shape without `axis`), with
    `x ~= x8 * scale` and `scale = 2^ceil(log2(max(amax, 1e-4) / 448))`.
    """
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    raw = jnp.maximum(amax, AMAX_FLOOR) / E4M3_MAX
    # raw = mantissa * 2^exponent with mantissa in [0.5, 1): a power of two exactly when mantissa == 0.5.
    mantissa, exponent = jnp.frexp(raw)
    scale = jnp.ldexp(jnp.ones_like(raw), jnp.where(mantissa == 0.5, exponent - 1, exponent))
    x8 = (x / scale).astype(jnp.float8_e4m3fn)
    return x8, jnp.squeeze(scale, axis=axis)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8IndexKeys:
    """The fp8 index-key cache: `keys` [..., J] float8_e4m3fn (the Hadamard-rotated keys divided by their scale),
    `scales` [...] f32 (each token's power-of-two scale; 0 for a slot never written, whose scores are then 0).
    The kernels take it as [pages, B, J] and [pages, B]."""
    keys: jax.Array
    scales: jax.Array


def quantize_index_keys(keys) -> Fp8IndexKeys:
    """keys [..., J] (f32/bf16) -> Fp8IndexKeys of [..., J] e4m3 and [...] f32: Hadamard, then per token."""
    return Fp8IndexKeys(*quantize_e4m3_ue8m0(hadamard(keys), axis=-1))


def dequantize_index_keys(cache: Fp8IndexKeys):
    """Fp8IndexKeys -> f32 [..., J]: the rotated keys (exact: every value is representable)."""
    return cache.keys.astype(jnp.float32) * cache.scales[..., None]


def quantize_index_queries(q, weights):
    """Per-(row, head) fp8 queries with the query scale folded into the head weights.

    q [R, I, J] (f32/bf16, `projections.index_query`), weights [R, I] f32 exactly as
    `projections.index_weights` returns them (`weights_proj(x) * I^-0.5 * J^-0.5`, may be negative; the same
    weights the bf16 indexer takes). Returns (q8 [R, I, J] float8_e4m3fn, folded_weights [R, I] f32 =
    weights * q_scale); no other scale is applied here.
    """
    if q.ndim != 3 or weights.shape != q.shape[:2]:
        raise ValueError(f"need q [R, Hi, Di] and weights [R, Hi], got {q.shape=} {weights.shape=}")
    q8, q_scale = quantize_e4m3_ue8m0(hadamard(q), axis=-1)
    return q8, weights.astype(jnp.float32) * q_scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8LatentCache:
    """The fp8 latent cache of sparse MLA: `latent` [..., C] float8_e4m3fn, `scales` [..., C // 128] f32 (powers
    of two), `rope` [..., E] bf16. Token t is latent[t] times its tile scales, then rope[t]. The kernels take it
    as [pages, B, ...]."""
    latent: jax.Array
    scales: jax.Array
    rope: jax.Array


def quantize_latent_cache(kv, value_dim=512) -> Fp8LatentCache:
    """kv [..., C + E] (latent then roped key, f32/bf16) -> Fp8LatentCache, C = value_dim a multiple of 128:
    e4m3 latent with one ue8m0 scale per 128 columns of each token; the roped key rounded to bf16."""
    if value_dim % LATENT_TILE or not 0 < value_dim < kv.shape[-1]:
        raise ValueError(f"value_dim must be a positive multiple of {LATENT_TILE} below the row width "
                         f"{kv.shape[-1]}; got {value_dim}")
    tiles = kv[..., :value_dim].reshape(*kv.shape[:-1], value_dim // LATENT_TILE, LATENT_TILE)
    latent, scales = quantize_e4m3_ue8m0(tiles, axis=-1)
    return Fp8LatentCache(latent.reshape(*kv.shape[:-1], value_dim), scales,
                          kv[..., value_dim:].astype(jnp.bfloat16))


def dequantize_latent_cache(cache: Fp8LatentCache):
    """Fp8LatentCache -> f32 [..., C + E] (exact: every value is representable)."""
    latent = cache.latent.astype(jnp.float32)
    tiles = latent.reshape(*latent.shape[:-1], -1, LATENT_TILE) * cache.scales[..., None]
    return jnp.concatenate([tiles.reshape(latent.shape), cache.rope.astype(jnp.float32)], axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mxfp4Weight:
    """Grouped weights in OCP MXFP4 (the module's formula), each group's matrix [out, in] as AMD Quark exports an
    expert's `weight` and `weight_scale`: K-major, read so by `pallas_kernels.grouped_matmul_mxfp4`."""
    # [groups, out, in / 2] uint8: two e2m1 codes a byte, input 2i in the low nibble, 2i + 1 in the high one.
    packed: jax.Array
    # [groups, out, in / 32] uint8: e8m0 codes, 2^(code - 127), one per 32 consecutive inputs of a row.
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The dequantized weights' shape, [groups, out, in]."""
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])


def _namespace(*arrays):
    """numpy for numpy arrays (the loader's), jax.numpy for anything else."""
    return np if all(isinstance(a, (np.ndarray, np.generic)) for a in arrays) else jnp


def quantize_mxfp4(w):
    """w [..., in] finite (f32 or bf16, in a multiple of 32; numpy in, numpy out) -> (packed uint8 [..., in / 2],
    scales uint8 [..., in / 32]) by the module's rule: `dequantize_mxfp4(*quantize_mxfp4(w))` returns w exactly when
    each block of 32 already lies on its own MXFP4 grid."""
    xp = _namespace(w)
    if w.shape[-1] % MX_BLOCK:
        raise ValueError(f"MXFP4 needs the input axis a multiple of {MX_BLOCK}; got {w.shape=}")
    blocks = w.astype(xp.float32).reshape(*w.shape[:-1], w.shape[-1] // MX_BLOCK, MX_BLOCK)
    amax = xp.max(xp.abs(blocks), axis=-1, keepdims=True)
    # amax = mantissa * 2^exponent, mantissa in [0.5, 1): floor(log2(amax)) = exponent - 1, exact. Blocks of f32
    # subnormals (which XLA flushes to zero) and all-zero ones take the smallest scale.
    _, exponent = xp.frexp(amax)
    shared = xp.where(amax >= F32_MIN_NORMAL, exponent - 1 - E2M1_MAX_EXPONENT, -E8M0_BIAS)
    shared = xp.clip(shared, -E8M0_BIAS, E8M0_BIAS).astype(xp.int32)
    magnitude = xp.minimum(xp.abs(xp.ldexp(blocks, -shared)), E2M1_MAX)  # exact: a power of two
    # The e2m1 grid is 0.5 apart below 2, 1 apart in [2, 4), 2 apart from 4; round half to even on it.
    step = xp.where(magnitude < 2, 0.5, xp.where(magnitude < 4, 1.0, 2.0)).astype(xp.float32)
    rounded = xp.round(magnitude / step) * step
    # 0 0.5 1 1.5 -> codes 0..3; 2 3 -> 4 5; 4 6 -> 6 7.
    code = xp.where(rounded < 2, 2 * rounded, xp.where(rounded < 4, rounded + 2, rounded / 2 + 4))
    codes = (code + 8 * xp.signbit(blocks)).astype(xp.uint8).reshape(w.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.astype(xp.uint8), (shared[..., 0] + E8M0_BIAS).astype(xp.uint8)


def dequantize_mxfp4(packed, scales, dtype=jnp.float32):
    """packed uint8 [..., in / 2] and scales uint8 [..., in / 32] (numpy in, numpy out) -> [..., in] in `dtype`:
    `e2m1(code) * 2^(scale - 127)`, NaN for scale code 255. Values under 2^-126 (f32 subnormals, only at scale
    codes 0 and 1) come out 0 from XLA, which flushes subnormals; numpy keeps them."""
    xp = _namespace(packed, scales)
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] != scales.shape[-1] * MX_BLOCK // 2:
        raise ValueError(f"need packed [..., in / 2] and scales [..., in / {MX_BLOCK}]; got {packed.shape=} "
                         f"{scales.shape=}")
    codes = xp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    magnitude = xp.asarray(E2M1_VALUES, xp.float32)[codes & 7]
    values = xp.where(codes >= 8, -magnitude, magnitude).reshape(*scales.shape, MX_BLOCK)
    is_nan = scales[..., None] == E8M0_NAN
    exponents = xp.where(is_nan, 0, scales.astype(xp.int32)[..., None] - E8M0_BIAS)  # 2^128 would overflow
    scaled = xp.where(is_nan, xp.float32(np.nan), xp.ldexp(values, exponents))
    return scaled.reshape(codes.shape).astype(dtype)
