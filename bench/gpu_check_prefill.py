"""Compile and compare chunked prefill with the Pallas kernels on the local accelerator.

The tiny model with DeepSeek-V3.2's indexer shape (64 heads of 128) and pages of 64 (so the fp8 index cache runs the
Mosaic GPU indexer) prefills prompts longer than index_topk through `ModelRunner.prefill`: in one step and in chunks
(each chunk's rows attending to the prefix earlier steps cached), with the Pallas kernels, against one step with the
reference kernels. Prints, per index-cache format and chunk size, the worst logit difference and the share of
query rows whose selected top-k sets differ (fp8 scores of the kernel and of the reference may order near-ties
differently; the exact cache must agree).
Usage: python bench/gpu_check_prefill.py [--lengths 300,1000] [--chunks 96,512]
"""

import argparse
import dataclasses
import os
import sys
import time
import warnings

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from dcp_jax.config import TINY, EngineConfig, ParallelConfig
from dcp_jax.model.deepseek_v32 import init_params
from dcp_jax.model.mesh import make_mesh
from dcp_jax.runtime.runner import ModelRunner

warnings.filterwarnings("ignore", category=DeprecationWarning)
CFG = dataclasses.replace(TINY, index_n_heads=64, index_head_dim=128)


def _ints(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p]


def run(index_cache: str, kernels: str, prompts, chunk: int, page_size: int, budget: int):
    engine = EngineConfig(page_size=page_size, num_pages=4 * len(prompts) * (max(map(len, prompts)) // page_size + 2),
                          max_num_seqs=4, max_model_len=max(map(len, prompts)) + 8, max_num_batched_tokens=budget,
                          index_cache=index_cache)
    parallel = ParallelConfig(tp=1, dcp=1)
    mesh = make_mesh(parallel)
    runner = ModelRunner(CFG, init_params(CFG, 0), parallel, engine, mesh, kernels)
    blocks = engine.max_blocks_per_seq(1)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(prompts))]
    begin = time.perf_counter()
    logits, selected, _ = runner.prefill(prompts, tables, chunk_size=chunk, all_logits=True, return_selected=True)
    return logits, selected, time.perf_counter() - begin


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=_ints, default=[300, 1000])
    parser.add_argument("--chunks", type=_ints, default=[96, 512])
    parser.add_argument("--page-size", type=int, default=64)
    args = parser.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, CFG.vocab_size, n).tolist() for n in args.lengths]
    budget = max(max(args.lengths), *args.chunks)
    print(f"backend {jax.default_backend()}, {jax.devices()[0].device_kind}, prompts {args.lengths}, "
          f"index_topk {CFG.index_topk}")
    print(f"{'index cache':>11} {'kernels':>9} {'chunk':>6} {'max |dlogit|':>12} {'rows, sets differ':>17} {'s':>6}")
    for index_cache in ("exact", "fp8"):
        want, want_sel, _ = run(index_cache, "reference", prompts, budget, args.page_size, budget)
        for kernels, chunk in [("pallas", budget)] + [("pallas", c) for c in args.chunks]:
            got, sel, seconds = run(index_cache, kernels, prompts, chunk, args.page_size, budget)
            err = max(float(np.nanmax(np.abs(got[i, :n] - want[i, :n]))) for i, n in enumerate(args.lengths))
            differ = total = 0
            for i, n in enumerate(args.lengths):
                a, b = np.sort(sel[:, i, :n], -1), np.sort(want_sel[:, i, :n], -1)
                differ += int(np.any(a != b, axis=-1).sum())
                total += a.shape[0] * n
            print(f"{index_cache:>11} {kernels:>9} {chunk:>6} {err:>12.2e} {differ / total:>17.4f} {seconds:>6.1f}")


if __name__ == "__main__":
    main()
