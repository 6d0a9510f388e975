"""Benchmark of `pallas_kernels.indexer_logits` (pallas_kernels/_indexer_mosaic.py, _indexer_triton.py) on one
GPU: correctness vs the reference, then a timing table.

Run from the repo root: `python bench/bench_indexer.py [--check] [--table] [--modes fp8,bf16]
[--knobs JSON] [--batches 1,8] [--lengths 65536]` (`--knobs '{"chunk_t": 64}'` times other tuning knobs than
the defaults; a JSON list times each knob set per shape). A knob set may name its "backend" ("mosaic",
"triton"; `[{}, {"backend": "triton"}]` compares the default with Triton); without one, tuning knobs run on the
implementation they belong to (`common.knobs_with_backend`) and no knobs on the default "pallas" backend (Mosaic
where it applies). `--check` compares fp8 on wgmma (the default) and exact (`fp8_imprecise_acc=None`, Triton).
Shapes: DeepSeek-V3.2 indexer, Hi=64, Di=128, page 64; B in {1, 8, 32, 64} rows of L in {4K, 16K, 64K, 128K}
tokens each; fp8 (132 B/token: e4m3 key + f32 scale) and bf16 (256 B/token) keys.
Timing: each call runs after an L2 flush on one of ROTATE block tables (random pages of a key pool of 8M
tokens, >= 1 GB, far above the 60 MB L2). Kernel time = median CUPTI duration of the indexer kernel over RUNS
calls, read from one JAX profiler trace around the table (wall clock minus an empty program's time where the
trace has no GPU events); XLA reference time = median wall time minus the same empty-program time. One
compile per shape: XLA compiles a Triton kernel in seconds, far longer than it runs.
Effective TB/s counts key and scale bytes of the valid tokens; the copy ceiling (x -> x + 1 on 4 GB, read +
write) is measured in the same run.
`--modes fp8-chunk` (or bf16-chunk) times a prefill chunk instead: B consecutive query tokens of one sequence of
L tokens, causal, one block table (`--knobs '[{"rows_per_cta": 1}, {"rows_per_cta": 2}]'` compares the Mosaic
kernel's rows a CTA; `{}` is its default, 2 from 2048 rows).
`--modes fp8+topk` times the indexer followed by the top-k (k=2048, column order, as the decode layer runs it)
in one program: the sum of its kernels, the logits read back from L2. With the default knobs that is
`pallas_kernels.indexer_top_k`, which fuses the top-k's maxima pass into the Mosaic indexer where it can (three
kernels, else four); with knobs, the indexer with those knobs, then the top-k.
Full logs go to $OUT (or ./out) as bench_indexer.{log,json}. `--plot JSON PNG` draws a saved table (any machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from bench.common import (BATCHES, CONTEXT_LENGTHS, INDEX_HEAD_DIM, INDEX_HEADS, PAGE_SIZE, TOP_K, Log, copy_tbps,
                          default_out_dir, flush_l2, knobs_with_backend, median_seconds, pyplot, read_json,
                          save_figure, set_x_ticks, warm_up_clocks, write_json)
from bench.gpu_trace import trace_events
from pallas_kernels import Fp8IndexKeys, _indexer_mosaic, formats, reference

POOL_PAGES = 64 * 131072 // PAGE_SIZE  # the largest shape's tokens: 1.1 GB fp8, 2.1 GB bf16
ROTATE, RUNS = 4, 10
CHECK_LENS = (0, 1, 63, 64, 1000, 8191, 12345, 16384)  # one row each, 16K columns (4K for f32)
KEY_BYTES = {"fp8": INDEX_HEAD_DIM + 4, "bf16": 2 * INDEX_HEAD_DIM}
KERNELS_PER_TOPK = 3
PALLAS_KERNELS = ("indexer_logits", "topk_maxima", "topk_candidates", "topk_select")  # kernel name parts

log = Log()


def make_pool(mode, key):
    """Index-key cache pool of [POOL_PAGES, PAGE_SIZE, Di]: an Fp8IndexKeys for fp8, plain bf16 keys for bf16."""
    keys = jax.random.normal(key, (POOL_PAGES, PAGE_SIZE, INDEX_HEAD_DIM), jnp.bfloat16)
    if mode == "fp8":
        return jax.jit(formats.quantize_index_keys)(keys)
    return keys


def make_queries(mode, rows, key):
    key_q, key_w = jax.random.split(key)
    q = jax.random.normal(key_q, (rows, INDEX_HEADS, INDEX_HEAD_DIM), jnp.float32)
    weights = jax.random.normal(key_w, (rows, INDEX_HEADS), jnp.float32) * INDEX_HEADS**-0.5
    if mode == "fp8":
        return formats.quantize_index_queries(q, weights * INDEX_HEAD_DIM**-0.5)
    return q.astype(jnp.bfloat16), weights * INDEX_HEAD_DIM**-0.5


def block_tables_for(rows, length, seed, lens=None):
    """Distinct random pool pages for each row's first ceil(len/PAGE_SIZE) blocks, -1 after."""
    rng = np.random.default_rng(seed)
    blocks = length // PAGE_SIZE
    tables = rng.permutation(POOL_PAGES)[: rows * blocks].reshape(rows, blocks).astype(np.int32)
    if lens is not None:
        tables[np.arange(blocks)[None, :] >= -(-np.asarray(lens)[:, None] // PAGE_SIZE)] = -1
    return jnp.asarray(tables)


def timed(fn, args):
    """Median wall seconds of fn(*args[i % len(args)]) over RUNS calls, each after an L2 flush."""
    return median_seconds(fn, args, RUNS, before_each=flush_l2)


_overhead = None


def overhead_seconds():
    """Dispatch-and-sync time of an almost empty program, subtracted from every timing."""
    global _overhead
    if _overhead is None:
        _overhead = timed(jax.jit(lambda x: x + 1), [(jnp.zeros((8,), jnp.float32),)])
    return _overhead


def measure_copy_tbps():
    """Same-run copy ceiling: x -> x + 1 on 4 GB (read + write), after bringing the clocks up."""
    warm_up_clocks()
    return copy_tbps(4 << 30, lambda fn, arg_sets: timed(fn, arg_sets) - overhead_seconds())


def fuses_top_k(q, weights, index_cache, block_tables, lens) -> bool:
    """Whether the default `indexer_top_k` fuses the top-k's maxima pass into the Mosaic indexer here."""
    keys = index_cache.keys if isinstance(index_cache, Fp8IndexKeys) else index_cache
    return (not pallas_kernels.unsupported("indexer_top_k", "mosaic", q, weights, index_cache, block_tables, lens)
            and _indexer_mosaic.fuses_group_maxima(keys, block_tables, TOP_K))


def time_kernel(index_cache, mode, rows, length, seed=0, *, with_reference=False, with_topk=False, chunk=False,
                **knobs):
    """Wall-clock timings of one shape; kernel_us is filled from the profiler trace by kernel_times().

    with_topk: time the indexer followed by the top-k (k=TOP_K, column order, as the decode layer runs it) in
    one program instead, the logits still in L2 when the top-k reads them.
    chunk: the rows are one prefill chunk, `rows` consecutive query tokens of one sequence of `length` tokens
    (causal lengths length - rows + 1 ... length, one block table).
    """
    q, weights = make_queries(mode, rows, jax.random.key(seed))
    if chunk:
        if rows > length:
            raise ValueError(f"a chunk of {rows} query tokens needs a sequence of as many; got {length}")
        lens = jnp.arange(length - rows + 1, length + 1, dtype=jnp.int32)
        tables = [jnp.repeat(block_tables_for(1, length, seed * 100 + i), rows, axis=0) for i in range(ROTATE)]
    else:
        lens = jnp.full((rows,), length, jnp.int32)
        tables = [block_tables_for(rows, length, seed * 100 + i) for i in range(ROTATE)]
    args = [(q, weights, index_cache, t, lens) for t in tables]

    fused = with_topk and not knobs and fuses_top_k(*args[0])
    run_knobs = knobs_with_backend("indexer_logits", knobs, *args[0])

    def run(*a):
        if fused:
            return pallas_kernels.indexer_top_k(*a, k=TOP_K, sorted=False)
        logits = pallas_kernels.indexer_logits(*a, interpret=False, **run_knobs)
        return pallas_kernels.topk(logits, a[-1], k=TOP_K, sorted=False, interpret=False) if with_topk else logits

    kernels_per_call = 1 + (KERNELS_PER_TOPK - fused if with_topk else 0)
    result = dict(mode=mode + ("-chunk" if chunk else "") + ("+topk" if with_topk else ""), B=rows, L=length,
                  knobs=knobs, fused=fused, bytes=int(lens.sum()) * KEY_BYTES[mode], kernels_per_call=kernels_per_call,
                  flops=2 * INDEX_HEADS * INDEX_HEAD_DIM * int(lens.sum()),
                  wall_us=(timed(jax.jit(run), args) - overhead_seconds()) * 1e6, xla_us=float("nan"))
    if with_reference:
        def ref(*a):
            logits = reference.indexer_logits(*a)
            return reference.topk(logits, a[-1], k=TOP_K, sorted=False) if with_topk else logits

        result["xla_us"] = (timed(jax.jit(ref), args) - overhead_seconds()) * 1e6
    return result


def kernel_times(trace_dir, kernels_per_call, calls_per_shape):
    """Per shape, the per-call sums of the indexer and top-k kernel durations (us) in a trace, in call order.

    kernels_per_call: one entry per timed shape (1 for the indexer alone, 3 or 4 with the top-k)."""
    lines = [[(e.start_ns, e.duration_ns / 1e3) for e in events if any(name in e.name for name in PALLAS_KERNELS)]
             for events in trace_events(trace_dir).values()]
    events = [us for _, us in sorted(max(lines, key=len, default=[]))]  # one stream line
    groups, at = [], 0
    for per_call in kernels_per_call:
        calls = [sum(events[i:i + per_call]) for i in range(at, at + per_call * calls_per_shape, per_call)]
        groups.append(calls)
        at += per_call * calls_per_shape
    return groups if at == len(events) else []


def check(pools):
    """Relative error vs the reference on the GPU and on the CPU (exact products; XLA on the GPU may run fp8 dots
    on fp8 tensor cores), mixed lengths incl. 0, 1, partial pages, full rows."""
    log("== correctness on GPU: kernel (default knobs) vs reference.indexer_logits (HIGHEST) ==")
    log(f"{'mode':<12}{'B':>4}{'L':>7}  {'rel err':>9}  {'vs CPU ref':>15}  {'GPU ref vs CPU':>15}  "
        f"{'-inf mismatches':>15}  {'nan':>4}")
    mixed = np.array(CHECK_LENS, np.int32)
    results = []
    for mode in ("fp8", "fp8-exact", "bf16", "f32", "bf16q-fp8k"):
        length, lens = (mixed[-1] // 4, mixed.clip(0, mixed[-1] // 4)) if mode == "f32" else (mixed[-1], mixed)
        key_mode = "bf16" if mode in ("bf16", "f32") else "fp8"
        knobs = dict(fp8_imprecise_acc=None) if mode == "fp8-exact" else {}
        index_cache = pools[key_mode]
        q, weights = make_queries(key_mode, len(lens), jax.random.key(7))
        tables = block_tables_for(len(lens), length, 7, lens)
        if mode == "f32":
            q = q.astype(jnp.float32)
            index_cache = index_cache[: len(lens) * length // PAGE_SIZE].astype(jnp.float32)
            tables = jnp.where(tables >= 0, tables % index_cache.shape[0], -1)
        if mode == "bf16q-fp8k":
            q = q.astype(jnp.bfloat16)
        lens = jnp.asarray(lens)
        args = (q, weights, index_cache, tables, lens)
        run_knobs = knobs_with_backend("indexer_logits", knobs, *args)
        out = np.asarray(jax.jit(lambda *a: pallas_kernels.indexer_logits(*a, interpret=False, **run_knobs))(*args))
        ref = np.asarray(jax.jit(reference.indexer_logits)(*args))
        cpu_ref = cpu_reference(args)
        is_valid = np.arange(ref.shape[1])[None, :] < np.asarray(lens)[:, None]

        def rel_err(x, y):
            return float(np.linalg.norm(x[is_valid] - y[is_valid]) / np.linalg.norm(y[is_valid]))

        err, err_cpu, ref_err_cpu = rel_err(out, ref), rel_err(out, cpu_ref), rel_err(ref, cpu_ref)
        inf_bad = int((np.isneginf(out) != ~is_valid).sum())
        nans = int(np.isnan(out).sum())
        log(f"{mode:<12}{len(lens):>4}{length:>7}  {err:9.2e}  {err_cpu:15.2e}  {ref_err_cpu:15.2e}  {inf_bad:>15}"
            f"  {nans:>4}")
        results.append(dict(mode=mode, B=len(lens), L=length, rel_err=err, rel_err_cpu=err_cpu,
                            gpu_reference_rel_err_cpu=ref_err_cpu, inf_mismatch=inf_bad, nan=nans))
    return results


def cpu_reference(args):
    """reference.indexer_logits on the CPU (exact f32 products) over just the rows' pages, copied off the GPU."""
    q, weights, index_cache, tables, lens = args
    used = jnp.clip(tables, 0)  # pages past a row's length are never read; page 0 stands in
    # The rows' pages of every part of the cache (keys [pages, B, Di], and an fp8 cache's scales [pages, B]).
    pages = jax.tree.map(lambda part: part[used].reshape(-1, *part.shape[1:]), index_cache)
    local_tables = jnp.arange(used.size, dtype=jnp.int32).reshape(used.shape)
    cpu = jax.devices("cpu")[0]
    moved = jax.device_put((q, weights, pages, local_tables, lens), cpu)
    return np.asarray(jax.jit(reference.indexer_logits)(*moved))


def table(pools, modes, knob_sets, batches, lengths, budget, reference_budget):
    """Kernel (per knob set) and XLA reference per shape, while time is left; kernel times from one profiler
    trace. The reference is timed once per shape."""
    log(f"== table: kernel ({knob_sets}) vs XLA reference ==")
    results = []
    trace_dir = tempfile.mkdtemp()
    jax.profiler.start_trace(trace_dir)
    for mode in modes:
        for rows in batches:
            for length in lengths:
                for i, knobs in enumerate(knob_sets):
                    if log.elapsed() > budget:
                        log(f"budget reached before {mode} B={rows} L={length} {knobs}")
                        break
                    with_topk, chunk = mode.endswith("+topk"), "-chunk" in mode
                    key_mode = mode.removesuffix("+topk").removesuffix("-chunk")
                    r = time_kernel(pools[key_mode], key_mode, rows, length, with_topk=with_topk, chunk=chunk,
                                    with_reference=i == 0 and log.elapsed() < reference_budget, **knobs)
                    log(f"{mode} B={rows} L={length} {knobs}{' fused' if r['fused'] else ''}: wall "
                        f"{r['wall_us']:.1f} us, xla {r['xla_us']:.1f} us   [{log.elapsed():.0f} s]")
                    results.append(r)
    jax.profiler.stop_trace()
    # The first call of each shape compiles and warms up.
    groups = kernel_times(trace_dir, [r["kernels_per_call"] for r in results], RUNS + 1)
    if len(groups) != len(results):
        log(f"profiler: {len(groups)} kernel groups for {len(results)} shapes; using wall-clock times")
    for i, r in enumerate(results):
        timed_calls = groups[i][1:] if len(groups) == len(results) else []
        r["kernel_us"] = statistics.median(timed_calls) if timed_calls else float("nan")
        r["us"] = r["kernel_us"] if timed_calls else r["wall_us"]
        r["tbps"] = r["bytes"] / (r["us"] * 1e-6) / 1e12
        r["tflops"] = r["flops"] / (r["us"] * 1e-6) / 1e12
    return results


def plot(report: dict, path: str) -> None:
    """Effective TB/s vs L, one line per key mode x B, against the same-run copy ceiling, as a PNG."""
    fig, ax = pyplot().subplots(figsize=(6.4, 4.2))
    rows = report["table"]
    for mode, style in (("bf16", "-"), ("fp8", "--")):
        for color, batch in enumerate(sorted({r["B"] for r in rows})):
            line = sorted((int(r["L"]), r["tbps"]) for r in rows if r["mode"] == mode and r["B"] == batch)
            if line:
                ax.plot(*zip(*line), marker="o", linestyle=style, color=f"C{color}", label=f"{mode} B={batch}")
    ax.axhline(report["copy_tbps"], color="gray", linestyle=":", label=f"copy {report['copy_tbps']:.2f} TB/s")
    lengths = sorted({int(r["L"]) for r in rows})
    ax.set(xscale="log", xlabel="context length L (tokens per row)", ylabel="effective TB/s (key + scale bytes)",
           title=f"indexer logits, {report['device']}, Hi={INDEX_HEADS} Di={INDEX_HEAD_DIM} page {PAGE_SIZE}",
           ylim=(0, None))
    set_x_ticks(ax, lengths, [f"{n // 1024}K" for n in lengths])
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--modes", default="fp8,bf16",
                        help="key modes of the table, comma-separated; MODE+topk times the indexer then the top-k, "
                             "MODE-chunk a prefill chunk of B query tokens")
    parser.add_argument("--knobs", default="{}",
                        help="JSON keyword knobs for indexer_logits (may name a backend), or a list of them (each "
                             "timed per shape)")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="table rows B, comma-separated")
    parser.add_argument("--lengths", default=",".join(map(str, CONTEXT_LENGTHS)),
                        help="table lengths L, comma-separated")
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds; later steps are skipped past it")
    parser.add_argument("--reference-budget", type=float, default=150.0, help="seconds; XLA timings stop here")
    parser.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"), default=None,
                        help="measure nothing: plot the table of a bench_indexer.json")
    args = parser.parse_args(argv)
    if args.plot:
        plot(read_json(args.plot[0]), args.plot[1])
        return
    out_dir = default_out_dir()
    os.makedirs(out_dir, exist_ok=True)
    log.write_to(os.path.join(out_dir, "bench_indexer.log"))
    log(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    pools = {mode: jax.block_until_ready(make_pool(mode, jax.random.key(1))) for mode in ("fp8", "bf16")}
    copy = measure_copy_tbps()
    log(f"copy bandwidth (read + write, 4 GB): {copy:.2f} TB/s; empty-program overhead "
        f"{overhead_seconds() * 1e6:.0f} us   [{log.elapsed():.0f} s]")
    report = dict(device=jax.devices()[0].device_kind, copy_tbps=copy, overhead_us=overhead_seconds() * 1e6)
    if args.check:
        report["check"] = check(pools)
    knobs = json.loads(args.knobs)
    knob_sets = knobs if isinstance(knobs, list) else [knobs]
    if args.table:
        report["table"] = table(pools, args.modes.split(","), knob_sets, [int(b) for b in args.batches.split(",")],
                                [int(n) for n in args.lengths.split(",")], args.budget, args.reference_budget)
    write_json(os.path.join(out_dir, "bench_indexer.json"), report)
    if report.get("table"):
        log(f"== indexer logits, {report['device']}, Hi={INDEX_HEADS} Di={INDEX_HEAD_DIM} page={PAGE_SIZE}, "
            f"knobs {knobs or 'default'}; copy {copy:.2f} TB/s ==")
        log(f"{'mode':<11}{'B':>5}{'L':>8}{'kernel us':>11}{'XLA us':>10}{'speedup':>9}{'TB/s':>7}{'% copy':>8}"
            f"{'TFLOP/s':>9}" + ("  knobs" if len(knob_sets) > 1 else ""))
        for r in report["table"]:
            mode = r["mode"] + ("*" if r["fused"] else "")
            log(f"{mode:<11}{r['B']:>5}{r['L']:>8}{r['us']:>11.1f}{r['xla_us']:>10.1f}"
                f"{r['xla_us'] / r['us']:>9.1f}{r['tbps']:>7.2f}{100 * r['tbps'] / copy:>8.0f}{r['tflops']:>9.0f}"
                + (f"  {json.dumps(r['knobs'])}" if len(knob_sets) > 1 else ""))
        log("TB/s: the keys each row reads (a chunk's rows share theirs); TFLOP/s: the rows' q.k products")
        if any(r["fused"] for r in report["table"]):
            log("* the top-k's maxima pass fused into the indexer (pallas_kernels.indexer_top_k)")
    log(f"done in {log.elapsed():.0f} s")


if __name__ == "__main__":
    main()
