"""Compile and compare the sharded decode stack with the Pallas kernels on the local accelerators.

Runs the demo's continuous-batching schedule at every DCP size the devices allow, with the Pallas kernels
and with the references, against the single-device unsharded computation; prints one row per run.
Usage: python bench/gpu_check_decode.py [--model tiny-indexer --index-cache fp8 --latent-cache fp8]
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

from dcp_jax.config import (INDEX_CACHE_FORMATS, INDEX_CACHE_HELP, LATENT_CACHE_FORMATS, LATENT_CACHE_HELP, TINY,
                            EngineConfig, ParallelConfig)
from dcp_jax.demo import run_comparison, staggered_schedule

warnings.filterwarnings("ignore", category=DeprecationWarning)

# model -> (config, page size). tiny-indexer: the tiny model with DeepSeek-V3.2's indexer (64 heads of 128) and
# pages of 64 tokens, so that an fp8 index cache runs the Mosaic GPU indexer on Hopper.
MODELS = {"tiny": (TINY, 16), "tiny-indexer": (dataclasses.replace(TINY, index_n_heads=64, index_head_dim=128), 64)}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dcp", default="1,2,4,8", help="DCP sizes to try (those the devices allow run)")
    parser.add_argument("--interleave", default="1,2")
    parser.add_argument("--max-seqs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--index-cache", choices=INDEX_CACHE_FORMATS, default="exact",
                        help=INDEX_CACHE_HELP + "; both sides of the comparison use it")
    parser.add_argument("--latent-cache", choices=LATENT_CACHE_FORMATS, default="exact",
                        help=LATENT_CACHE_HELP + "; both sides use it (the fp8 kernel's bf16 rounding can change "
                             "a later layer's top-k, so pallas rows may differ more than reference rows)")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny",
                        help="tiny-indexer: DeepSeek's indexer shape and pages of 64 (the Mosaic indexer with fp8)")
    args = parser.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")
    cfg, page_size = MODELS[args.model]
    engine = EngineConfig(page_size=page_size, num_pages=64, max_num_seqs=args.max_seqs,
                          max_model_len=args.steps + 16, max_num_batched_tokens=args.max_seqs,
                          index_cache=args.index_cache,
                          latent_cache=args.latent_cache)
    schedule = staggered_schedule(args.max_seqs, args.steps, seed=0)
    devices = len(jax.devices())
    print(f"backend {jax.default_backend()}, {devices} x {jax.devices()[0].device_kind}, model {args.model}, "
          f"{args.index_cache} index cache, {args.latent_cache} latent cache")
    print(f"{'kernels':>10} {'dcp':>4} {'interleave':>10} {'buckets':>8} {'max ctx':>8} {'step ms':>8} "
          f"{'max |err|':>10} {'wall s':>7}")
    for dcp in [int(d) for d in args.dcp.split(",") if int(d) <= devices]:
        for interleave in [int(s) for s in args.interleave.split(",")]:
            for kernels in ("pallas", "reference"):
                begin = time.perf_counter()
                r = run_comparison(cfg, ParallelConfig(tp=dcp, dcp=dcp, interleave=interleave), engine, schedule,
                                   kernels=kernels)
                print(f"{kernels:>10} {r.dcp:>4} {r.interleave:>10} {r.buckets_compiled:>8} {r.max_context:>8} "
                      f"{r.step_ms:>8.2f} {r.max_abs_err:>10.2e} {time.perf_counter() - begin:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
