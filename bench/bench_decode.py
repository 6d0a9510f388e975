"""Sharded decode-step benchmark (issue 7): DCP size x context x batch bucket, Pallas and plain-XLA kernels,
host-supplied vs device-derived local lengths, stage breakdown, capacity. The same as `dcp-jax bench decode`.

Usage (repository root; --help lists every option):
  python bench/bench_decode.py --preset tiny --dcp 1,2 --contexts 256,1K --batches 1,8 --kernels reference \
      --steps 20 --out /tmp/decode.jsonl                      # CPU, 8 simulated devices
  PYTHONPATH=. python3 bench/bench_decode.py --dcp 2 --budget-s 300 --out $OUT/decode_w2.jsonl   # 2 GPUs
  python bench/bench_decode.py --report a.jsonl b.jsonl --img-dir docs/img     # merge runs: tables + plots
Method and GPU commands: docs/perf_decode.md. The measurement lives in dcp_jax/decode_bench.py.
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", category=DeprecationWarning)

from dcp_jax.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "decode", *sys.argv[1:]]))
