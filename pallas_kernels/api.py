"""The public ops and the one table that picks their implementation.

Each op checks its contract (shapes, dtypes) once, then runs one implementation of `IMPLEMENTATIONS[op]`:
- "reference": the pure-jnp function of `reference.py` (any device; obviously right, not fast);
- "triton": the Pallas Triton kernel (compiled on a GPU, interpreted on CPU);
- "mosaic": the Pallas Mosaic GPU kernel (compiled on an sm_90 GPU only), where the op has one;
- "pallas" (the default): the first of mosaic, triton that supports the inputs.
`unsupported(op, backend, ...)` says why an implementation does not take some inputs (empty: it does). Asking for
one that does not is a ValueError giving those reasons; nothing falls back silently. Tuning knobs go to the named
implementation only, so they need an explicit "triton" or "mosaic" backend (their defaults are what "pallas" runs).
Letters: see the legend in `dcp_jax/__init__.py`; the matmuls' widths are spelled out (rows, in, out, groups).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from pallas_kernels import (_fp8_gemm_mosaic, _grouped_matmul_mxfp4_triton, _grouped_matmul_triton, _indexer_mosaic,
                            _indexer_triton, _mla_decode_triton, _sparse_mla_mosaic, _sparse_mla_triton, _topk_triton,
                            reference)
from pallas_kernels.formats import MX_BLOCK, Fp8IndexKeys, Fp8LatentCache, Mxfp4Weight

BACKENDS = ("pallas", "reference", "triton", "mosaic")
_PALLAS_ORDER = ("mosaic", "triton")
_INDEX_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn))
_ROW_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class Implementation:
    # The op's contract in this implementation's terms, plus its keyword-only knobs.
    run: Callable
    # The op's arguments (and interpret) -> why this implementation cannot take them; empty when it can.
    unsupported: Callable[..., list[str]]


def _keys_and_scales(index_cache):
    if isinstance(index_cache, Fp8IndexKeys):
        return index_cache.keys, index_cache.scales
    return index_cache, None


def _never(*args, interpret=None, **kwargs) -> list[str]:
    return []


# ---- indexer_logits / indexer_top_k ----------------------------------------------------------------------------


def _check_indexer_inputs(q, weights, index_cache, block_tables, lens):
    k_cache, k_scale = _keys_and_scales(index_cache)
    if q.ndim != 3 or k_cache.ndim != 3 or block_tables.ndim != 2:
        raise ValueError(f"need q [R, Hi, Di], index_cache [pages, page, Di], block_tables [R, P]; got "
                         f"{q.shape=} {k_cache.shape=} {block_tables.shape=}")
    rows, heads, dim = q.shape
    if weights.shape != (rows, heads) or lens.shape != (rows,) or block_tables.shape[0] != rows:
        raise ValueError(f"row/head mismatch: {q.shape=} {weights.shape=} {block_tables.shape=} {lens.shape=}")
    if k_cache.shape[2] != dim:
        raise ValueError(f"head dim mismatch: {q.shape=} {k_cache.shape=}")
    if jnp.dtype(q.dtype) not in _INDEX_DTYPES or jnp.dtype(k_cache.dtype) not in _INDEX_DTYPES:
        raise ValueError(f"q and the index keys must be f32, bf16 or float8_e4m3fn; got {q.dtype=} {k_cache.dtype=}")
    if block_tables.dtype != jnp.int32 or lens.dtype != jnp.int32:
        raise ValueError(f"block_tables and lens must be int32; got {block_tables.dtype=} {lens.dtype=}")
    if k_scale is not None and (k_scale.shape != k_cache.shape[:2] or k_scale.dtype != jnp.float32):
        raise ValueError(f"Fp8IndexKeys.scales must be f32 [pages, page]; got {k_scale.shape=} {k_scale.dtype=} "
                         f"for keys {k_cache.shape}")


def _indexer_triton_run(q, weights, index_cache, block_tables, lens, *, interpret=None, **knobs):
    k_cache, k_scale = _keys_and_scales(index_cache)
    return _indexer_triton.indexer_logits(q, weights, k_cache, block_tables, lens, k_scale=k_scale,
                                          interpret=interpret, **knobs)


def _indexer_mosaic_run(q, weights, index_cache, block_tables, lens, *, interpret=None, **knobs):
    k_cache, k_scale = _keys_and_scales(index_cache)
    return _indexer_mosaic.indexer_logits(q, weights, k_cache, block_tables, lens, k_scale=k_scale, **knobs)


def _indexer_triton_unsupported(q, weights, index_cache, block_tables, lens, *, interpret=None, **_):
    return _indexer_triton.unsupported(q)


def _indexer_mosaic_unsupported(q, weights, index_cache, block_tables, lens, *, interpret=None, **_):
    return _indexer_mosaic.unsupported(q, *_keys_and_scales(index_cache), interpret)


def _indexer_top_k_triton_run(q, weights, index_cache, block_tables, lens, *, k, sorted=True, interpret=None,
                              topk_knobs=None, **knobs):
    logits = _indexer_triton_run(q, weights, index_cache, block_tables, lens, interpret=interpret, **knobs)
    return _topk_triton.topk(logits, lens, k, sorted=sorted, interpret=interpret, **(topk_knobs or {}))


def _indexer_top_k_mosaic_run(q, weights, index_cache, block_tables, lens, *, k, sorted=True, interpret=None,
                              **knobs):
    k_cache, k_scale = _keys_and_scales(index_cache)
    return _indexer_mosaic.indexer_top_k(q, weights, k_cache, block_tables, lens, k=k, k_scale=k_scale,
                                         sorted=sorted, **knobs)


def _topk_triton_run(scores, lens, *, k, sorted=True, interpret=None, **knobs):
    return _topk_triton.topk(scores, lens, k, sorted=sorted, interpret=interpret, **knobs)


# ---- sparse_mla_decode -----------------------------------------------------------------------------------------


def _check_sparse_mla_inputs(q, kv_cache, slots, counts, sm_scale, value_dim):
    leading = kv_cache.latent.shape if isinstance(kv_cache, Fp8LatentCache) else kv_cache.shape
    if q.ndim != 3 or len(leading) != 3 or slots.ndim != 2 or counts.ndim != 1:
        raise ValueError(f"want q [R, H, Dq], kv_cache [pages, B, Dq], slots [R, S], counts [R]; got "
                         f"{q.shape=}, {leading=}, {slots.shape=}, {counts.shape=}")
    if slots.shape[0] != q.shape[0] or counts.shape[0] != q.shape[0]:
        raise ValueError(f"mismatched rows: {q.shape=}, {slots.shape=}, {counts.shape=}")
    if slots.dtype != jnp.int32 or counts.dtype != jnp.int32:
        raise ValueError(f"slots and counts must be int32; got {slots.dtype=}, {counts.dtype=}")
    if not 0 < value_dim < q.shape[-1]:
        raise ValueError(f"value_dim must be in (0, Dq={q.shape[-1]}); got {value_dim=}")


def _sparse_mla_triton_unsupported(q, kv_cache, slots, counts, sm_scale, value_dim=512, *, interpret=None, **_):
    try:
        logical = (_sparse_mla_triton.fp8_cache_rows(kv_cache, value_dim) if isinstance(kv_cache, Fp8LatentCache)
                   else kv_cache)
        _sparse_mla_triton.check_inputs(q, logical, slots, counts, value_dim)
    except ValueError as e:
        return [str(e)]
    return []


def _sparse_mla_mosaic_unsupported(q, kv_cache, slots, counts, sm_scale, value_dim=512, *, interpret=None, **_):
    return _sparse_mla_mosaic.unsupported(q, kv_cache, value_dim, interpret)


def _sparse_mla_mosaic_run(q, kv_cache, slots, counts, sm_scale, value_dim=512, *, interpret=None, **knobs):
    return _sparse_mla_mosaic.sparse_mla_decode(q, kv_cache, slots, counts, sm_scale, value_dim=value_dim, **knobs)


# ---- mla_decode ------------------------------------------------------------------------------------------------


def _check_mla_decode_inputs(q, kv_cache, block_tables, lens, sm_scale, value_dim):
    leading = kv_cache.latent.shape if isinstance(kv_cache, Fp8LatentCache) else kv_cache.shape
    if q.ndim != 4 or len(leading) != 3 or block_tables.ndim != 2 or lens.ndim != 2:
        raise ValueError(f"want q [M, Y, H, Dq], kv_cache [pages, B, Dq], block_tables [M, P], lens [M, Y]; got "
                         f"{q.shape=}, {leading=}, {block_tables.shape=}, {lens.shape=}")
    if block_tables.shape[0] != q.shape[0] or lens.shape != q.shape[:2]:
        raise ValueError(f"mismatched sequences or query rows: {q.shape=}, {block_tables.shape=}, {lens.shape=}")
    if block_tables.dtype != jnp.int32 or lens.dtype != jnp.int32:
        raise ValueError(f"block_tables and lens must be int32; got {block_tables.dtype=}, {lens.dtype=}")
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"q must be bf16 or f32; got {q.dtype=}")
    if not 0 < value_dim < q.shape[-1]:
        raise ValueError(f"value_dim must be in (0, Dq={q.shape[-1]}); got {value_dim=}")


def _mla_decode_triton_unsupported(q, kv_cache, block_tables, lens, sm_scale, value_dim=512, *, interpret=None, **_):
    return _mla_decode_triton.unsupported(q, kv_cache, block_tables, lens, value_dim)


# ---- grouped_matmul ---------------------------------------------------------------------------------------------


def _check_grouped_matmul_inputs(x, w, group_sizes, *, k_major=False):
    depth_axis, layout = (2, "[G, N, K]") if k_major else (1, "[G, K, N]")
    if x.ndim != 2 or w.ndim != 3 or group_sizes.shape != (w.shape[0],) or x.shape[1] != w.shape[depth_axis]:
        raise ValueError(f"need x [A, K], w {layout}, group_sizes [G]; got {x.shape=} {w.shape=} "
                         f"{group_sizes.shape=}")
    if group_sizes.dtype != jnp.int32:
        raise ValueError(f"group_sizes must be int32; got {group_sizes.dtype}")


def _grouped_matmul_triton_unsupported(x, w, group_sizes, *, interpret=None, **_):
    return _grouped_matmul_triton.unsupported(x, w)


def _grouped_matmul_fp8_triton_unsupported(x, x_scales, w, w_scales, group_sizes, *, block, interpret=None, **_):
    return _grouped_matmul_triton.unsupported_fp8(w, block)


def _check_block_fp8(x, x_scales, w, w_scales, block):
    """x [rows, in] and w [groups, out, in] of e4m3 with f32 scales of blocks (bn, bk): [rows, ceil(in / bk)],
    [groups, ceil(out / bn), ceil(in / bk)]."""
    fp8 = jnp.dtype(jnp.float8_e4m3fn)
    if x.dtype != fp8 or w.dtype != fp8 or x_scales.dtype != jnp.float32 or w_scales.dtype != jnp.float32:
        raise ValueError(f"need e4m3 x and w with f32 scales; got {x.dtype=} {w.dtype=} {x_scales.dtype=} "
                         f"{w_scales.dtype=}")
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block must be (bn, bk) >= 1; got {block}")
    (rows, depth), (groups, width, _) = x.shape, w.shape
    n_blocks, k_blocks = -(-width // block[0]), -(-depth // block[1])
    if x_scales.shape != (rows, k_blocks) or w_scales.shape != (groups, n_blocks, k_blocks):
        raise ValueError(f"need x_scales [A, ceil(K / bk)] and w scales [ceil(N / bn), ceil(K / bk)] for "
                         f"block (bn, bk) = {block}; got {x_scales.shape=} {w_scales.shape=} for {x.shape=} "
                         f"{w.shape=}")


def _check_grouped_matmul_fp8_inputs(x, x_scales, w, w_scales, group_sizes, block):
    _check_grouped_matmul_inputs(x, w, group_sizes, k_major=True)
    _check_block_fp8(x, x_scales, w, w_scales, block)


def _check_grouped_matmul_mxfp4_inputs(x, w, group_sizes):
    if not isinstance(w, Mxfp4Weight):
        raise TypeError(f"w must be an Mxfp4Weight (formats.py); got {type(w).__name__}")
    packed, scales = w.packed, w.scales
    if packed.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
        raise ValueError(f"Mxfp4Weight's packed and scales must be uint8; got {packed.dtype=} {scales.dtype=}")
    if x.ndim != 2 or packed.ndim != 3 or scales.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(f"need x [rows, in], packed [groups, out, in / 2], scales [groups, out, in / {MX_BLOCK}], "
                         f"group_sizes [groups]; got {x.shape=} {packed.shape=} {scales.shape=} "
                         f"{group_sizes.shape=}")
    groups, width, depth = w.shape
    if depth % MX_BLOCK or scales.shape != (groups, width, depth // MX_BLOCK):
        raise ValueError(f"need in a multiple of {MX_BLOCK} and scales [groups, out, in / {MX_BLOCK}] = "
                         f"{(groups, width, depth // MX_BLOCK)} for packed {packed.shape} (in = {depth}); got "
                         f"{scales.shape=}")
    if x.shape[1] != depth or group_sizes.shape != (groups,):
        raise ValueError(f"need x [rows, in = {depth}] and group_sizes [groups = {groups}] for w {w.shape} (groups, "
                         f"out, in); got {x.shape=} {group_sizes.shape=}")
    if jnp.dtype(x.dtype) not in _ROW_DTYPES:
        raise ValueError(f"x must be bf16 or f32; got {x.dtype=}")
    if group_sizes.dtype != jnp.int32:
        raise ValueError(f"group_sizes must be int32; got {group_sizes.dtype}")


def _grouped_matmul_mxfp4_triton_unsupported(x, w, group_sizes, *, interpret=None, **_):
    return _grouped_matmul_mxfp4_triton.unsupported(x, w)


# ---- fp8_gemm ---------------------------------------------------------------------------------------------------


def _check_fp8_gemm_inputs(x, x_scales, w, w_scales, block):
    if x.ndim != 2 or w.ndim != 2 or w_scales.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"need x [M, K], w [N, K], w_scales [ceil(N / bn), ceil(K / bk)]; got {x.shape=} "
                         f"{w.shape=} {w_scales.shape=}")
    _check_block_fp8(x, x_scales, w[None], w_scales[None], block)


def _fp8_gemm_triton_run(x, x_scales, w, w_scales, *, block, out_dtype, interpret=None, **knobs):
    sizes = jnp.array([x.shape[0]], jnp.int32)
    return _grouped_matmul_triton.grouped_matmul_fp8(x, x_scales, w[None], w_scales[None], sizes, block=block,
                                                     out_dtype=out_dtype, interpret=interpret, **knobs)


def _fp8_gemm_triton_unsupported(x, x_scales, w, w_scales, *, block, interpret=None, **_):
    return _grouped_matmul_triton.unsupported_fp8(w[None], block)


def _fp8_gemm_mosaic_unsupported(x, x_scales, w, w_scales, *, block, interpret=None, **_):
    return _fp8_gemm_mosaic.unsupported(x, w, block, interpret)


def _reference_run(fn):
    def run(*args, interpret=None, **kwargs):
        return fn(*args, **kwargs)

    return run


IMPLEMENTATIONS: dict[str, dict[str, Implementation]] = {
    "indexer_logits": {
        "reference": Implementation(_reference_run(reference.indexer_logits), _never),
        "triton": Implementation(_indexer_triton_run, _indexer_triton_unsupported),
        "mosaic": Implementation(_indexer_mosaic_run, _indexer_mosaic_unsupported),
    },
    "topk": {
        "reference": Implementation(_reference_run(reference.topk), _never),
        "triton": Implementation(_topk_triton_run, _never),
    },
    "indexer_top_k": {
        "reference": Implementation(_reference_run(reference.indexer_top_k), _never),
        "triton": Implementation(_indexer_top_k_triton_run, _indexer_triton_unsupported),
        "mosaic": Implementation(_indexer_top_k_mosaic_run, _indexer_mosaic_unsupported),
    },
    "grouped_matmul": {
        "reference": Implementation(_reference_run(reference.grouped_matmul), _never),
        "triton": Implementation(_grouped_matmul_triton.grouped_matmul, _grouped_matmul_triton_unsupported),
    },
    "grouped_matmul_fp8": {
        "reference": Implementation(_reference_run(reference.grouped_matmul_fp8), _never),
        "triton": Implementation(_grouped_matmul_triton.grouped_matmul_fp8, _grouped_matmul_fp8_triton_unsupported),
    },
    "grouped_matmul_mxfp4": {
        "reference": Implementation(_reference_run(reference.grouped_matmul_mxfp4), _never),
        "triton": Implementation(_grouped_matmul_mxfp4_triton.grouped_matmul_mxfp4,
                                 _grouped_matmul_mxfp4_triton_unsupported),
    },
    "fp8_gemm": {
        "reference": Implementation(_reference_run(reference.fp8_gemm), _never),
        "triton": Implementation(_fp8_gemm_triton_run, _fp8_gemm_triton_unsupported),
        "mosaic": Implementation(_fp8_gemm_mosaic.fp8_gemm, _fp8_gemm_mosaic_unsupported),
    },
    "sparse_mla_decode": {
        "reference": Implementation(_reference_run(reference.sparse_mla_decode), _never),
        "triton": Implementation(_sparse_mla_triton.sparse_mla_decode, _sparse_mla_triton_unsupported),
        "mosaic": Implementation(_sparse_mla_mosaic_run, _sparse_mla_mosaic_unsupported),
    },
    # A Mosaic GPU (sm_90) kernel would be its "mosaic" row; until then "pallas" runs the Triton kernel.
    "mla_decode": {
        "reference": Implementation(_reference_run(reference.mla_decode), _never),
        "triton": Implementation(_mla_decode_triton.mla_decode, _mla_decode_triton_unsupported),
    },
}


def unsupported(op: str, backend: str, *args, interpret: bool | None = None, **kwargs) -> list[str]:
    """Why `backend` cannot run `op` on these arguments (empty: it can). "pallas" can when mosaic or triton can;
    its reasons are theirs, each prefixed with the backend's name."""
    table = _table(op)
    if backend == "pallas":
        reasons = []
        for name in _PALLAS_ORDER:
            if name not in table:
                continue
            found = table[name].unsupported(*args, interpret=interpret, **kwargs)
            if not found:
                return []
            reasons += [f"{name}: {r}" for r in found]
        return reasons
    if backend not in table:
        return [f"{op} has no {backend!r} implementation (it has {sorted(table)})"]
    return table[backend].unsupported(*args, interpret=interpret, **kwargs)


def choose(op: str, backend: str, *args, interpret: bool | None = None, **kwargs) -> str:
    """The implementation `backend` names for these arguments ("pallas": mosaic where it applies, else triton);
    ValueError with the reasons when it cannot run them."""
    table = _table(op)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    names = [n for n in _PALLAS_ORDER if n in table] if backend == "pallas" else [backend]
    for name in names:
        if name in table and not table[name].unsupported(*args, interpret=interpret, **kwargs):
            return name
    reasons = unsupported(op, backend, *args, interpret=interpret, **kwargs)
    raise ValueError(f"backend={backend!r} cannot run {op} here: " + "; ".join(reasons))


def _table(op: str) -> dict[str, Implementation]:
    if op not in IMPLEMENTATIONS:
        raise ValueError(f"unknown op {op!r}; the ops are {sorted(IMPLEMENTATIONS)}")
    return IMPLEMENTATIONS[op]


def _run(op: str, backend: str, args: tuple, kwargs: dict, interpret, knobs: dict):
    if knobs and backend in ("pallas", "reference"):
        raise TypeError(f"tuning knobs {sorted(knobs)} need an explicit backend ('triton' or 'mosaic'), not "
                        f"{backend!r}")
    name = choose(op, backend, *args, interpret=interpret, **kwargs)
    return IMPLEMENTATIONS[op][name].run(*args, interpret=interpret, **kwargs, **knobs)


def indexer_logits(q, weights, index_cache, block_tables, lens, *, backend="pallas", interpret=None, **knobs):
    """Lightning-indexer logits over a paged index-key cache.

    q [R, I, J] (f32, bf16 or float8_e4m3fn), weights [R, I] f32 with every scale folded in, index_cache
    [pages, B, J] (f32, bf16 or float8_e4m3fn) or `Fp8IndexKeys` of [pages, B, J] e4m3 keys and [pages, B] f32
    per-token scales, block_tables [R, P] int32 page ids (entries past a row's length are never read, may be -1),
    lens [R] int32 local lengths (host-computed, 0 <= lens <= P * B). Returns f32 [R, P*B]:
    `sum_i weights[r,i] * relu(q[r,i] . k_t) * scale[t]` (scale 1 for a plain cache) for t < lens[r], -inf
    elsewhere. Knobs: `_indexer_triton.indexer_logits`, `_indexer_mosaic.indexer_logits`.
    """
    args = (q, weights, index_cache, block_tables, lens)
    _check_indexer_inputs(*args)
    return _run("indexer_logits", backend, args, {}, interpret, knobs)


def topk(scores, lens, *, k, sorted=True, backend="pallas", interpret=None, **knobs):
    """Exact per-row top-k over the first lens[r] columns: values f32 [R, K] (K = k) by score descending, then
    column ascending (column order alone with `sorted=False`), indices int32 [R, K]; short rows pad with (-inf, -1).
    scores [R, T] f32 (columns past lens[r] ignored, may be NaN), lens [R] int32 clipped to [0, T], k a Python int
    >= 1 (k > T allowed). Knobs: `_topk_triton.topk`."""
    _topk_triton.check_inputs(scores, lens, k)
    return _run("topk", backend, (scores, lens), dict(k=k, sorted=sorted), interpret, knobs)


def indexer_top_k(q, weights, index_cache, block_tables, lens, *, k, sorted=True, backend="pallas", interpret=None,
                  **knobs):
    """`topk(indexer_logits(...), lens, k=k, sorted=sorted)`, with the top-k's first pass fused into the Mosaic
    indexer where the shapes allow. Knobs: the indexer's (triton: plus `topk_knobs`, a dict for the top-k)."""
    args = (q, weights, index_cache, block_tables, lens)
    _check_indexer_inputs(*args)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a Python int >= 1; got {k=}")
    return _run("indexer_top_k", backend, args, dict(k=k, sorted=sorted), interpret, knobs)


def sparse_mla_decode(q, kv_cache, slots, counts, sm_scale, *, value_dim=512, backend="pallas", interpret=None,
                      **knobs):
    """Absorbed sparse MLA decode over compacted physical slots.

    q [R, H, C+E] (latent query, value_dim = C wide, then the rope query), kv_cache [pages, B, C+E] bf16 or f32
    (latent then roped key) or an `Fp8LatentCache` (computed as the bf16 cache it holds exactly; out bf16), slots
    [R, K] int32 physical slots `page*B + offset`, valid first, counts [R] int32 (above K act as K), sm_scale a
    Python float. Returns out [R, H, value_dim] in the cache's dtype (bf16 from the Mosaic kernel) and lse f32
    [R, H] (natural log); a row with count <= 0 gives out 0 and lse -inf. Slots past a row's count are never read.
    Knobs: `_sparse_mla_triton.sparse_mla_decode`, `_sparse_mla_mosaic.sparse_mla_decode`.
    """
    _check_sparse_mla_inputs(q, kv_cache, slots, counts, sm_scale, value_dim)
    return _run("sparse_mla_decode", backend, (q, kv_cache, slots, counts, sm_scale), dict(value_dim=value_dim),
                interpret, knobs)


def mla_decode(q, kv_cache, block_tables, lens, sm_scale, *, value_dim=512, backend="pallas", interpret=None,
               **knobs):
    """Absorbed dense MLA decode over one DCP rank's paged local tokens (DeepSeek-V3/R1, Kimi-K2).

    q [M, Y, H, C+E] bf16 or f32 (absorbed MLA query: the latent part, value_dim = C wide, then the rope part; Y
    query rows per sequence: 1 at decode, n + 1 for MTP verify rows or a prefill chunk's tokens), kv_cache
    [pages, B, C+E] bf16 or f32 (latent then roped key) or an `Fp8LatentCache` (FlashMLA's 656-byte fp8 latent
    format, dequantized as `reference.sparse_mla_decode` does), block_tables [M, P] int32 page ids of each
    sequence's local pages (entries past what lens reach are never read, may be -1), lens [M, Y] int32
    host-computed, 0 <= lens <= P*B: query row (m, s) attends local tokens t < lens[m, s], token t at page
    block_tables[m, t // B], offset t % B (causality within a chunk or among MTP rows is expressed only through
    lens), sm_scale a Python float. scores = q . kv over all C+E columns times sm_scale. Returns out f32
    [M, Y, H, value_dim] (softmax-weighted latents: the first value_dim columns of the rows) and lse f32 [M, Y, H]
    (natural log of the sum of exp(scaled scores)); a row with lens 0 gives out 0 and lse -inf.
    Knobs: `_mla_decode_triton.mla_decode`.
    """
    _check_mla_decode_inputs(q, kv_cache, block_tables, lens, sm_scale, value_dim)
    return _run("mla_decode", backend, (q, kv_cache, block_tables, lens, sm_scale), dict(value_dim=value_dim),
                interpret, knobs)


def grouped_matmul(x, w, group_sizes, *, rows_per_group=None, backend="pallas", interpret=None, **knobs):
    """Grouped matmul, an MoE layer's routed experts: x [rows, in] rows sorted by group, w [groups, in, out] (the
    Triton kernel: x's dtype, bf16 or f32; in and out multiples of 16), group_sizes [groups] int32 with sum <= rows.
    Rows offset_g .. offset_g + group_sizes[g] - 1 (offset_g the sizes before g summed) are multiplied by w[g] with
    f32 accumulation; the output [rows, out] in x's dtype, rows past the last group unspecified
    (`jax.lax.ragged_dot`'s contract). The kernel multiplies only the rows each group has: a group of none reads
    none of its weights. rows_per_group: the rows a group averages, which picks the kernel's default tiles (None:
    rows / groups; a caller whose rows include some of no group, as expert parallelism's other ranks' assignments,
    knows better). Knobs: `_grouped_matmul_triton.grouped_matmul`."""
    _check_grouped_matmul_inputs(x, w, group_sizes)
    return _run("grouped_matmul", backend, (x, w, group_sizes), dict(rows_per_group=rows_per_group), interpret, knobs)


def grouped_matmul_fp8(x, x_scales, w, w_scales, group_sizes, *, block, out_dtype, rows_per_group=None,
                       backend="pallas", interpret=None, **knobs):
    """`grouped_matmul` of block-fp8 operands, DeepSeek's fine-grained fp8 GEMM, scale blocks `block` = (bn, bk)
    (HF's weight_block_size): x e4m3 [rows, in] with f32 scales [rows, ceil(in / bk)] (`act_quant`: bk channels of
    a row share one), w e4m3 [groups, out, in] (K-major, the checkpoint's [out, in] per group: fp8 tensor cores
    read both operands so) with f32 scales [groups, ceil(out / bn), ceil(in / bk)] (a [bn, bk] block shares one);
    rows times w[g]^T, each block's product scaled by its row's and its block's scales, f32 accumulation, the
    output [rows, out] in out_dtype; rows_per_group as `grouped_matmul`'s. Knobs:
    `_grouped_matmul_triton.grouped_matmul_fp8`."""
    block = tuple(block)
    _check_grouped_matmul_fp8_inputs(x, x_scales, w, w_scales, group_sizes, block)
    return _run("grouped_matmul_fp8", backend, (x, x_scales, w, w_scales, group_sizes),
                dict(block=block, out_dtype=out_dtype, rows_per_group=rows_per_group), interpret, knobs)


def grouped_matmul_mxfp4(x, w, group_sizes, *, out_dtype, rows_per_group=None, backend="pallas", interpret=None,
                         **knobs):
    """`grouped_matmul` of MXFP4 weights (OCP microscaling fp4 as AMD Quark exports it, e.g. GLM-5.2-MXFP4's routed
    experts): x [rows, in] bf16 or f32, rows sorted by group; w an `Mxfp4Weight` of packed uint8
    [groups, out, in / 2] (two e2m1 codes a byte, input 2i in the low nibble) and scales uint8
    [groups, out, in / 32] (e8m0, one per 32 inputs of a row; the formula: `formats.py`), K-major as the
    checkpoint's [out, in] per expert; group_sizes [groups] int32 with sum <= rows. Rows times w[g]^T, f32
    accumulation, the output [rows, out] in out_dtype, rows past the last group unspecified. The Triton kernel
    reads the weights packed (0.53 bytes a weight) and dequantizes them in registers to x's dtype for the tensor
    cores; it needs out a multiple of 16. rows_per_group as `grouped_matmul`'s. Knobs:
    `_grouped_matmul_mxfp4_triton.grouped_matmul_mxfp4`."""
    _check_grouped_matmul_mxfp4_inputs(x, w, group_sizes)
    return _run("grouped_matmul_mxfp4", backend, (x, w, group_sizes),
                dict(out_dtype=out_dtype, rows_per_group=rows_per_group), interpret, knobs)


def fp8_gemm(x, x_scales, w, w_scales, *, block, out_dtype, backend="pallas", interpret=None, **knobs):
    """DeepSeek's fine-grained fp8 GEMM (a linear layer of block-fp8 weights), scale blocks `block` = (bn, bk) (HF's
    weight_block_size): x e4m3 [rows, in] with f32 scales [rows, ceil(in / bk)] (`act_quant`), w e4m3 [out, in]
    (K-major, the checkpoint's layout) with f32 scales [ceil(out / bn), ceil(in / bk)]; the output
    [rows, out] = x . w^T in out_dtype, each block's product scaled by its row's and its block's scales, f32
    accumulation. block (1, in) is ptpc_fp8's GEMM: one scale a token ([rows, 1]) and a channel ([out, 1]).
    Knobs: `_fp8_gemm_mosaic.fp8_gemm`, `_grouped_matmul_triton.grouped_matmul_fp8` (one group)."""
    block = tuple(block)
    _check_fp8_gemm_inputs(x, x_scales, w, w_scales, block)
    return _run("fp8_gemm", backend, (x, x_scales, w, w_scales), dict(block=block, out_dtype=out_dtype), interpret,
                knobs)
