"""Exact per-row top-k of length-masked scores by radix threshold select (Pallas, Triton backend on GPU).

Contract: scores [R, N] f32, lens [R] int32 (columns at or past lens[r] are ignored and may hold NaN or
garbage; lens are clipped to [0, N]), k a Python int >= 1 (k > N is allowed). Returns values f32 [R, k] and
indices int32 [R, k], ordered by score descending, then column ascending (by column alone with `sorted=False`);
rows with fewer than k valid columns are padded with (-inf, -1). Scores compare by their f32 total order, as
`lax.top_k` does (CPU and H200): -0.0 ranks below 0.0, and a returned value is bit-identical to its score.

Algorithm: three Pallas kernels; f32 scores map to int32 keys whose signed order is the f32 total order. Each
row is cut into S chunks of `chunk` columns (S = `splits`, by default enough to give about 128 programs), so
small batches still fill the GPU's SMs in the two streaming passes:
1. (grid R x S) Column-wise key maxima of each chunk, in tiles of `groups` columns: group g holds columns
   g, g + groups, g + 2 * groups, ...
2. (grid R x S) The maximum over the chunks gives the row's group maxima. The k-th largest group maximum,
   rounded down to its top `coarse_bits` key bits, is a lower bound `floor` of the row's k-th largest key (k
   distinct columns reach it). Each chunk compacts its columns with key >= floor, in column order, into its own
   candidate region of `capacity` entries (prefix-sum positions) and stores their count. Random scores leave
   about groups * ln(groups / (groups - k)) candidates per row (~2.8K at the defaults for k=2048), wherever they
   sit in the row.
3. (grid R) Gather the regions' candidates, in chunk order, into one `capacity` vector; binary-search the exact
   k-th largest key `threshold` over it in registers; when the row has more candidates than `capacity` (many
   ties near the k-th place), over the whole row instead: exact, but 32 streamed passes. Emit every key >
   threshold and the lowest-column ties at threshold up to k, in column order; pad; unless `sorted=False`, sort
   the k emitted pairs (key descending, column ascending): a bitonic network in registers (`sort_in_kernel=True`)
   or one XLA sort of [R, k] afterwards.
Tuning defaults were measured by `bench/bench_topk.py` on an H200 (docs/perf_topk.md). The bitonic network makes
compiles slow (tens of seconds per (R, N) program): precompile the row buckets.
Letters: R rows, N columns, K = k.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._platform import default_interpret

# Key of a column outside the row's length: below every f32 key (the key of -inf is 0x807FFFFF).
INVALID = -(2**31)
# Sort id of a pad slot: after every real column.
_PAD_ID = 2**31 - 1

# The jax-pallas-triton deprecation fires when a jitted caller lowers the kernel, not at the call: filter by text.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)


def _to_key(x):
    """f32 -> int32 whose signed order is the f32 total order (negative floats: flip the 31 low bits)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _from_key(key):
    return lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), jnp.float32)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _load_keys(scores_ref, row, start, size, length):
    """Keys of columns [start, start + size) of one row (INVALID at or past `length`) and their columns."""
    cols = start + lax.broadcasted_iota(jnp.int32, (size,), 0)
    is_valid = cols < length
    scores = plgpu.load(scores_ref.at[row, pl.ds(start, size)], mask=is_valid, other=0.0)
    return jnp.where(is_valid, _to_key(scores), INVALID), cols


def _count(mask):
    return jnp.sum(mask.astype(jnp.int32))


def _scatter(ref, row, dest, value, mask):
    """ref[row, dest] = value where mask. Masked lanes aim past the row, where the interpreter's scatter drops
    them (a lane left at dest -1 would wrap onto the last column); on the GPU they touch no memory."""
    plgpu.store(ref.at[row, jnp.where(mask, dest, ref.shape[1])], value, mask=mask)


def _kth_largest_key(count_at_least, k, num_bits):
    """Largest key t, its low (32 - num_bits) bits zero, with count_at_least(t) >= k; INVALID if there is none.

    The search runs over unsigned keys (key ^ INVALID), setting one bit per step from the top. (Resolving 2 or
    4 bits per step with one count of all digit values measured no faster, and 4 bits 4x slower, on an H200.)
    """
    def step(bit, unsigned):
        trial = unsigned | lax.shift_left(jnp.int32(1), 31 - bit)
        return jnp.where(count_at_least(trial ^ INVALID) >= k, trial, unsigned)

    return lax.fori_loop(0, num_bits, step, jnp.int32(0)) ^ INVALID


def _emit(values_ref, indices_ref, row, keys, cols, threshold, need, taken, ties):
    """Store keys > threshold and the first `need` ties (in the given column order) after `taken` slots.

    `ties` counts the ties already seen in earlier chunks. Returns the updated (taken, ties).
    """
    is_tie = (keys == threshold) & (keys != INVALID)
    tie_rank = ties + jnp.cumsum(is_tie.astype(jnp.int32))
    is_taken = (keys > threshold) | (is_tie & (tie_rank <= need))
    dest = taken + jnp.cumsum(is_taken.astype(jnp.int32)) - 1
    _scatter(values_ref, row, dest, _from_key(keys), is_taken)
    _scatter(indices_ref, row, dest, cols, is_taken)
    return taken + _count(is_taken), ties + _count(is_tie)


def _sort_pairs(keys, ids):
    """Bitonic sort of [n] pairs (n a power of two): key descending, then id ascending.

    The pairs live in a [2] * log2(n) view, so a compare-exchange of position i with i ^ 2**b works along one
    axis: the partner is (sum over that axis - self), exact in wrapping int32, since Triton-Pallas has no
    register shuffles. No reshapes between the log2(n) * (log2(n) + 1) / 2 stages.
    """
    n = keys.shape[0]
    bits = n.bit_length() - 1
    if bits == 0:
        return keys, ids
    shape = (2,) * bits
    keys, ids = keys.reshape(shape), ids.reshape(shape)

    def bit_is_zero(bit):  # bit `bit` of each position (axis bits - 1 - bit holds it)
        return lax.broadcasted_iota(jnp.int32, shape, bits - 1 - bit) == 0

    for size_bit in range(1, bits + 1):
        # Blocks of 2**size_bit sort descending where that bit of the position is 0 (always, at the last size).
        is_descending = bit_is_zero(size_bit) if size_bit < bits else True
        for stride_bit in reversed(range(size_bit)):
            axis = bits - 1 - stride_bit
            other_keys = jnp.sum(keys, axis=axis, keepdims=True) - keys
            other_ids = jnp.sum(ids, axis=axis, keepdims=True) - ids
            is_better = (keys > other_keys) | ((keys == other_keys) & (ids < other_ids))
            # The left slot of a descending pair (the right one of an ascending pair) keeps the better pair.
            keeps_self = is_better == (bit_is_zero(stride_bit) == is_descending)
            keys = jnp.where(keeps_self, keys, other_keys)
            ids = jnp.where(keeps_self, ids, other_ids)
    return keys.reshape(n), ids.reshape(n)


def _chunk_bounds(length, chunk: int):
    """Columns [begin, end) of this program's chunk that lie inside the row's length."""
    begin = pl.program_id(1) * chunk
    return begin, jnp.clip(length - begin, 0, chunk) + begin


def _chunk_maxima_kernel(scores_ref, lens_ref, maxima_ref, *, groups: int, chunk: int):
    """Step 1 for one (row, chunk): maxima_ref[row, chunk * groups + g] = max key of group g in the chunk."""
    row, part = pl.program_id(0), pl.program_id(1)
    begin, end = _chunk_bounds(jnp.clip(lens_ref[row], 0, scores_ref.shape[1]), chunk)

    def max_step(i, maxima):
        return jnp.maximum(maxima, _load_keys(scores_ref, row, begin + i * groups, groups, end)[0])

    maxima = lax.fori_loop(0, pl.cdiv(end - begin, groups), max_step, jnp.full((groups,), INVALID, jnp.int32))
    plgpu.store(maxima_ref.at[row, pl.ds(part * groups, groups)], maxima)


def _chunk_candidates_kernel(scores_ref, lens_ref, maxima_ref,             # inputs
                             cand_keys_ref, cand_cols_ref, counts_ref,      # outputs
                             *, k: int, groups: int, tile: int, chunk: int, splits: int, capacity: int,
                             coarse_bits: int):
    """Step 2 for one (row, chunk): its candidates (key >= floor) into the chunk's region of the candidate buffers,
    in column order, and their number (which may exceed `capacity`; only `capacity` are stored)."""
    row, part = pl.program_id(0), pl.program_id(1)
    begin, end = _chunk_bounds(jnp.clip(lens_ref[row], 0, scores_ref.shape[1]), chunk)
    maxima = plgpu.load(maxima_ref.at[row, pl.ds(0, groups)])
    for other in range(1, splits):  # the row's maxima: over its chunks' (an XLA reduce here took up to 630 us)
        maxima = jnp.maximum(maxima, plgpu.load(maxima_ref.at[row, pl.ds(other * groups, groups)]))
    floor = _kth_largest_key(lambda t: _count(maxima >= t), k, coarse_bits)
    region = part * capacity

    def compact_step(i, count):
        keys, cols = _load_keys(scores_ref, row, begin + i * tile, tile, end)
        is_candidate = (keys >= floor) & (keys != INVALID)
        dest = count + jnp.cumsum(is_candidate.astype(jnp.int32)) - 1
        is_stored = is_candidate & (dest < capacity)
        _scatter(cand_keys_ref, row, region + dest, keys, is_stored)
        _scatter(cand_cols_ref, row, region + dest, cols, is_stored)
        return count + _count(is_candidate)

    counts_ref[row, part] = lax.fori_loop(0, pl.cdiv(end - begin, tile), compact_step, jnp.int32(0))


def _select_kernel(scores_ref, lens_ref, cand_keys_ref, cand_cols_ref, counts_ref,  # inputs
                   values_ref, indices_ref,                                          # outputs
                   *, k: int, tile: int, splits: int, capacity: int, sort_in_kernel: bool, interpret: bool):
    """Step 3 for one row: exact threshold, emission in column order, padding, and the final order."""
    row = pl.program_id(0)
    length = jnp.clip(lens_ref[row], 0, scores_ref.shape[1])
    num_tiles = pl.cdiv(length, tile)

    # Slot j of the row's candidate vector is entry j - starts[c] of region c, for the c with starts[c] <= j.
    slot = lax.broadcasted_iota(jnp.int32, (capacity,), 0)
    region_offset = jnp.zeros((capacity,), jnp.int32)
    total = jnp.int32(0)
    for part in range(splits):
        region_offset = jnp.where(slot >= total, part * capacity - total, region_offset)
        total = total + counts_ref[row, part]
    fits = total <= capacity
    is_loaded = slot < jnp.where(fits, total, 0)
    source = jnp.where(is_loaded, slot + region_offset, 0)
    cand_keys = plgpu.load(cand_keys_ref.at[row, source], mask=is_loaded, other=INVALID)
    cand_cols = plgpu.load(cand_cols_ref.at[row, source], mask=is_loaded, other=0)
    row_tiles = jnp.where(fits, 0, num_tiles)

    def count_at_least(t):
        def row_step(i, count):
            keys, _ = _load_keys(scores_ref, row, i * tile, tile, length)
            return count + _count(keys >= t)

        return lax.fori_loop(0, row_tiles, row_step, _count(cand_keys >= t))

    threshold = _kth_largest_key(count_at_least, k, 32)
    # A valid threshold has no INVALID keys above it; an INVALID one means every valid column is taken.
    need = k - count_at_least(threshold + 1)

    # Emit in column order, then pad the rest of the row.
    taken, ties = _emit(values_ref, indices_ref, row, cand_keys, cand_cols, threshold, need, 0, 0)

    def emit_step(i, carry):
        keys, cols = _load_keys(scores_ref, row, i * tile, tile, length)
        return _emit(values_ref, indices_ref, row, keys, cols, threshold, need, *carry)

    taken, _ = lax.fori_loop(0, row_tiles, emit_step, (taken, ties))
    width = _next_pow2(k)
    out_slot = lax.broadcasted_iota(jnp.int32, (width,), 0)
    is_pad = (out_slot >= taken) & (out_slot < k)
    plgpu.store(values_ref.at[row, pl.ds(0, width)], jnp.full((width,), -jnp.inf, jnp.float32), mask=is_pad)
    plgpu.store(indices_ref.at[row, pl.ds(0, width)], jnp.full((width,), -1, jnp.int32), mask=is_pad)
    if not sort_in_kernel:
        return

    # Bitonic sort of the emitted row in registers.
    if not interpret:  # the interpreter runs a program's stores and loads in order
        plgpu.debug_barrier()  # other threads of this program wrote the slots read next
    is_out = out_slot < k
    values = plgpu.load(values_ref.at[row, pl.ds(0, width)], mask=is_out, other=-jnp.inf)
    ids = plgpu.load(indices_ref.at[row, pl.ds(0, width)], mask=is_out, other=-1)
    keys, ids = _sort_pairs(_to_key(values), jnp.where(ids < 0, _PAD_ID, ids))
    plgpu.store(values_ref.at[row, pl.ds(0, width)], _from_key(keys), mask=is_out)
    plgpu.store(indices_ref.at[row, pl.ds(0, width)], jnp.where(ids == _PAD_ID, -1, ids), mask=is_out)


def sort_rows(values, indices):
    """Order each row by value descending (f32 total order), then index ascending, -1 last."""
    keys = _to_key(values)
    ids = jnp.where(indices < 0, _PAD_ID, indices)
    neg_keys, ids = lax.sort((~keys, ids), dimension=1, num_keys=2)
    return _from_key(~neg_keys), jnp.where(ids == _PAD_ID, -1, ids)


def _check_inputs(scores, lens, k):
    if scores.ndim != 2 or scores.dtype != jnp.float32:
        raise ValueError(f"scores must be f32 [R, N]; got {scores.shape=} {scores.dtype=}")
    if lens.shape != scores.shape[:1] or lens.dtype != jnp.int32:
        raise ValueError(f"lens must be int32 [R]; got {lens.shape=} {lens.dtype=} for {scores.shape=}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a Python int >= 1; got {k=}")
    if scores.shape[1] < 1 or scores.shape[1] >= 2**31 - 1:
        raise ValueError(f"scores needs 1 <= N < 2**31 - 1 columns; got {scores.shape=}")


def _check_knobs(**knobs):
    if knobs["splits"] is not None and (not isinstance(knobs["splits"], int) or knobs["splits"] < 1
                                        or knobs["splits"] & (knobs["splits"] - 1)):
        raise ValueError(f"splits must be None or a power of two; got {knobs['splits']}")
    for name in ("num_groups", "tile", "capacity"):
        if knobs[name] < 1 or knobs[name] & (knobs[name] - 1):
            raise ValueError(f"{name} must be a power of two (a Triton block size); got {knobs[name]}")
    if not 1 <= knobs["coarse_bits"] <= 32:
        raise ValueError(f"coarse_bits must be in [1, 32]; got {knobs['coarse_bits']}")


# Programs per streaming pass that `splits=None` aims for (the H200 has 132 SMs).
TARGET_PROGRAMS = 128


def topk(scores, lens, k, *, sorted=True, interpret=None, num_groups=4096, tile=4096, capacity=4096,
         coarse_bits=16, splits=None, sort_in_kernel=True, num_warps=16, select_warps=None, num_stages=1):
    """Top-k per row: values f32 [R, k] descending (ties: lower column first), indices int32 [R, k].

    scores [R, N] f32, lens [R] int32 (clipped to [0, N]; columns past it ignored). Rows with fewer than k valid
    columns pad with (-inf, -1). `sorted=False` returns the same k entries in column order instead (no final
    sort; for callers that merge or sort again). See the module docstring for the algorithm and the knobs;
    `num_groups` and `capacity` are raised to k's next power of two when smaller, `num_groups` capped at N's;
    `splits` (chunks per row, a power of two; None: about TARGET_PROGRAMS / R) is capped so that chunks span
    whole tiles; `select_warps` sets the warps of the per-row select kernel alone (None: num_warps with the
    in-kernel bitonic network, which gains from more threads, else 8, measured faster there).
    """
    _check_inputs(scores, lens, k)
    _check_knobs(num_groups=num_groups, tile=tile, capacity=capacity, coarse_bits=coarse_bits, splits=splits)
    if select_warps is not None and (not isinstance(select_warps, int) or select_warps < 1
                                     or select_warps & (select_warps - 1)):
        raise ValueError(f"select_warps must be None or a power of two; got {select_warps}")
    interpret = default_interpret(interpret)
    rows, cols = scores.shape
    width = _next_pow2(k)
    groups = max(width, min(num_groups, _next_pow2(cols)))
    capacity = max(width, capacity)
    tile = min(tile, _next_pow2(cols))
    step = max(groups, tile)  # a chunk spans whole tiles of both passes, so group g is the same in every chunk
    if splits is None:
        splits = _next_pow2(max(1, TARGET_PROGRAMS // rows) + 1) // 2  # largest power of two <= the target
    splits = max(1, min(splits, pl.cdiv(cols, step)))
    chunk = pl.cdiv(pl.cdiv(cols, splits), step) * step
    splits = pl.cdiv(cols, chunk)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    name = f"{k=}_{groups=}_{tile=}_{capacity=}_{splits=}"

    maxima = pl.pallas_call(
        functools.partial(_chunk_maxima_kernel, groups=groups, chunk=chunk),
        out_shape=jax.ShapeDtypeStruct((rows, splits * groups), jnp.int32),
        grid=(rows, splits), compiler_params=params, interpret=interpret, name=f"topk_maxima_{name}",
    )(scores, lens)
    cand_keys, cand_cols, counts = pl.pallas_call(
        functools.partial(_chunk_candidates_kernel, k=k, groups=groups, tile=tile, chunk=chunk, splits=splits,
                          capacity=capacity, coarse_bits=coarse_bits),
        out_shape=(
            jax.ShapeDtypeStruct((rows, splits * capacity), jnp.int32),
            jax.ShapeDtypeStruct((rows, splits * capacity), jnp.int32),
            jax.ShapeDtypeStruct((rows, splits), jnp.int32),
        ),
        grid=(rows, splits), compiler_params=params, interpret=interpret, name=f"topk_candidates_{name}",
    )(scores, lens, maxima)
    values, indices = pl.pallas_call(
        functools.partial(_select_kernel, k=k, tile=tile, splits=splits, capacity=capacity,
                          sort_in_kernel=sorted and sort_in_kernel, interpret=interpret),
        out_shape=(
            jax.ShapeDtypeStruct((rows, k), jnp.float32),
            jax.ShapeDtypeStruct((rows, k), jnp.int32),
        ),
        grid=(rows,), interpret=interpret, name=f"topk_select_{name}",
        compiler_params=plgpu.CompilerParams(
            num_warps=select_warps or (num_warps if sorted and sort_in_kernel else 8), num_stages=num_stages),
    )(scores, lens, cand_keys, cand_cols, counts)
    if sorted and not sort_in_kernel:
        values, indices = sort_rows(values, indices)
    return values, indices
