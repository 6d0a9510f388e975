"""Paged dense MLA decode alone (`pallas_kernels.mla_decode`, issue 57) against the same-run copy bandwidth, and the
MTP verify rows (Y = 2) against the same-run bf16 matmul rate.

The grid: B (= M sequences) x L (local tokens a sequence) x (Y, H): Y = 1 at each of --heads and Y = 2 at each of
--mtp-heads (causal: row s attends L - Y + 1 + s tokens), over bf16 and fp8 latent caches (--caches). A point's
bytes are what one call must move at least: each sequence's L cache tokens once (576 bf16 values or 656 fp8-format
bytes a token: every row tile of a sequence reads them, the tiles after the first mostly from L2), q, the block
tables and lens, and out and lse in f32; its FLOPs 2 * H * ((C+E) + C) per attended (row, token) (scores over 576
columns, values over 512). Each call's pages are random pages of a pool, and the timing rotates over input sets of
>= --rotate-bytes of distinct pages (256 MB: 4x an H200's L2), so no call finds its cache in L2. On a GPU a time is
the device time of one call: the summed durations of its kernels in a profiler trace (the kernel and the split
merge; the host's dispatch not); elsewhere the wall time of back-to-back calls (interpreted kernels: a smoke run).
The first set of each point is checked against `reference.mla_decode` (relative Frobenius error of out, largest
lse error) when the reference's f32 arrays stay under --check-elements elements.

Usage (repository root):
  python bench/bench_mla_decode.py --batches 1,2 --contexts 64 --heads 16 --mtp-heads 16 --page-size 16 \\
      --rotate-bytes 0 --copy-bytes 4M --matmul-size 128                  # CPU smoke (interpreted)
  python3 bench/bench_mla_decode.py --json-out $OUT/mla_decode.jsonl      # H100 / H200: the issue's grid
  python3 bench/bench_mla_decode.py --batches 1 --contexts 32K --heads 16 --caches bf16 --backend triton \\
      --knobs '{"splits": 64}'                                           # one point with a knob
Output: a table on stdout, and JSON lines (--json-out): the run (`run_info`, the ceilings, the arguments), then one
line a point.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pallas_kernels  # noqa: E402
from bench.common import (LATENT_DIM, ROPE_DIM, copy_tbps, device_seconds, matmul_tflops,  # noqa: E402
                          median_seconds, run_info, sizes, warm_up_clocks)
from pallas_kernels import _mla_decode_triton, formats, reference  # noqa: E402

VALUE_DIM = LATENT_DIM  # C = 512
WIDTH = LATENT_DIM + ROPE_DIM  # C+E = 576
SM_SCALE = 0.1352  # DeepSeek-V3's softmax scale with its YaRN factor (any value times the same)
MAX_SETS = 16
# The pool is made in chunks of pages (`lax.map`), so its random values never exist as f32 or all at once in bits:
# a bf16 pool of B = 128 sequences of L = 128K tokens is 19.3 GB.
POOL_CHUNK_PAGES = 256


@functools.partial(jax.jit, static_argnames=("chunks", "page_size", "fp8"))
def make_pool(key, *, chunks: int, page_size: int, fp8: bool):
    """A cache of chunks * POOL_CHUNK_PAGES pages of normal values: bf16 [pages, B, C+E], or an Fp8LatentCache whose
    latent is e4m3 normal values under power-of-two scales 2^-4 .. 1 and whose rope is bf16."""
    def chunk(key):
        shape = (POOL_CHUNK_PAGES, page_size)
        if not fp8:
            return jax.random.normal(key, (*shape, WIDTH), jnp.bfloat16)
        key_latent, key_scales, key_rope = jax.random.split(key, 3)
        exponents = jax.random.randint(key_scales, (*shape, VALUE_DIM // formats.LATENT_TILE), -4, 1)
        return formats.Fp8LatentCache(jax.random.normal(key_latent, (*shape, VALUE_DIM)).astype(jnp.float8_e4m3fn),
                                      jnp.exp2(exponents.astype(jnp.float32)),
                                      jax.random.normal(key_rope, (*shape, ROPE_DIM), jnp.bfloat16))

    parts = jax.lax.map(chunk, jax.random.split(key, chunks))
    return jax.tree.map(lambda part: part.reshape(chunks * POOL_CHUNK_PAGES, *part.shape[2:]), parts)


def token_bytes(fp8: bool) -> int:
    """Cache bytes a token: 576 bf16, or 512 e4m3 + 4 f32 scales + 64 bf16 = 656."""
    return VALUE_DIM + 4 * (VALUE_DIM // formats.LATENT_TILE) + 2 * ROPE_DIM if fp8 else 2 * WIDTH


def causal_lens(batch: int, queries: int, context: int):
    """lens [B, Y]: row s of every sequence attends context - Y + 1 + s tokens (the last row all of them)."""
    return jnp.broadcast_to(context - queries + 1 + jnp.arange(queries, dtype=jnp.int32), (batch, queries))


def make_sets(seed: int, num_sets: int, pool_pages: int, batch: int, queries: int, heads: int, max_pages: int):
    """num_sets input sets (q bf16 [B, Y, H, C+E], block_tables [B, P]), each set's pages distinct random pages of the
    pool, disjoint from the other sets'."""
    key_pages, key_q = jax.random.split(jax.random.key(seed))
    pages = jax.random.permutation(key_pages, pool_pages)[:num_sets * batch * max_pages]
    tables = pages.astype(jnp.int32).reshape(num_sets, batch, max_pages)
    return [(jax.random.normal(key, (batch, queries, heads, WIDTH), jnp.bfloat16), tables[i])
            for i, key in enumerate(jax.random.split(key_q, num_sets))]


def check(run, q, cache, tables, lens) -> dict:
    """The kernel's out and lse on one set against the reference's: relative Frobenius error of out and the largest
    lse error (every row attends at least one token here)."""
    out, lse = run(q, cache, tables, lens)
    ref_out, ref_lse = jax.jit(functools.partial(reference.mla_decode, sm_scale=SM_SCALE, value_dim=VALUE_DIM))(
        q, cache, tables, lens)
    rel = float(jnp.linalg.norm(out - ref_out) / jnp.linalg.norm(ref_out))
    return dict(rel_error=rel, lse_error=float(jnp.max(jnp.abs(lse - ref_lse))),
                finite=bool(jnp.isfinite(out).all() & jnp.isfinite(lse).all()))


def time_point(args, knobs: dict, cache_name: str, batch: int, queries: int, heads: int, context: int) -> dict:
    """One point of the grid: its bytes and FLOPs, the tiling the Triton kernel takes for it, its time and check."""
    fp8 = cache_name == "fp8"
    page_size = args.page_size
    max_pages = -(-context // page_size)
    set_bytes = batch * max_pages * page_size * token_bytes(fp8)
    num_sets = max(1, min(MAX_SETS, math.ceil(args.rotate_bytes / set_bytes)))
    chunks = -(-num_sets * batch * max_pages // POOL_CHUNK_PAGES)
    cache = make_pool(jax.random.key(batch + context), chunks=chunks, page_size=page_size, fp8=fp8)
    lens = causal_lens(batch, queries, context)
    sets = [(q, cache, tables, lens)
            for q, tables in make_sets(batch * queries + heads, num_sets, chunks * POOL_CHUNK_PAGES, batch, queries,
                                       heads, max_pages)]
    run = jax.jit(functools.partial(pallas_kernels.mla_decode, sm_scale=SM_SCALE, value_dim=VALUE_DIM,
                                    backend=args.backend, **knobs))
    q, _, tables, _ = sets[0]
    uses_triton = args.backend == "triton" or (args.backend == "pallas" and pallas_kernels.choose(
        "mla_decode", "pallas", *sets[0], SM_SCALE, value_dim=VALUE_DIM) == "triton")
    tiles = (_mla_decode_triton.tiling(q, cache, tables, lens, value_dim=VALUE_DIM, **knobs) if uses_triton
             else None)
    attended = int(jnp.sum(lens))
    nbytes = (batch * context * token_bytes(fp8) + q.size * q.dtype.itemsize + 4 * (tables.size + lens.size)
              + 4 * batch * queries * heads * (VALUE_DIM + 1))
    flops = 2 * heads * (WIDTH + VALUE_DIM) * attended
    point = dict(kind="point", cache=cache_name, batch=batch, queries=queries, heads=heads, context=context,
                 page_size=page_size, backend=args.backend, knobs=knobs,
                 tiling=None if tiles is None else dataclasses.asdict(tiles), bytes=nbytes, flops=flops, sets=num_sets)
    checked = max(batch * context * WIDTH, batch * queries * heads * context) <= args.check_elements
    point |= check(run, *sets[0]) if checked else dict(rel_error=None, lse_error=None, finite=None)
    seconds = device_seconds(run, sets, args.calls)
    return point | dict(us=seconds * 1e6, tbps=nbytes / seconds / 1e12, tflops=flops / seconds / 1e12)


def grid(args) -> list[tuple[str, int, int, int, int]]:
    """(cache, B, Y, H, L) of every point: per cache, Y = 1 at each H of --heads then Y = 2 at each of --mtp-heads."""
    rows = [(1, heads) for heads in args.heads] + [(2, heads) for heads in args.mtp_heads]
    return [(cache, batch, queries, heads, context) for cache in args.caches for queries, heads in rows
            for batch in args.batches for context in args.contexts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcp-jax bench mla_decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=sizes, default=(1, 8, 64, 128), help="B (= M) values")
    parser.add_argument("--contexts", type=sizes, default=(4096, 32768, 131072), help="L values (4K, 32K, ...)")
    parser.add_argument("--heads", type=sizes, default=(128, 16), help="H of the Y = 1 rows")
    parser.add_argument("--mtp-heads", type=sizes, default=(128,), help="H of the Y = 2 (MTP verify) rows")
    parser.add_argument("--caches", type=lambda t: tuple(t.split(",")), default=("bf16", "fp8"),
                        help="bf16 and/or fp8 (the fp8 latent cache)")
    parser.add_argument("--page-size", type=int, default=64, help="B, tokens a page")
    parser.add_argument("--backend", default="pallas", choices=pallas_kernels.BACKENDS)
    parser.add_argument("--knobs", type=json.loads, default={},
                        help='JSON: tuning knobs of the Triton kernel (needs --backend triton), e.g. {"splits": 8}')
    parser.add_argument("--calls", type=int, default=20, help="traced calls a timing (a GPU's device time)")
    parser.add_argument("--rotate-bytes", type=lambda t: sizes(t)[0], default=256 << 20,
                        help="cache bytes of distinct pages the timing rotates over (0: one input set)")
    parser.add_argument("--check-elements", type=lambda t: sizes(t)[0], default=1 << 28,
                        help="check points whose reference arrays (B*L*576 gathered, B*Y*H*L scores) stay under this")
    parser.add_argument("--copy-bytes", type=lambda t: sizes(t)[0], default=2 << 30,
                        help="the copy ceiling's array (8M, 2G, ...)")
    parser.add_argument("--matmul-size", type=int, default=8192, help="n of the n x n x n bf16 matmul ceiling")
    parser.add_argument("--budget", type=float, default=3600.0, help="seconds after which points are skipped")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.caches) - {"bf16", "fp8"}):
        parser.error(f"--caches: unknown {unknown}; bf16 and fp8 are known")
    if args.knobs and args.backend != "triton":
        parser.error(f"--knobs {args.knobs} are the Triton kernel's: they need --backend triton")
    start = time.perf_counter()
    out = open(args.json_out, "w") if args.json_out else None

    def record(row):
        if out:
            out.write(json.dumps(row, default=str) + "\n")
            out.flush()

    if jax.default_backend() == "gpu":
        warm_up_clocks()

    def wall_seconds(fn, arg_sets):  # the ceilings: large single ops, their dispatch negligible
        return median_seconds(fn, arg_sets, 5)

    tbps, tflops = copy_tbps(args.copy_bytes, wall_seconds), matmul_tflops(wall_seconds, n=args.matmul_size)
    info = dict(run_info(), kind="run", args=vars(args), copy_tbps=tbps, matmul_tflops=tflops)
    record(info)
    print(f"{info['device']}, commit {info['commit']}; same-run copy {tbps:.2f} TB/s (read + write), bf16 matmul "
          f"{args.matmul_size}^3 {tflops:.0f} TFLOP/s; backend {args.backend} {args.knobs or ''}", flush=True)
    print("| cache | B | Y | H | L | tiles x splits | MB moved | us | TB/s | of copy | TFLOP/s | of matmul | "
          "rel. error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for cache_name, batch, queries, heads, context in grid(args):
        shape = f"| {cache_name} | {batch} | {queries} | {heads} | {context} |"
        if time.perf_counter() - start > args.budget:
            record(dict(kind="point", cache=cache_name, batch=batch, queries=queries, heads=heads, context=context,
                        skipped="budget"))
            print(f"{shape} skipped: past --budget {args.budget:.0f} s |", flush=True)
            continue
        try:
            point = time_point(args, args.knobs, cache_name, batch, queries, heads, context)
        except Exception as failure:  # a compile, a shape or the memory of one point: record it, go on
            message = f"{type(failure).__name__}: {str(failure)[:300]}"
            record(dict(kind="point", cache=cache_name, batch=batch, queries=queries, heads=heads, context=context,
                        failed=message))
            print(f"{shape} failed: {message[:150]} |", flush=True)
            continue
        point |= dict(copy_fraction=point["tbps"] / tbps, matmul_fraction=point["tflops"] / tflops)
        record(point)
        tiles = "-" if point["tiling"] is None else "{row_tiles} x {splits}".format(**point["tiling"])
        error = "-" if point["rel_error"] is None else f"{point['rel_error']:.1e}"
        print(f"{shape} {tiles} | "
              f"{point['bytes'] / 1e6:.1f} | {point['us']:.1f} | {point['tbps']:.2f} | "
              f"{100 * point['copy_fraction']:.0f}% | {point['tflops']:.1f} | {100 * point['matmul_fraction']:.0f}% | "
              f"{error} |", flush=True)
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
