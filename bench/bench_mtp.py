"""Speculative decoding's verify step against a plain decode step (issue 27): the step a request runs with one
drafted token (two verify rows and the MTP layer) and the plain decode step (one row), per request at a batch and
context, on the engine's own runner and programs (`load_model`, greedy). A verify step emits 1 + a tokens for an
acceptance rate a, a plain one 1, so drafting pays off once a > t_verify / t_plain - 1: printed with the times.

  python bench/bench_mtp.py --model tiny --batch 8 --context 1024 --out /tmp/mtp.json
  python bench/bench_mtp.py --model deepseek-v3.2 --num-layers 4 --batch 32 --context 16384   # an H200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MTP = {"method": "mtp", "num_speculative_tokens": 1}


def step_seconds(runner, rows, steps: int) -> float:
    """The median wall time of `steps` greedy steps of `rows` (each dispatched and waited for)."""
    import jax

    from dcp_jax.runtime.forward import GREEDY

    jax.block_until_ready(runner.dispatch(rows, GREEDY))  # compiles
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(runner.dispatch(rows, GREEDY))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--dcp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="a JSON file for the results")
    args = parser.parse_args(argv)

    import numpy as np

    from bench.common import run_info
    from dcp_jax.host.metadata import ScheduledRows
    from dcp_jax.host.sampling import SamplingParams
    from dcp_jax.serving.loading import load_model

    info = run_info()
    results = {}
    for name, spec in (("plain", None), ("verify", MTP)):
        loaded = load_model(args.model, dcp=args.dcp, num_layers=args.num_layers, max_num_seqs=args.batch,
                            max_model_len=args.context + 2, max_num_batched_tokens=2 * args.batch,
                            speculative_config=spec)
        runner = loaded.runner
        blocks = runner.layout.virtual_blocks(args.context + 2)
        if args.batch * blocks > runner.engine.num_pages:
            raise SystemExit(f"{args.batch} requests of {args.context} tokens need {args.batch * blocks} pages, the "
                             f"pool holds {runner.engine.num_pages}")
        tables = np.arange(args.batch * blocks, dtype=np.int32).reshape(args.batch, blocks)
        slots = list(range(args.batch))
        for slot in slots:
            runner.set_sampling(slot, SamplingParams(temperature=0), 0, args.context)
        lens = [args.context] * args.batch
        rows = (ScheduledRows.verify(slots, lens, [1] * args.batch, tables) if spec
                else ScheduledRows.decode(slots, lens, tables))
        results[name] = step_seconds(runner, rows, args.steps)
        del loaded, runner
    breakeven = results["verify"] / results["plain"] - 1
    row = dict(model=args.model, num_layers=args.num_layers, batch=args.batch, context=args.context, dcp=args.dcp,
               plain_ms=results["plain"] * 1e3, verify_ms=results["verify"] * 1e3,
               plain_ms_per_request=results["plain"] * 1e3 / args.batch,
               verify_ms_per_request=results["verify"] * 1e3 / args.batch, breakeven_acceptance=breakeven)
    print(f"{info['device']}: {args.model} batch {args.batch}, context {args.context}, dcp {args.dcp}: plain step "
          f"{row['plain_ms']:.2f} ms, verify step (1 draft) {row['verify_ms']:.2f} ms; MTP pays off above an "
          f"acceptance rate of {breakeven:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(run=info, rows=[row]), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
