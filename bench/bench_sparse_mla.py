"""Benchmark of `pallas_kernels.sparse_mla_decode` (pallas_kernels/_sparse_mla_mosaic.py, _sparse_mla_triton.py) on
one GPU: correctness vs the reference, then timings.

Run from the repo root: `python bench/bench_sparse_mla.py [--sweep]`.
Prints same-run ceilings (bf16 8192^3 matmul, device copy), a GPU compare against reference.sparse_mla_decode,
a table over B in {1, 8, 64}, H in {16, 64, 128}, k=2048 and DCP W in {1, 2, 4, 8} (count = k/W slots per
row) with the default backend ("pallas": Mosaic on the H200 for bf16), the variants of `VARIANTS` (the Triton
backend, the fp8 latent cache on the default backend and on Triton; `--variants` picks some) on a few of those
shapes, and with --sweep a knob sweep (block knobs on Triton, `num_splits` on the backend "pallas" picks;
`common.knobs_with_backend`).
--quick times only the variant comparison; `--knobs` adds labelled variants (any knobs of sparse_mla_decode) and
`--shapes` picks the compared shapes, e.g. the fp8 kernel's register split and splits at small batches:
  python3 bench/bench_sparse_mla.py --quick --variants fp8_latent --shapes '64,128,1;8,128,1' --knobs
    '{"r192": {"cache": "fp8_latent", "registers": [192, 64]}, "s4": {"num_splits": 4}}'
Full logs go to $OUT (or ./out) as bench_sparse_mla.{log,json}; `--plot JSON PNG` draws a saved JSON (per-rank
time vs DCP size; no GPU needed). `--breakdown 'B,H,W;...'` lists the GPU kernels of one call per shape with
their durations (the Pallas kernel and the XLA ops around it), for the default and each of `--variants`.
FLOPs per row: 2*H*count*(Dq + value_dim) (scores over 576 columns, values over 512).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

import pallas_kernels
from bench.common import (LATENT_DIM, PAGE_SIZE, ROPE_DIM, TOP_K, Log, copy_tbps, default_out_dir, kernel_durations_us,
                          knobs_with_backend, matmul_tflops, pyplot, read_json, save_figure, set_x_ticks,
                          throughput_seconds, traced_device_events, write_json)
from pallas_kernels import Fp8LatentCache, formats, reference

VALUE_DIM, TOPK = LATENT_DIM, TOP_K
WIDTH = VALUE_DIM + ROPE_DIM
SM_SCALE = 0.1352
# 2**20 cache rows of 576 bf16 = 1.2 GB, so random slots miss the 60 MB L2.
CACHE_PAGES = 16384
# Input sets per jitted call: enough kernels per dispatch that small shapes time the device, not the host.
SETS_PER_CALL_SMALL, SETS_PER_CALL_LARGE = 32, 4
# Rotate at least this many bytes of distinct KV rows per timing loop (4x the L2).
ROTATE_BYTES = 256 << 20
MAX_GROUPS = 16

# Compared with the default backend on COMPARED_SHAPES (B, H, W): name -> sparse_mla_decode knobs.
VARIANTS = {"triton": dict(backend="triton"), "fp8_latent": dict(cache="fp8_latent"),
            "fp8_latent_triton": dict(cache="fp8_latent", backend="triton")}
COMPARED_SHAPES = ((64, 128, 1), (64, 128, 4), (8, 128, 1), (1, 128, 1))

OUT_DIR = default_out_dir()
LOG_PATH = os.path.join(OUT_DIR, "bench_sparse_mla.log")

log = Log()


def ceilings() -> dict:
    """Same-run ceilings: a bf16 8192^3 matmul (TFLOP/s), then a 2 GB copy (TB/s, read + write), each timed
    back to back for at least 0.2 s."""
    seconds = functools.partial(throughput_seconds, min_seconds=0.2)
    return dict(matmul_tflops=matmul_tflops(seconds), copy_tbps=copy_tbps(2 << 30, seconds))


def token_bytes(cache) -> int:
    """Cache bytes per token: 576 values, or 656 B for an fp8 latent cache."""
    return sum(part.dtype.itemsize * part.shape[-1] for part in jax.tree.leaves(cache))


def make_cache(dtype):
    cache = jax.random.normal(jax.random.key(1), (CACHE_PAGES, PAGE_SIZE, WIDTH), jnp.float32)
    return cache.astype(dtype)


def query_dtype(cache):
    """The queries' dtype for a cache: bf16 for an fp8 latent cache, else the cache's."""
    return jnp.bfloat16 if isinstance(cache, Fp8LatentCache) else cache.dtype


def make_sets(seed, num_sets, rows, heads, count, dtype):
    """Stacked q [N, R, H, Dq], slots [N, R, k] (random rows of the whole cache, -1 past count), counts [N, R]."""
    key_q, key_s = jax.random.split(jax.random.key(seed))
    q = jax.random.normal(key_q, (num_sets, rows, heads, WIDTH), jnp.float32).astype(dtype)
    slots = jax.random.randint(key_s, (num_sets, rows, TOPK), 0, CACHE_PAGES * PAGE_SIZE, jnp.int32)
    slots = jnp.where(jnp.arange(TOPK) < count, slots, -1)
    counts = jnp.full((num_sets, rows), count, jnp.int32)
    return q, slots, counts


def poison_allocator(nbytes: int) -> None:
    # Best effort: leave NaN-filled freed blocks for the next allocation to reuse.
    jax.block_until_ready(jnp.full((nbytes // 4,), jnp.nan, jnp.float32)).delete()


def check_correctness(cache_bf16) -> list[dict]:
    """Kernel vs reference on fresh random inputs: counts 0, 1, k and ragged ones; bf16, f32 and fp8 latent
    caches (the fp8 one with bf16 queries)."""
    results = []
    cache_f32 = cache_bf16[:2048].astype(jnp.float32)  # a smaller f32 cache keeps the f32 compare cheap
    cache_fp8 = formats.quantize_latent_cache(cache_f32, value_dim=VALUE_DIM)
    counts = jnp.array([TOPK, 0, 1, 700, 1000, 333, 2047, 64], jnp.int32)
    for dtype, cache, backend in ((jnp.bfloat16, cache_bf16, "pallas"), (jnp.bfloat16, cache_bf16, "triton"),
                                  (jnp.float32, cache_f32, "pallas"), (jnp.bfloat16, cache_fp8, "pallas")):
        cache_name = "fp8" if isinstance(cache, Fp8LatentCache) else jnp.dtype(dtype).name
        pages = jax.tree.leaves(cache)[0].shape[0]
        for heads, num_splits in ((128, 1), (128, 4), (128, None), (64, None), (16, None)):
            key_q, key_s = jax.random.split(jax.random.key(heads + (num_splits or 0)))
            q = jax.random.normal(key_q, (len(counts), heads, WIDTH), jnp.float32).astype(dtype)
            slots = jax.random.randint(key_s, (len(counts), TOPK), 0, pages * PAGE_SIZE, jnp.int32)
            slots = jnp.where(jnp.arange(TOPK) < counts[:, None], slots, -1)
            # num_splits is a tuning knob: under "pallas" it runs on the implementation "pallas" picks here.
            knobs = dict(num_splits=num_splits) if backend == "pallas" else dict(num_splits=num_splits, backend=backend)
            knobs = knobs_with_backend("sparse_mla_decode", knobs, q, cache, slots, counts, SM_SCALE)
            kernel = jax.jit(functools.partial(pallas_kernels.sparse_mla_decode, sm_scale=SM_SCALE, **knobs))
            poison_allocator(len(counts) * 16 * heads * VALUE_DIM * 4)
            try:
                out, lse = kernel(q, cache, slots, counts)
            except Exception as error:  # report a compile failure and go on to the next case
                log(f"check {backend} H={heads} splits={num_splits}: FAILED {str(error)[:300]}")
                results.append(dict(dtype=cache_name, backend=backend, heads=heads, num_splits=num_splits,
                                    ok=False))
                continue
            with jax.default_matmul_precision("highest"):
                ref_out, ref_lse = jax.jit(functools.partial(reference.sparse_mla_decode, sm_scale=SM_SCALE))(
                    q.astype(jnp.float32), cache, slots, counts)
            full = counts > 0
            rel = float(jnp.linalg.norm((out - ref_out)[full]) / jnp.linalg.norm(ref_out[full]))
            lse_err = float(jnp.max(jnp.abs(lse - ref_lse)[full]))
            is_empty_ok = bool(jnp.all(out[~full] == 0) & jnp.all(lse[~full] == -jnp.inf))
            has_nan = bool(jnp.isnan(out).any() | jnp.isnan(lse).any())
            tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
            ok = rel < tol and lse_err < 1e-3 and is_empty_ok and not has_nan
            results.append(dict(dtype=cache_name, backend=backend, heads=heads, num_splits=num_splits,
                                rel_err=rel, lse_max_abs_err=lse_err, empty_rows_ok=is_empty_ok, nan=has_nan, ok=ok))
            log(f"check {cache_name:8s} {backend:6s} H={heads:3d} splits={num_splits!s:4s} "
                f"rel_err={rel:.2e} lse_err={lse_err:.2e} empty_ok={is_empty_ok} nan={has_nan} -> "
                f"{'OK' if ok else 'FAIL'}")
    return results


@functools.partial(jax.jit, static_argnames="knobs")
def _run_sets(q, slots, counts, kv_cache, knobs):
    """The kernel on each stacked input set; knobs is a sorted tuple of (name, value)."""
    return [pallas_kernels.sparse_mla_decode(q[i], kv_cache, slots[i], counts[i], SM_SCALE, **dict(knobs))
            for i in range(q.shape[0])]


def time_kernel(cache, rows, heads, dcp, **knobs) -> dict:
    """Per-call time of one shape (k/W slots per row), rotating over >= ROTATE_BYTES of KV rows; tuning knobs
    run on the backend they need (`common.knobs_with_backend`), which the result's knobs record."""
    count = TOPK // dcp
    set_bytes = rows * count * token_bytes(cache)
    sets_per_call = SETS_PER_CALL_LARGE if set_bytes * SETS_PER_CALL_LARGE >= ROTATE_BYTES else SETS_PER_CALL_SMALL
    num_groups = max(1, min(MAX_GROUPS, math.ceil(ROTATE_BYTES / (set_bytes * sets_per_call))))
    groups = [(*make_sets(100 + g, sets_per_call, rows, heads, count, query_dtype(cache)), cache)
              for g in range(num_groups)]
    q, slots, counts, _ = groups[0]
    knobs = knobs_with_backend("sparse_mla_decode", knobs, q[0], cache, slots[0], counts[0], SM_SCALE)
    run = functools.partial(_run_sets, knobs=tuple(sorted(knobs.items())))
    compile_start = time.perf_counter()
    jax.block_until_ready(run(*groups[0]))
    compile_s = time.perf_counter() - compile_start
    seconds = throughput_seconds(run, groups) / sets_per_call
    flops = 2 * rows * heads * count * (WIDTH + VALUE_DIM)
    return dict(rows=rows, heads=heads, dcp=dcp, count=count, us=seconds * 1e6, tflops=flops / seconds / 1e12,
                rotated_mb=num_groups * sets_per_call * set_bytes / 1e6, compile_s=compile_s, knobs=knobs)


def time_xla_reference(cache, rows, heads) -> dict:
    q, slots, counts = make_sets(200, 1, rows, heads, TOPK, cache.dtype)
    ref = jax.jit(functools.partial(reference.sparse_mla_decode, sm_scale=SM_SCALE))
    with jax.default_matmul_precision("default"):
        seconds = throughput_seconds(ref, [(q[0], cache, slots[0], counts[0])])
    return dict(rows=rows, heads=heads, us=seconds * 1e6)


def kernel_breakdown(cache, rows, heads, dcp, calls=20, **knobs) -> dict:
    """Per GPU kernel of one `sparse_mla_decode` call with these knobs (the Pallas kernel and the XLA ops around
    it): median duration over `calls` calls, from a profiler trace."""
    q, slots, counts = make_sets(300, 1, rows, heads, TOPK // dcp, query_dtype(cache))
    args = (q[0], cache, slots[0], counts[0])
    knobs = knobs_with_backend("sparse_mla_decode", knobs, *args, SM_SCALE)
    run = jax.jit(functools.partial(pallas_kernels.sparse_mla_decode, sm_scale=SM_SCALE, **knobs))
    jax.block_until_ready(run(*args))
    durations = kernel_durations_us(traced_device_events(run, args, calls))
    # Stream lines repeat some events under other line names: keep kernels seen once per call.
    kernels = {name: statistics.median(us) for name, us in durations.items() if len(us) == calls}
    return dict(rows=rows, heads=heads, dcp=dcp, knobs=knobs, kernels=kernels, total_us=sum(kernels.values()))


def plot(report: dict, path: str) -> None:
    """Per-rank kernel time vs DCP size W (one panel per batch B): the default backend for each H, the ideal 1/W
    scaling of its H=128 line, and the compared variants' points, as a PNG."""
    batches = sorted({r["rows"] for r in report["table"]}, reverse=True)
    fig, axes = pyplot().subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), sharey=True, squeeze=False)
    for ax, rows in zip(axes[0], batches):
        for i, heads in enumerate(sorted({r["heads"] for r in report["table"]}, reverse=True)):
            line = sorted((r["dcp"], r["us"]) for r in report["table"] if (r["rows"], r["heads"]) == (rows, heads))
            ax.plot(*zip(*line), "-o", color=f"C{i}", label=f"default backend, H={heads}")
            if i == 0:
                ax.plot([w for w, _ in line], [line[0][1] / w for w, _ in line], ":", color=f"C{i}",
                        label=f"H={heads} at W=1, divided by W")
        for j, name in enumerate(sorted({r["variant"] for r in report.get("variants", [])})):
            points = sorted((r["dcp"], r["us"]) for r in report["variants"]
                            if r["variant"] == name and r["rows"] == rows)
            if points:
                ax.plot(*zip(*points), "x", markersize=9, color=f"C{3 + j}", label=f"{name}, H=128")
        widths = sorted({r["dcp"] for r in report["table"]})
        ax.set(xscale="log", yscale="log", xlabel="DCP size W (k/W owned slots per row)",
               title=f"B={rows}, k={TOPK}, bf16 latent")
        set_x_ticks(ax, widths, [str(w) for w in widths])
    axes[0][0].set_ylabel("per-rank kernel time, us")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


def compared_variants(names: str, knobs_json: str) -> dict[str, dict]:
    """The variants to compare, label -> knobs: the comma-separated `names` of VARIANTS, then each label of the
    JSON `knobs_json` (label -> knobs; JSON lists become tuples, as jit's static knobs must hash). ValueError on a
    name that is neither."""
    labelled = {label: {name: tuple(value) if isinstance(value, list) else value for name, value in knobs.items()}
                for label, knobs in json.loads(knobs_json).items()}
    named = [name for name in names.split(",") if name]
    if unknown := sorted(set(named) - set(VARIANTS) - set(labelled)):
        raise ValueError(f"unknown variants {unknown}; choose from {sorted(VARIANTS)} or name them in --knobs")
    return {**{name: VARIANTS.get(name, labelled.get(name)) for name in named}, **labelled}


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also time knob variants")
    parser.add_argument("--sweep-budget", type=float, default=110.0, help="seconds after which the sweep stops")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds after which the table stops")
    parser.add_argument("--quick", action="store_true",
                        help="skip the checks, the full table and the XLA reference: only the variant comparison")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"variants compared with the default backend, from {sorted(VARIANTS)} and --knobs")
    parser.add_argument("--knobs", default="{}",
                        help='JSON: more variants, label -> knobs of sparse_mla_decode ("cache": "fp8_latent" for '
                             'the fp8 cache; lists become tuples), e.g. {"r192": {"cache": "fp8_latent", '
                             '"registers": [192, 64]}}; each label is compared too')
    parser.add_argument("--shapes", default="",
                        help=f"the compared B,H,W shapes, e.g. '64,128,1;64,128,4' (default {COMPARED_SHAPES})")
    parser.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"), default=None,
                        help="measure nothing: plot a saved bench_sparse_mla.json")
    parser.add_argument("--breakdown", default="",
                        help="only list the GPU kernels of one call at these B,H,W shapes, e.g. '8,128,1;1,128,1', "
                             "for the default and each variant")
    args = parser.parse_args(argv)
    if args.plot:
        plot(read_json(args.plot[0]), args.plot[1])
        return
    try:
        known = compared_variants(args.variants, args.knobs)
    except ValueError as error:
        parser.error(str(error))
    variants = list(known)
    shapes = (tuple(tuple(int(n) for n in shape.split(",")) for shape in args.shapes.split(";"))
              if args.shapes else COMPARED_SHAPES)
    os.makedirs(OUT_DIR, exist_ok=True)
    log.write_to(LOG_PATH, append=True)  # several runs (e.g. --breakdown, then the table) share one log
    device = jax.devices()[0]
    log(f"device: {device.device_kind}, jax {jax.__version__}, date {time.strftime('%Y-%m-%d')}")
    report = dict(device=device.device_kind, jax=jax.__version__)

    caches = dict(bf16=make_cache(jnp.bfloat16))
    if any(known[name].get("cache") == "fp8_latent" for name in variants):
        caches["fp8_latent"] = formats.quantize_latent_cache(caches["bf16"], value_dim=VALUE_DIM)
    if args.breakdown:
        report["breakdown"] = []
        for shape in args.breakdown.split(";"):
            for name in ("default", *variants):
                knobs = dict(known.get(name, {}))
                r = dict(kernel_breakdown(caches[knobs.pop("cache", "bf16")], *(int(n) for n in shape.split(",")),
                                          **knobs), variant=name)
                report["breakdown"].append(r)
                log(f"{name} B={r['rows']} H={r['heads']} W={r['dcp']}: {len(r['kernels'])} kernels, "
                    f"{r['total_us']:.1f} us busy")
                for kernel, us in sorted(r["kernels"].items(), key=lambda item: -item[1]):
                    log(f"  {us:8.1f} us  {kernel[:100]}")
        write_json(os.path.join(OUT_DIR, "bench_sparse_mla.json"), report)
        return
    report["ceilings"] = ceil = ceilings()
    log(f"ceilings: bf16 matmul 8192^3 {ceil['matmul_tflops']:.0f} TFLOP/s, copy {ceil['copy_tbps']:.2f} TB/s "
        f"(read+write)  [{log.elapsed():.0f}s]")
    cache = caches["bf16"]
    report["checks"] = [] if args.quick else check_correctness(cache)
    log(f"correctness done [{log.elapsed():.0f}s]")

    sweep = []
    if args.sweep:
        sweep_knobs = [dict(block_s=bs, num_warps=8, num_stages=ns) for bs, ns in ((128, 1), (64, 2), (32, 5))]
        sweep_knobs += [dict(num_splits=s) for s in (4, 16)]
        for knobs in sweep_knobs:
            for rows, heads, dcp in ((64, 128, 1), (64, 128, 4), (8, 128, 1), (8, 128, 4)):
                if "num_splits" in knobs and rows == 64:
                    continue
                if log.elapsed() > args.sweep_budget:
                    log(f"budget reached, skipping {knobs} B={rows}")
                    continue
                try:
                    result = time_kernel(cache, rows, heads, dcp, **knobs)
                except Exception as error:  # a variant that fails to compile (e.g. shared memory) is reported
                    result = dict(rows=rows, heads=heads, dcp=dcp, knobs=knobs, error=str(error)[:300])
                    log(f"sweep {knobs} B={rows} H={heads} W={dcp}: FAILED {result['error'][:160]}")
                else:
                    log(f"sweep {knobs} B={rows} H={heads} W={dcp}: {result['us']:.1f} us "
                        f"{result['tflops']:.1f} TFLOP/s [{log.elapsed():.0f}s]")
                sweep.append(result)
    report["sweep"] = sweep
    table = [time_kernel(cache, rows, heads, dcp) for rows, heads, dcp in shapes] if args.quick else []
    for rows in () if args.quick else (64, 8, 1):
        for heads in (128, 64, 16):
            for dcp in (1, 2, 4, 8):
                if log.elapsed() > args.budget:
                    log(f"budget reached, skipping B={rows} H={heads} W={dcp}")
                    continue
                result = time_kernel(cache, rows, heads, dcp)
                table.append(result)
                log(f"B={rows:2d} H={heads:3d} W={dcp} count={result['count']:4d} {result['us']:8.1f} us "
                    f"{result['tflops']:6.1f} TFLOP/s compile {result['compile_s']:.1f}s [{log.elapsed():.0f}s]")
    report["table"] = table
    compared = []
    for name in variants:
        for rows, heads, dcp in shapes:
            knobs = dict(known[name])
            variant_cache = caches[knobs.pop("cache", "bf16")]
            result = dict(time_kernel(variant_cache, rows, heads, dcp, **knobs), variant=name)
            compared.append(result)
            log(f"{name} B={rows:2d} H={heads:3d} W={dcp} {result['us']:8.1f} us {result['tflops']:6.1f} TFLOP/s")
    report["variants"] = compared
    if not args.quick:
        report["xla_reference"] = xla = time_xla_reference(cache, 64, 128)
        log(f"XLA reference B=64 H=128 k=2048: {xla['us']:.1f} us")

    write_json(os.path.join(OUT_DIR, "bench_sparse_mla.json"), report)
    base = {(r["rows"], r["heads"]): r["us"] for r in table if r["dcp"] == 1}
    if args.sweep:
        log("sweep: " + "; ".join(f"{r['knobs']} B={r['rows']} W={r['dcp']}: "
                                  + (f"{r['us']:.1f}us" if "us" in r else "fail") for r in sweep))
    log("")
    default_us = {(r["rows"], r["heads"], r["dcp"]): r["us"] for r in table}
    log("| variant | B | H | W | us | TFLOP/s | default's time / this |")
    log("|---|---|---|---|---|---|---|")
    for r in compared:
        log(f"| {r['variant']} | {r['rows']} | {r['heads']} | {r['dcp']} | {r['us']:.1f} | {r['tflops']:.1f} | "
            f"{default_us.get((r['rows'], r['heads'], r['dcp']), math.nan) / r['us']:.2f} |")
    log(f"ceilings: matmul {ceil['matmul_tflops']:.0f} TFLOP/s, copy {ceil['copy_tbps']:.2f} TB/s; "
        "checks " + ("skipped (--quick)" if args.quick else
                     "all OK" if all(c["ok"] for c in report["checks"]) else "FAILED"))
    log("| B | H | W | count | us | TFLOP/s | % matmul | vs W=1 |")
    log("|---|---|---|---|---|---|---|---|")
    for r in table:
        ratio = r["us"] / base.get((r["rows"], r["heads"]), math.nan)
        log(f"| {r['rows']} | {r['heads']} | {r['dcp']} | {r['count']} | {r['us']:.1f} | {r['tflops']:.1f} | "
            f"{100 * r['tflops'] / ceil['matmul_tflops']:.0f}% | {ratio:.2f} |")


if __name__ == "__main__":
    main()
