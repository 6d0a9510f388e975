"""The indexer over a prefill chunk: the row-tile Triton kernel (`query_seqs`: a chunk's rows share each key chunk)
against the row kernel (every row gathers its own keys), and both on decode rows of different sequences, same run.

Prefill: one chunk of `--chunk` consecutive query rows of one sequence whose causal lengths run from `--start` + 1
to `--start` + chunk (what a step of the engine's chunked prefill scores), DeepSeek-V3.2's indexer (Hi = 64,
Di = 128, page 64), bf16 keys (the engine's exact index cache: Triton) and fp8 keys (the Mosaic row kernel where
the step runs it, and Triton). Decode: B rows of L tokens each, every row its own sequence (the tile kernel's
row-by-row path). Kernel time: the summed device time of the indexer kernels a call runs (a profiler trace over
`--runs` calls), against the same-run bf16 matmul rate (the scores' FLOPs: 2 Hi Di per (query, key) pair).

Usage: python3 bench/bench_prefill_indexer.py [--chunk 2048] [--start 30720] [--out $OUT/prefill_indexer.jsonl]
(`dcp-jax bench prefill_indexer`; on CPU the kernels are interpreted and the trace has no device times: NaN)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from bench.common import (INDEX_HEAD_DIM, INDEX_HEADS, PAGE_SIZE, kernel_durations_us, matmul_tflops,
                          median_seconds, run_info, traced_device_events, warm_up_clocks)
from pallas_kernels import formats



def keys_pool(mode: str, pages: int):
    keys = jax.random.normal(jax.random.key(1), (pages, PAGE_SIZE, INDEX_HEAD_DIM), jnp.bfloat16)
    return jax.jit(formats.quantize_index_keys)(keys) if mode == "fp8" else keys


def queries(mode: str, rows: int):
    key_q, key_w = jax.random.split(jax.random.key(2))
    q = jax.random.normal(key_q, (rows, INDEX_HEADS, INDEX_HEAD_DIM), jnp.float32)
    weights = jax.random.normal(key_w, (rows, INDEX_HEADS), jnp.float32) * (INDEX_HEADS * INDEX_HEAD_DIM) ** -0.5
    return formats.quantize_index_queries(q, weights) if mode == "fp8" else (q.astype(jnp.bfloat16), weights)


def shapes(kind: str, args) -> tuple[np.ndarray, np.ndarray, int]:
    """(lens [R], query_seqs [R], sequences) of a prefill chunk or a decode batch."""
    if kind == "prefill":
        lens = args.start + 1 + np.arange(args.chunk)
        return lens.astype(np.int32), np.zeros(args.chunk, np.int32), 1
    lens = np.full(args.decode_rows, args.decode_length, np.int32)
    return lens, np.arange(args.decode_rows, dtype=np.int32), args.decode_rows


def kernel_ms(fn, inputs, runs: int) -> float:
    """Device ms a call of fn spends in indexer kernels (median of `runs` traced calls, summed over its kernels)."""
    durations = kernel_durations_us(traced_device_events(fn, inputs, runs), line_prefix="Stream")
    per_kernel = [d for name, d in durations.items() if name.startswith("indexer_logits")]
    return sum(float(np.median(d)) for d in per_kernel) / 1e3 if per_kernel else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--start", type=int, default=30720, help="tokens before the chunk")
    parser.add_argument("--decode-rows", type=int, default=64)
    parser.add_argument("--decode-length", type=int, default=65536)
    parser.add_argument("--tiles", default="2,4,8", help="rows_per_tile values of the row-tile kernel")
    parser.add_argument("--runs", type=int, default=10, help="traced calls a variant")
    parser.add_argument("--matmul-size", type=int, default=8192, help="n of the n x n x n bf16 matmul ceiling")
    parser.add_argument("--out", default="prefill_indexer.jsonl")
    args = parser.parse_args(argv)
    out = open(args.out, "w")
    info = run_info()
    warm_up_clocks()
    tflops = matmul_tflops(lambda fn, sets: median_seconds(fn, sets, 10), n=args.matmul_size)
    out.write(json.dumps(dict(kind="run", **info, args=vars(args), matmul_tflops=tflops)) + "\n")
    print(f"{info['device']}, commit {info['commit']}; same-run bf16 matmul {tflops:.0f} TFLOP/s")
    print("| rows | keys | kernel | ms | TFLOP/s (share of matmul) |\n|---|---|---|---|---|")
    tiles = [int(t) for t in args.tiles.split(",") if t]
    for kind in ("prefill", "decode"):
        lens, seqs, num_seqs = shapes(kind, args)
        blocks = -(-int(lens.max()) // PAGE_SIZE)
        rng = np.random.default_rng(0)
        tables = rng.permutation(num_seqs * blocks + 8).astype(np.int32)[:num_seqs * blocks].reshape(num_seqs, -1)
        pairs = float(lens.sum())
        flops = 2.0 * pairs * INDEX_HEADS * INDEX_HEAD_DIM
        rows_label = (f"{args.chunk} of one sequence, lengths {args.start + 1}-{args.start + args.chunk}"
                      if kind == "prefill" else f"{args.decode_rows} sequences of {args.decode_length}")
        for mode in ("bf16", "fp8"):
            cache = keys_pool(mode, num_seqs * blocks + 8)
            q, weights = queries(mode, len(lens))
            inputs = (q, weights, cache, jnp.asarray(tables), jnp.asarray(lens), jnp.asarray(seqs))
            variants = {"row kernel (triton)": dict(backend="triton", rows_per_tile=1)}
            variants |= {f"row tiles of {t}, {w} warps (triton)": dict(backend="triton", rows_per_tile=t, num_warps=w)
                         for t in tiles for w in (4, 8)}
            if mode == "fp8" and not pallas_kernels.unsupported("indexer_logits", "mosaic", *inputs[:5]):
                variants["row kernel (mosaic)"] = dict(backend="mosaic")
            for name, knobs in variants.items():
                def run(q, weights, cache, tables, lens, seqs, knobs=knobs):
                    if knobs.get("rows_per_tile") == 1:  # the row kernel: each row its own table
                        return pallas_kernels.indexer_logits(q, weights, cache, tables[seqs], lens, backend="triton")
                    if knobs["backend"] == "mosaic":
                        return pallas_kernels.indexer_logits(q, weights, cache, tables[seqs], lens, backend="mosaic")
                    return pallas_kernels.indexer_logits(q, weights, cache, tables, lens, query_seqs=seqs, **knobs)

                fn = jax.jit(run)
                jax.block_until_ready(fn(*inputs))
                ms = kernel_ms(fn, inputs, args.runs)
                rate = flops / (ms * 1e-3) / 1e12
                out.write(json.dumps(dict(kind=kind, mode=mode, kernel=name, rows=len(lens), ms=ms, flops=flops,
                                          tflops=rate)) + "\n")
                print(f"| {rows_label} | {mode} | {name} | {ms:.3f} | {rate:.0f} ({rate / tflops:.0%}) |", flush=True)
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
