"""How much of the exact top-k the fp8 indexer keeps: overlap of the top-k token sets chosen from fp8 scores
(Hadamard rotation, e4m3 with ue8m0 scales, q scales folded into the weights, one scale per key) and from bf16
keys, against exact f32 scoring, on random data at the DeepSeek-V3.2 indexer shapes (Hi=64, Di=128, k=2048).

Runs anywhere (pure-jnp references; CPU is fine): `python bench/bench_fp8_overlap.py [--rows 4]`.
Prints a markdown table: mean and minimum over rows of |top-k(mode) & top-k(exact)| / k.
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import INDEX_HEAD_DIM, INDEX_HEADS, PAGE_SIZE, TOP_K
from pallas_kernels import formats, reference

LENGTHS = (8192, 32768, 65536)


def overlap(ids, exact_ids):
    return np.array([len(np.intersect1d(a[a >= 0], b[b >= 0])) / TOP_K for a, b in zip(ids, exact_ids)])


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")
    print(f"rows={args.rows} Hi={INDEX_HEADS} Di={INDEX_HEAD_DIM} k={TOP_K}, N(0, 1) queries and keys, N(0, 1/Hi) "
          "head weights")
    print("| L | fp8 overlap mean (min) | bf16 keys overlap mean (min) |")
    print("|---|---|---|")
    for length in LENGTHS:
        keys = jax.random.split(jax.random.key(args.seed + length), 3)
        q = jax.random.normal(keys[0], (args.rows, INDEX_HEADS, INDEX_HEAD_DIM))
        # Every scale folded in: the Hi^-0.5 head scale and the Di^-0.5 dot scale.
        weights = jax.random.normal(keys[1], (args.rows, INDEX_HEADS)) * INDEX_HEADS**-0.5 * INDEX_HEAD_DIM**-0.5
        k_cache = jax.random.normal(keys[2], (length // PAGE_SIZE, PAGE_SIZE, INDEX_HEAD_DIM))
        tables = jnp.tile(jnp.arange(length // PAGE_SIZE, dtype=jnp.int32), (args.rows, 1))
        lens = jnp.full((args.rows,), length, jnp.int32)

        def top_ids(q, weights, index_cache):
            scores = reference.indexer_logits(q, weights, index_cache, tables, lens)
            return np.asarray(reference.topk(scores, lens, k=TOP_K)[1])

        exact = top_ids(q, weights, k_cache)
        q8, folded = formats.quantize_index_queries(q, weights)
        fp8 = overlap(top_ids(q8, folded, formats.quantize_index_keys(k_cache)), exact)
        bf16 = overlap(top_ids(q.astype(jnp.bfloat16), weights, k_cache.astype(jnp.bfloat16)), exact)
        print(f"| {length} | {fp8.mean():.4f} ({fp8.min():.4f}) | {bf16.mean():.4f} ({bf16.min():.4f}) |", flush=True)


if __name__ == "__main__":
    main()
