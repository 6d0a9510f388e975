"""Benchmark and GPU check of `pallas_kernels.topk` (its Triton kernel, pallas_kernels/_topk_triton.py; k=2048)
against lax.top_k, with a same-run copy ceiling.

Run on the GPU machine from the repo root: `python bench/bench_topk.py [--sweep] [--out DIR]`.
1. Correctness: every timed variant on fresh random rows (lengths near N, one row shorter than k, garbage past
   the length), on rows of exact ties and on all-equal rows (the whole-row path), is compared bit for bit with
   reference.topk (lax.top_k on this GPU); any difference, and every ties/equal set, is settled by a numpy
   oracle. Only a kernel != oracle row fails the run: the GPU's lax.top_k itself broke the lower-column-first
   rule on tied rows shorter than k at some shapes (docs/perf_topk.md, "Correctness on the GPU"). A tiny
   signed-zero case prints how this GPU's lax.top_k orders -0.0 and 0.0.
2. Timing: one jitted call runs the op on `sets` input sets (> 2x the 60 MB L2 together); the median over
   repeats of (wall time / sets) is the time per call. The copy ceiling is `x + 1` over the same sets.
Variants: the default (sorted by score) and `sorted=False` (column order). --sweep also times knob variants
on [max batch, 64K]. Prints the table last; logs go to --out (default $OUT). `--plot JSON PNG` draws a saved
bench_topk.json (any machine).
On a CPU, `--k 16 --batches 2 --columns 256` is a quick interpreted smoke run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import sys
import time

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from bench import common
from bench.common import (L2_BYTES, TOP_K, Log, default_out_dir, kernel_durations_us, median_seconds, pyplot,
                          read_json, save_figure, set_x_ticks, traced_device_events, warm_up_clocks, write_json)
from pallas_kernels import reference

K = TOP_K
BATCHES = ",".join(map(str, common.BATCHES))
COLUMNS = ",".join(map(str, common.CONTEXT_LENGTHS))
# Knob variants timed by --sweep on [64, 64K]: name -> keyword arguments of `pallas_kernels.topk` on its Triton
# kernel (`_topk_triton.topk`).
SWEEP = {
    "xla_sort": dict(sort_in_kernel=False),
    "select_warps8": dict(select_warps=8),
    "unsorted_separate_floor": dict(sorted=False, separate_floor=True),
    "unsorted_splits2": dict(sorted=False, splits=2, candidate_splits=2),
    "unsorted_splits8": dict(sorted=False, splits=8, candidate_splits=8),
    "unsorted_candidate_warps4": dict(sorted=False, candidate_warps=4),
    "unsorted_maxima_unroll4": dict(sorted=False, maxima_unroll=4),
    "unsorted_maxima_unroll8": dict(sorted=False, maxima_unroll=8),
    "unsorted_coarse12": dict(sorted=False, coarse_bits=12),
}


log = Log()


def kernel_topk(scores, lens, *, k, **knobs):
    """`pallas_kernels.topk` on its Triton kernel, the op's one Pallas implementation (what "pallas" runs), so
    that tuning knobs may be passed."""
    return pallas_kernels.topk(scores, lens, k=k, backend="triton", **knobs)


def make_rows(rng, batch, cols, k, fill="normal"):
    """Scores [batch, cols] and lengths near cols (row 0 shorter than k when batch > 1); NaN past the length."""
    x = rng.standard_normal((batch, cols), dtype=np.float32)
    if fill == "ties":
        x = np.round(x * 4) / 4
    elif fill == "equal":
        x[:] = 1.5
    lens = rng.integers(max(cols - cols // 16, 1), cols + 1, batch).astype(np.int32)
    if batch > 1:
        lens[0] = min(k // 2, cols)
    for r, length in enumerate(lens):
        x[r, length:] = np.nan
    return jnp.asarray(x), jnp.asarray(lens)


def batched(fn):
    """One jitted call that applies fn to each (scores, lens) pair of a list."""
    return jax.jit(lambda pairs: [fn(s, l) for s, l in pairs])


def time_call(compiled, pairs, repeats=15):
    """(wall seconds per op: median over repeats, GPU kernel seconds per op from a profiler trace or NaN)."""
    wall = median_seconds(compiled, [(pairs,)], repeats, warmup=3) / len(pairs)
    return wall, kernel_time(compiled, pairs)


def kernel_time(compiled, pairs, runs=5):
    """Sum of the GPU kernel durations on the stream lines of a trace, per op (launch gaps excluded)."""
    try:
        lines = traced_device_events(compiled, (pairs,), runs, "/device:GPU:0")
        per_kernel = {name: sum(us) for name, us in
                      kernel_durations_us(lines, line_prefix="Stream", name_chars=60).items()}
        if not per_kernel:
            log("profiler: no GPU stream events")
            return float("nan")
        ops = runs * len(pairs)
        log("  kernels us/op: " + ", ".join(f"{name} {us / ops:.1f}"
                                            for name, us in sorted(per_kernel.items(), key=lambda x: -x[1])[:4]))
        return sum(per_kernel.values()) * 1e-6 / ops
    except Exception as e:  # the profiler is a nice-to-have: keep the wall times
        log(f"profiler failed: {type(e).__name__}: {e}"[:300])
        return float("nan")


def host_topk(scores, lens, k):
    """numpy oracle: f32 total order descending, then column ascending; pads (-inf, -1)."""
    x = np.asarray(scores)
    bits = x.view(np.int32).astype(np.int64)
    keys = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    values = np.full((x.shape[0], k), -np.inf, np.float32)
    indices = np.full((x.shape[0], k), -1, np.int32)
    for r, length in enumerate(np.asarray(lens)):
        order = np.lexsort((np.arange(length), -keys[r, :length]))[:k]
        values[r, :len(order)], indices[r, :len(order)] = x[r, order], order
    return values, indices


def compile_all(jobs):
    """jobs: name -> (fn, example args). Compiles in threads (XLA releases the GIL). Returns name -> compiled."""
    def build(item):
        name, (fn, args) = item
        start = time.perf_counter()
        try:
            return name, fn.lower(*args).compile(), time.perf_counter() - start
        except Exception as e:  # a variant that does not compile is reported, not fatal
            return name, e, time.perf_counter() - start
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        results = list(pool.map(build, jobs.items()))
    for name, result, seconds in results:
        status = "ok" if not isinstance(result, Exception) else f"FAILED {type(result).__name__}: {result}"[:400]
        log(f"compile {name}: {seconds:.1f}s {status}")
    return {name: result for name, result, _ in results}


def column_order(result):
    """A sorted top-k (values, indices) reordered by column, pads last: what sorted=False returns."""
    values, indices = np.asarray(result[0]), np.asarray(result[1])
    order = np.argsort(np.where(indices < 0, np.iinfo(np.int32).max, indices), axis=1, kind="stable")
    return np.take_along_axis(values, order, axis=1), np.take_along_axis(indices, order, axis=1)


def bad_rows(got, want):
    """Rows where indices or value bits differ."""
    (values, indices), (want_values, want_indices) = got, want
    bad = (np.asarray(indices) != np.asarray(want_indices)).any(axis=1)
    bad |= (np.asarray(values).view(np.int32) != np.asarray(want_values).view(np.int32)).any(axis=1)
    return np.flatnonzero(bad).tolist()


def plot(rows: list[dict], path: str) -> None:
    """GPU kernel us vs rows B (one panel per N): the default (sorted), column order and lax.top_k, as a PNG."""
    columns = sorted({r["cols"] for r in rows})
    fig, axes = pyplot().subplots(1, len(columns), figsize=(4.2 * len(columns), 3.8), sharey=True, squeeze=False)
    for ax, cols in zip(axes[0], columns):
        shape_rows = [r for r in rows if r["cols"] == cols]
        for variant, label, style in (("default", "Pallas, sorted", "-o"), ("unsorted", "Pallas, column order", "-s")):
            line = sorted((r["batch"], r["kernel_us"]) for r in shape_rows if r["variant"] == variant)
            if line:
                ax.plot(*zip(*line), style, label=label)
        reference_line = sorted({(r["batch"], r["top_k_us"]) for r in shape_rows if r["variant"] == "default"})
        ax.plot(*zip(*reference_line), "--^", color="gray", label="lax.top_k")
        if cols == 65536:
            ax.axhline(40, color="C3", linestyle=":", label="target at [64, 64K]: 40 us")
        batches = sorted({r["batch"] for r in shape_rows})
        ax.set(xscale="log", yscale="log", xlabel="rows B", title=f"k={K}, N={cols // 1024}K columns")
        set_x_ticks(ax, batches, [str(b) for b in batches])
    axes[0][0].set_ylabel("GPU kernel time, us")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default=default_out_dir())
    parser.add_argument("--k", type=int, default=K)
    parser.add_argument("--batches", default=BATCHES, help="comma-separated row counts")
    parser.add_argument("--columns", default=COLUMNS, help="comma-separated column counts")
    parser.add_argument("--variants", default=None,
                        help='JSON {name: topk knobs} timed at every shape (default: {"default": {}, "unsorted": '
                             '{"sorted": false}})')
    parser.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"), default=None,
                        help="measure nothing: plot the rows of a bench_topk.json")
    args = parser.parse_args(argv)
    if args.plot:
        plot(read_json(args.plot[0]), args.plot[1])
        return 0
    k = args.k
    batches = [int(b) for b in args.batches.split(",")]
    columns = [int(c) for c in args.columns.split(",")]
    os.makedirs(args.out, exist_ok=True)
    log(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}, backend {jax.default_backend()}")
    rng = np.random.default_rng(0)

    # Signed zeros: how this GPU's lax.top_k ranks -0.0 against 0.0 (the CPU ranks 0.0 first).
    zeros = jnp.asarray(np.array([[-0.0, 0.0, -0.0, 0.0, 1.0, -1.0, 0.5, -0.5]], np.float32))
    zero_lens = jnp.array([8], jnp.int32)
    ref_zero = reference.topk(zeros, zero_lens, k=4)
    got_zero = pallas_kernels.topk(zeros, zero_lens, k=4)
    log(f"signed zeros: reference {np.asarray(ref_zero[1]).tolist()} kernel {np.asarray(got_zero[1]).tolist()}")

    variants = json.loads(args.variants) if args.variants else {"default": {}, "unsorted": dict(sorted=False)}
    shapes = [(b, n) for n in columns for b in batches]
    jobs, inputs = {}, {}
    for batch, cols in shapes:
        sets = int(np.clip(np.ceil(2 * L2_BYTES / (batch * cols * 4)), 2, 16))
        inputs[batch, cols] = [make_rows(rng, batch, cols, k) for _ in range(sets)]
        example = (inputs[batch, cols],)
        jobs[("ref", batch, cols)] = (batched(functools.partial(reference.topk, k=k)), example)
        jobs[("copy", batch, cols)] = (batched(lambda s, l: s + 1.0), example)
        for name, knobs in variants.items():
            jobs[(name, batch, cols)] = (batched(functools.partial(kernel_topk, k=k, **knobs)), example)
    if args.sweep:
        sweep_shape = (max(batches), 65536 if 65536 in columns else columns[-1])
        for name, knobs in SWEEP.items():
            if name not in variants:
                fn = batched(functools.partial(kernel_topk, k=k, **knobs))
                jobs[(name, *sweep_shape)] = (fn, (inputs[sweep_shape],))
    start = time.perf_counter()
    compiled = compile_all(jobs)
    log(f"compiled {len(jobs)} programs in {time.perf_counter() - start:.1f}s")

    # Correctness on the timing inputs, then on ties and all-equal rows of the same shapes.
    failures = []
    for (name, batch, cols), fn in compiled.items():
        if name in ("ref", "copy") or isinstance(fn, Exception):
            continue
        pairs = inputs[batch, cols]
        want = compiled["ref", batch, cols](pairs)
        extra = [make_rows(rng, batch, cols, k, fill) for fill in ("ties", "equal")]
        extra += pairs[len(extra):]
        fills = ["normal"] * len(pairs) + ["ties", "equal"] + ["normal"] * (len(pairs) - 2)
        ok = True
        outputs = zip(fills, pairs + extra, fn(pairs) + fn(extra), want + compiled["ref", batch, cols](extra))
        is_sorted = {**variants, **SWEEP}[name].get("sorted", True)
        for fill, (scores, lens), got, ref in outputs:
            ref = ref if is_sorted else column_order(ref)
            differs = bad_rows(got, ref)
            if differs or fill != "normal":  # settle who is wrong with the host oracle
                oracle = host_topk(scores, lens, k)
                oracle = oracle if is_sorted else column_order(oracle)
                kernel_bad, ref_bad = bad_rows(got, oracle), bad_rows(ref, oracle)
                if kernel_bad or ref_bad:
                    log(f"  {name} [{batch}, {cols}] {fill}: kernel != oracle rows {kernel_bad[:8]}, "
                        f"lax.top_k != oracle rows {ref_bad[:8]}")
                ok = ok and not kernel_bad
        if not ok:
            failures.append((name, batch, cols))
        log(f"check {name} [{batch}, {cols}]: {'ok' if ok else 'MISMATCH'}")

    warm_up_clocks()  # an idle H200 reads 345 MHz
    rows = []
    for key, fn in compiled.items():
        if isinstance(fn, Exception) or key[0] in ("ref", "copy"):
            continue
        name, batch, cols = key
        pairs = inputs[batch, cols]
        wall, t_kernel = time_call(fn, pairs)
        ref_wall, t_ref = time_call(compiled["ref", batch, cols], pairs)
        _, t_copy = time_call(compiled["copy", batch, cols], pairs)
        bytes_in = batch * cols * 4
        row = dict(variant=name, batch=batch, cols=cols, kernel_us=t_kernel * 1e6, top_k_us=t_ref * 1e6,
                   speedup=t_ref / t_kernel, read_tb_s=bytes_in / t_kernel / 1e12,
                   copy_tb_s=2 * bytes_in / t_copy / 1e12, wall_us=wall * 1e6, top_k_wall_us=ref_wall * 1e6,
                   ok=(name, batch, cols) not in failures)
        rows.append(row)
        log(json.dumps(row))
    write_json(os.path.join(args.out, "bench_topk.json"), rows)

    log("\nGPU kernel time per op (profiler), wall = host-timed per op incl. launch gaps")
    log("variant              B      N  kernel_us  top_k_us  speedup  read_TB/s  copy_TB/s  wall_us  tk_wall_us  ok")
    for r in rows:
        log(f"{r['variant']:<18} {r['batch']:>3} {r['cols']:>6} {r['kernel_us']:>10.1f} {r['top_k_us']:>9.1f} "
            f"{r['speedup']:>8.1f} {r['read_tb_s']:>10.2f} {r['copy_tb_s']:>10.2f} {r['wall_us']:>8.1f} "
            f"{r['top_k_wall_us']:>11.1f}  {r['ok']}")
    log(f"failures: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
