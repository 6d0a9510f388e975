"""Exact per-row top-k of length-masked scores by radix threshold select: the Triton kernel.

Contract (`pallas_kernels.topk`; here k is positional): scores [R, T] f32, lens [R] int32 (columns at or past
lens[r] are ignored and may hold NaN or garbage; lens are clipped to [0, T]), k a Python int >= 1 (k > T is
allowed). Returns values f32 [R, K] and indices int32 [R, K], ordered by score descending, then column ascending
(by column alone with `sorted=False`);
rows with fewer than k valid columns are padded with (-inf, -1). Scores compare by their f32 total order, as
`lax.top_k` does (CPU and H200): -0.0 ranks below 0.0, and a returned value is bit-identical to its score.

Algorithm: three Pallas kernels (four with `separate_floor`); f32 scores map to int32 keys whose signed order is
the f32 total order. Group g of a row holds its columns g, g + groups, g + 2 * groups, ... Both streaming passes
split each row over several programs (by default about 512 and 256 programs in all), so small batches still
fill the GPU's SMs:
1. (grid R x splits) Group maxima: each program owns groups / splits of the row's groups and walks the whole
   row, loading that slice of every `groups` columns. (Or the caller passes them: `group_maxima`, any grouping.)
2. The k-th largest group maximum, rounded down to its top `coarse_bits` key bits, is a lower bound `floor` of
   the row's k-th largest key (k distinct columns reach it). Random scores leave about
   groups * ln(groups / (groups - k)) keys >= floor per row (~2.8K at the defaults for k=2048), wherever they
   sit in the row (a little more, from the rounding). Every program of step 3 finds it (`coarse_bits` CTA-wide
   counts over the maxima), or one kernel per row.
3. (grid R x candidate_splits) Each program compacts the columns of its chunk with key >= floor (the
   candidates), in column order, into its own region of `capacity` entries (prefix-sum positions) and stores
   their count.
4. (grid R) Gather the regions' candidate columns, in chunk order, into one `capacity` vector and load their
   scores again (at R = 64 on an H200, cheaper than storing their keys in step 3); binary-search the exact
   k-th largest key `threshold` over it in registers, bit by bit from the top, until at most BUCKET_SLOTS
   candidates lie between the bounds found so far; gather those and search the last bits in each warp, with no
   barrier. When the row has more candidates than `capacity` (many ties near the k-th place), search the whole
   row instead: exact, but 32 streamed passes. Emit every key > threshold and the lowest-column ties at
   threshold up to k, in column order; pad; unless `sorted=False`, sort the k emitted pairs (key descending,
   column ascending): a bitonic network in registers (`sort_in_kernel=True`) or one XLA sort of [R, K]
   afterwards.
Tuning defaults were measured by `bench/bench_topk.py` on an H200 (docs/perf_topk.md, "Threshold search in buckets,
maxima pass at 512 programs" and "How the kernel got its shape"). The bitonic network makes
compiles slow (tens of seconds per (R, T) program): precompile the row buckets.
Letters: see the legend in `dcp_jax/__init__.py`; T the scored columns of a row (key positions), K = k.
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
# Candidates that the select's last search steps gather and count warp by warp.
BUCKET_SLOTS = 128

# The jax-pallas-triton deprecation fires when a jitted caller lowers the kernel, not at the call: filter by text.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)


def _to_key(x):
    """f32 -> int32 whose signed order is the f32 total order (negative floats: flip the 31 low bits)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _from_key(key):
    return lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), jnp.float32)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# Tiles are laid out as [size // RUN, RUN] runs: entry [j, i] is position RUN * j + i. Triton gives each thread
# whole runs (one 16-byte load of 4 keys), and a scatter's one-entry-per-thread layout owns the same entries, so
# nothing moves through shared memory and prefix sums run along the runs in registers, with one cross-thread scan
# over the run totals. (A flat [size] tile got the vectorized load and the scatter different owners: Triton
# converted masks, keys and pointers through shared memory and ran each prefix sum twice; the compaction pass ran
# at 0.7 TB/s on an H200.)
RUN = 4


def _run_iota(size):
    """Positions [size // RUN, RUN] of a runs tile, and the first position of each entry's run."""
    run = min(RUN, size)
    shape = (size // run, run)
    run_start = run * lax.broadcasted_iota(jnp.int32, shape, 0)
    return run_start + lax.broadcasted_iota(jnp.int32, shape, 1), run_start


def _load_keys(scores_ref, row, start, size, length):
    """Keys of columns [start, start + size) of one row (INVALID at or past `length`) and their columns, as
    [size // RUN, RUN] runs."""
    offsets, run_offsets = _run_iota(size)
    cols = start + offsets
    is_valid = cols < length
    # When runs tile the row exactly, a run that starts inside the length is loaded whole (one 16-byte load; the
    # columns past the length are masked below), since a mask must be uniform over a vector load.
    whole_runs = scores_ref.shape[1] % offsets.shape[1] == 0
    is_loaded = start + run_offsets < length if whole_runs else is_valid
    scores = plgpu.load(scores_ref.at[row, cols], mask=is_loaded, other=0.0)
    return jnp.where(is_valid, _to_key(scores), INVALID), cols


def _ranks(mask):
    """Rank of each masked entry of a runs tile among the masked entries, in position order, and their number."""
    flags = mask.astype(jnp.int32)
    run_counts = jnp.sum(flags, axis=1)
    run_starts = jnp.cumsum(run_counts) - run_counts
    return run_starts[:, None] + jnp.cumsum(flags, axis=1) - 1, jnp.sum(run_counts)


def _count(mask):
    return jnp.sum(mask.astype(jnp.int32))


def _scatter(ref, row, dest, value, mask, interpret: bool):
    """ref[row, dest] = value where mask. On the GPU masked lanes touch no memory; the interpreter scatters every
    lane, so there they aim past the row, where its scatter drops them (a lane at dest -1 would wrap onto the
    last column, one at a taken slot would race with the lane that owns it)."""
    if interpret:
        dest = jnp.where(mask, dest, ref.shape[1])
    plgpu.store(ref.at[row, dest], value, mask=mask)


def _kth_largest_key(count_at_least, k, num_bits):
    """Largest key t, its low (32 - num_bits) bits zero, with count_at_least(t) >= k; INVALID if there is none.

    The search runs over unsigned keys (key ^ INVALID), setting one bit per step from the top. (Resolving 2 or
    4 bits per step with one count of all digit values, or about 1.6 with two trial keys counted in one packed
    reduction, measured no faster on an H200: a step costs its instructions as well as its reduction.)
    """
    def step(bit, unsigned):
        trial = unsigned | lax.shift_left(jnp.int32(1), 31 - bit)
        return jnp.where(count_at_least(trial ^ INVALID) >= k, trial, unsigned)

    return lax.fori_loop(0, num_bits, step, jnp.int32(0)) ^ INVALID


def _emit(values_ref, indices_ref, row, keys, cols, threshold, need, taken, ties, interpret):
    """Store keys > threshold and the first `need` ties (in position order of the runs tile) after `taken` slots.

    `ties` counts the ties already seen in earlier chunks. Returns the updated (taken, ties).
    """
    is_tie = (keys == threshold) & (keys != INVALID)
    tie_rank, num_ties = _ranks(is_tie)
    is_taken = (keys > threshold) | (is_tie & (ties + tie_rank < need))
    rank, num_taken = _ranks(is_taken)
    _scatter(values_ref, row, taken + rank, _from_key(keys), is_taken, interpret)
    _scatter(indices_ref, row, taken + rank, cols, is_taken, interpret)
    return taken + num_taken, ties + num_ties


def _sort_pairs(keys, ids):
    """Bitonic sort of [pairs] pairs (a power of two of them): key descending, then id ascending.

    The pairs live in a [2] * log2(pairs) view, so a compare-exchange of position i with i ^ 2**b works along one
    axis: the partner is (sum over that axis - self), exact in wrapping int32, since Triton-Pallas has no
    register shuffles. No reshapes between the log2(pairs) * (log2(pairs) + 1) / 2 stages.
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


def _maxima_kernel(scores_ref, lens_ref, maxima_ref, *, groups: int, size: int, unroll: int):
    """Step 1 for one (row, part): maxima_ref[row, g] = max key of group g, for the part's `size` groups.

    Each step loads `unroll` slices (one per `groups` columns) before reducing them, to keep more loads in flight.
    """
    row, part = pl.program_id(0), pl.program_id(1)
    length = jnp.clip(lens_ref[row], 0, scores_ref.shape[1])
    offsets, _ = _run_iota(size)
    first = part * size

    def max_step(i, maxima):
        slices = [_load_keys(scores_ref, row, (i * unroll + u) * groups + first, size, length)[0]
                  for u in range(unroll)]
        return functools.reduce(jnp.maximum, slices, maxima)

    steps = pl.cdiv(pl.cdiv(length, groups), unroll)
    maxima = lax.fori_loop(0, steps, max_step, jnp.full(offsets.shape, INVALID, jnp.int32))
    plgpu.store(maxima_ref.at[row, first + offsets], maxima)


def _row_floor(maxima_ref, row, *, k: int, groups: int, coarse_bits: int):
    """The k-th largest of the row's group maxima, rounded down to its top `coarse_bits` bits: the floor."""
    offsets, _ = _run_iota(groups)
    maxima = plgpu.load(maxima_ref.at[row, offsets])
    return _kth_largest_key(lambda t: _count(maxima >= t), k, coarse_bits)


def _floor_kernel(maxima_ref, floor_ref, **floor_args):
    """Step 2 for one row."""
    row = pl.program_id(0)
    floor_ref[row] = _row_floor(maxima_ref, row, **floor_args)


def _chunk_candidates_kernel(scores_ref, lens_ref, floor_ref,   # inputs
                             cand_cols_ref, counts_ref,           # outputs
                             *, tile: int, chunk: int, capacity: int, floor_args, interpret: bool):
    """Step 3 for one (row, chunk): the columns of its candidates (key >= floor) into the chunk's region of
    `capacity` entries, in column order, and their number (which may exceed `capacity`; only `capacity` are
    stored). With `floor_args`, floor_ref holds the maxima and the program computes the floor itself (step 2).
    Tiles inside the length load without masks and, when the floor is non-negative, compare raw f32 bits (a key
    >= floor >= 0 is the bits of a non-negative float); the last tile is masked. (Storing the candidates' keys
    as well, a second scatter and 92-112 registers instead of 80, cost this kernel more on an H200 than step 4
    spends loading their scores again.)"""
    row, part = pl.program_id(0), pl.program_id(1)
    begin, end = _chunk_bounds(jnp.clip(lens_ref[row], 0, scores_ref.shape[1]), chunk)
    floor = floor_ref[row] if floor_args is None else _row_floor(floor_ref, row, **floor_args)
    floor = jnp.maximum(floor, INVALID + 1)  # keys past the length are never candidates
    region = part * capacity

    def compact(keys, cols, count):
        is_candidate = keys >= floor
        rank, num_candidates = _ranks(is_candidate)
        dest = count + rank
        _scatter(cand_cols_ref, row, region + dest, cols, is_candidate & (dest < capacity), interpret)
        return count + num_candidates

    def inner_step(i, count, *, nonnegative_floor):
        offsets, _ = _run_iota(tile)
        cols = begin + i * tile + offsets
        bits = lax.bitcast_convert_type(plgpu.load(scores_ref.at[row, cols]), jnp.int32)
        keys = bits if nonnegative_floor else _to_key(lax.bitcast_convert_type(bits, jnp.float32))
        return compact(keys, cols, count)

    def masked_step(i, count):
        return compact(*_load_keys(scores_ref, row, begin + i * tile, tile, end), count)

    inner_tiles = lax.div(end - begin, tile)
    count = lax.cond(
        floor >= 0,
        lambda: lax.fori_loop(0, inner_tiles, functools.partial(inner_step, nonnegative_floor=True), jnp.int32(0)),
        lambda: lax.fori_loop(0, inner_tiles, functools.partial(inner_step, nonnegative_floor=False), jnp.int32(0)))
    counts_ref[row, part] = lax.fori_loop(inner_tiles, pl.cdiv(end - begin, tile), masked_step, count)


def _select_kernel(scores_ref, lens_ref, cand_cols_ref, counts_ref,  # inputs
                   values_ref, indices_ref, bucket_ref,               # outputs (bucket_ref: scratch)
                   *, k: int, tile: int, splits: int, capacity: int, warps: int, sort_in_kernel: bool,
                   interpret: bool):
    """Step 4 for one row: exact threshold, emission in column order, padding, and the final order."""
    row = pl.program_id(0)
    length = jnp.clip(lens_ref[row], 0, scores_ref.shape[1])
    num_tiles = pl.cdiv(length, tile)

    # Slot j of the row's candidate vector is entry j - starts[c] of region c, for the c with starts[c] <= j.
    slot, _ = _run_iota(capacity)
    region_offset = jnp.zeros_like(slot)
    total = jnp.int32(0)
    for part in range(splits):
        region_offset = jnp.where(slot >= total, part * capacity - total, region_offset)
        total = total + counts_ref[row, part]
    fits = total <= capacity
    is_loaded = slot < jnp.where(fits, total, 0)
    source = jnp.where(is_loaded, slot + region_offset, 0)
    cand_cols = plgpu.load(cand_cols_ref.at[row, source], mask=is_loaded, other=0)
    cand_keys = jnp.where(is_loaded, _to_key(plgpu.load(scores_ref.at[row, cand_cols], mask=is_loaded, other=0.0)),
                          INVALID)
    row_tiles = jnp.where(fits, 0, num_tiles)

    def count_at_least(t):
        def row_step(i, count):
            keys, _ = _load_keys(scores_ref, row, i * tile, tile, length)
            return count + _count(keys >= t)

        return lax.fori_loop(0, row_tiles, row_step, _count(cand_keys >= t))

    # Bisect the threshold's bits from the top over every candidate while more than BUCKET_SLOTS candidates can
    # still hold it (the bucket: keys between the bounds found so far, by the counts at them); then its remaining
    # bits over just those, gathered into a tile that each warp counts alone, without barriers. (When the
    # candidates do not fit, the row is bisected to the last bit.)
    def bisect_step(carry):
        bit, unsigned, count_low, count_high = carry
        trial = unsigned | lax.shift_left(jnp.int32(1), 31 - bit)
        count = count_at_least(trial ^ INVALID)
        is_raised = count >= k
        return (bit + 1, jnp.where(is_raised, trial, unsigned), jnp.where(is_raised, count, count_low),
                jnp.where(is_raised, count_high, count))

    def is_wide(carry):
        bit, _, count_low, count_high = carry
        return (bit < 32) & (~fits | (count_low - count_high > BUCKET_SLOTS))

    # count_low / count_high: keys >= the bucket's lowest key / above its highest.
    bit, prefix, count_low, count_high = lax.while_loop(
        is_wide, bisect_step, (jnp.int32(0), jnp.int32(0), jnp.int32(capacity), jnp.int32(0)))
    num_in_bucket = count_low - count_high

    def bucket_search():
        low_bits = jnp.where(bit < 32, lax.shift_right_logical(jnp.int32(-1), jnp.minimum(bit, 31)), 0)
        is_in_bucket = (cand_keys >= (prefix ^ INVALID)) & (cand_keys <= ((prefix | low_bits) ^ INVALID))
        rank, _ = _ranks(is_in_bucket)
        _scatter(bucket_ref, row, rank, cand_keys, is_in_bucket, interpret)
        if not interpret:  # the interpreter runs a program's stores and loads in order
            plgpu.debug_barrier()  # other threads of this program wrote the slots read next
        # Every warp loads its own copy of the bucket, a row of [warps, BUCKET_SLOTS], and searches it with its
        # own copy of the key, so no count crosses a warp.
        slots = lax.broadcasted_iota(jnp.int32, (warps, BUCKET_SLOTS), 1)
        bucket = plgpu.load(bucket_ref.at[row, slots], mask=slots < num_in_bucket, other=INVALID)

        def count_per_warp(is_counted):
            return jnp.sum(is_counted.astype(jnp.int32), axis=1)

        def step(i, unsigned):
            trial = unsigned | lax.shift_left(jnp.int32(1), 31 - i)
            is_at_least = bucket >= (trial ^ INVALID)[:, None]
            return jnp.where(count_high + count_per_warp(is_at_least) >= k, trial, unsigned)

        thresholds = lax.fori_loop(bit, 32, step, jnp.full((warps,), prefix)) ^ INVALID
        num_above = count_high + count_per_warp(bucket > thresholds[:, None])
        return jnp.max(thresholds), jnp.max(num_above)  # equal copies

    threshold, num_above = lax.cond(
        fits & (num_in_bucket <= BUCKET_SLOTS), bucket_search, lambda: (prefix ^ INVALID, count_high))
    # A valid threshold has no INVALID keys above it; an INVALID one means every valid column is taken.
    need = k - num_above

    # Emit in column order, then pad the rest of the row.
    taken, ties = _emit(values_ref, indices_ref, row, cand_keys, cand_cols, threshold, need, 0, 0, interpret)

    def emit_step(i, carry):
        keys, cols = _load_keys(scores_ref, row, i * tile, tile, length)
        return _emit(values_ref, indices_ref, row, keys, cols, threshold, need, *carry, interpret)

    taken, _ = lax.fori_loop(0, row_tiles, emit_step, (taken, ties))
    width = next_pow2(k)
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


def check_inputs(scores, lens, k):
    """ValueError unless scores [R, T] f32, lens [R] int32 and k a Python int >= 1."""
    if scores.ndim != 2 or scores.dtype != jnp.float32:
        raise ValueError(f"scores must be f32 [R, N]; got {scores.shape=} {scores.dtype=}")
    if lens.shape != scores.shape[:1] or lens.dtype != jnp.int32:
        raise ValueError(f"lens must be int32 [R]; got {lens.shape=} {lens.dtype=} for {scores.shape=}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a Python int >= 1; got {k=}")
    if scores.shape[1] < 1 or scores.shape[1] >= 2**31 - 1:
        raise ValueError(f"scores needs 1 <= N < 2**31 - 1 columns; got {scores.shape=}")


def _check_group_maxima(group_maxima, rows, width):
    if (group_maxima.ndim != 2 or group_maxima.shape[0] != rows or group_maxima.dtype != jnp.int32
            or not _is_pow2(group_maxima.shape[1]) or group_maxima.shape[1] < width):
        raise ValueError(f"group_maxima must be int32 [R={rows}, G], G a power of two >= {width}; got "
                         f"{group_maxima.shape=} {group_maxima.dtype=}")


def _is_pow2(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and not n & (n - 1)


def _check_knobs(**knobs):
    for name in ("splits", "candidate_splits", "floor_warps", "candidate_warps", "select_warps"):
        if knobs[name] is not None and not _is_pow2(knobs[name]):
            raise ValueError(f"{name} must be None or a power of two; got {knobs[name]}")
    for name in ("num_groups", "tile", "capacity", "num_warps", "maxima_unroll"):
        if not _is_pow2(knobs[name]):
            raise ValueError(f"{name} must be a power of two (a Triton block size); got {knobs[name]}")
    if not 1 <= knobs["coarse_bits"] <= 32:
        raise ValueError(f"coarse_bits must be in [1, 32]; got {knobs['coarse_bits']}")


# Programs that `candidate_splits=None` / `splits=None` aim for in the candidates / maxima pass (the H200 has
# 132 SMs and runs two 8-warp candidates programs at once; the maxima pass measured faster with 512 than 256).
TARGET_PROGRAMS = 256
MAXIMA_TARGET_PROGRAMS = 512


def _default_splits(rows: int, splits, target: int = TARGET_PROGRAMS):
    """splits, or (None) the largest power of two <= target / rows."""
    return next_pow2(max(1, target // rows) + 1) // 2 if splits is None else splits


def _chunking(rows: int, cols: int, splits, tile: int):
    """(chunk, splits) of the candidates pass: chunks per row, capped so that each chunk spans whole tiles, and
    the chunk width."""
    splits = max(1, min(_default_splits(rows, splits), pl.cdiv(cols, tile)))
    chunk = pl.cdiv(pl.cdiv(cols, splits), tile) * tile
    return chunk, pl.cdiv(cols, chunk)


def topk(scores, lens, k, *, sorted=True, interpret=None, num_groups=4096, tile=4096, capacity=4096,
         coarse_bits=14, splits=None, candidate_splits=None, sort_in_kernel=True, num_warps=8,
         floor_warps=None, candidate_warps=None, select_warps=None, num_stages=1, maxima_unroll=16,
         separate_floor=False, group_maxima=None):
    """Top-k per row: values f32 [R, K] descending (ties: lower column first), indices int32 [R, K] (K = k).

    scores [R, T] f32, lens [R] int32 (clipped to [0, T]; columns past it ignored). Rows with fewer than k valid
    columns pad with (-inf, -1). `sorted=False` returns the same k entries in column order instead (no final
    sort; for callers that merge or sort again). See the module docstring for the algorithm and the knobs;
    `num_groups` and `capacity` are raised to k's next power of two when smaller, `num_groups` capped at T's.
    `splits`: programs per row of the maxima pass, each owning groups // splits groups (a power of two; None:
    about MAXIMA_TARGET_PROGRAMS / R, capped at groups / 4); `maxima_unroll` slices of a program's groups are
    loaded per step; `candidate_splits`: chunks per row of the candidates pass (a power of two; None: about
    TARGET_PROGRAMS / R), capped so that chunks span whole tiles; `separate_floor=True` finds each row's floor
    in a kernel of its own instead of in every candidates program. Warps: `num_warps` for the maxima pass;
    `floor_warps` and `candidate_warps` (None: num_warps) for the floor and candidates kernels; `select_warps`
    for the per-row select kernel (None: 16 with the in-kernel bitonic network, which gains from more threads,
    else 8).
    `group_maxima` int32 [R, groups] (optional; groups a power of two >= k): step 1's result computed elsewhere
    (by the Mosaic indexer), the keys (`_to_key`) of the largest valid score of each of the groups partitioning
    each row's valid columns, any grouping; an entry may be lower than its group's largest key (the result stays
    exact; the candidates grow), never higher. Given it, the maxima pass is skipped and `num_groups` is unused.
    """
    check_inputs(scores, lens, k)
    _check_knobs(num_groups=num_groups, tile=tile, capacity=capacity, coarse_bits=coarse_bits, splits=splits,
                 candidate_splits=candidate_splits, num_warps=num_warps, floor_warps=floor_warps,
                 candidate_warps=candidate_warps, select_warps=select_warps, maxima_unroll=maxima_unroll)
    interpret = default_interpret(interpret)
    rows, cols = scores.shape
    width = next_pow2(k)
    groups = max(width, min(num_groups, next_pow2(cols)))
    if group_maxima is not None:
        _check_group_maxima(group_maxima, rows, width)
        groups = group_maxima.shape[1]
    capacity = max(width, capacity)
    tile = min(tile, next_pow2(cols))
    splits = max(1, min(_default_splits(rows, splits, MAXIMA_TARGET_PROGRAMS), groups // RUN))
    candidate_chunk, candidate_splits = _chunking(rows, cols, candidate_splits, tile)
    name = f"{k=}_{groups=}_{tile=}_{capacity=}_{splits=}_{candidate_splits=}"

    def params(warps):
        return plgpu.CompilerParams(num_warps=warps, num_stages=num_stages)

    maxima = group_maxima if group_maxima is not None else pl.pallas_call(
        functools.partial(_maxima_kernel, groups=groups, size=groups // splits, unroll=maxima_unroll),
        out_shape=jax.ShapeDtypeStruct((rows, groups), jnp.int32),
        grid=(rows, splits), compiler_params=params(num_warps), interpret=interpret, name=f"topk_maxima_{name}",
    )(scores, lens)
    floor_args = dict(k=k, groups=groups, coarse_bits=coarse_bits)
    if separate_floor:
        floor = pl.pallas_call(
            functools.partial(_floor_kernel, **floor_args),
            out_shape=jax.ShapeDtypeStruct((rows,), jnp.int32),
            grid=(rows,), compiler_params=params(floor_warps or num_warps), interpret=interpret,
            name=f"topk_floor_{name}",
        )(maxima)
    cand_cols, counts = pl.pallas_call(
        functools.partial(_chunk_candidates_kernel, tile=tile, chunk=candidate_chunk, capacity=capacity,
                          floor_args=None if separate_floor else floor_args, interpret=interpret),
        out_shape=(
            jax.ShapeDtypeStruct((rows, candidate_splits * capacity), jnp.int32),
            jax.ShapeDtypeStruct((rows, candidate_splits), jnp.int32),
        ),
        grid=(rows, candidate_splits), compiler_params=params(candidate_warps or num_warps), interpret=interpret,
        name=f"topk_candidates_{name}",
    )(scores, lens, floor if separate_floor else maxima)
    select_warps = select_warps or (16 if sorted and sort_in_kernel else 8)
    values, indices, _ = pl.pallas_call(
        functools.partial(_select_kernel, k=k, tile=tile, splits=candidate_splits, capacity=capacity,
                          warps=select_warps, sort_in_kernel=sorted and sort_in_kernel, interpret=interpret),
        out_shape=(
            jax.ShapeDtypeStruct((rows, k), jnp.float32),
            jax.ShapeDtypeStruct((rows, k), jnp.int32),
            jax.ShapeDtypeStruct((rows, BUCKET_SLOTS), jnp.int32),
        ),
        grid=(rows,), interpret=interpret, name=f"topk_select_{name}",
        compiler_params=params(select_warps),
    )(scores, lens, cand_cols, counts)
    if sorted and not sort_in_kernel:
        values, indices = sort_rows(values, indices)
    return values, indices
