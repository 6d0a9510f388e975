"""Speculative decoding's verify step against a plain decode step (issue 27): the step a request runs with N
drafted tokens (N + 1 verify rows, the MTP layer over them and its N - 1 chained passes) and the plain decode step
(one row), per request at a batch and context, on the engine's own runner and programs (`load_model`, greedy). With
each draft kept with probability a (independently), a verify step emits (1 - a^(N+1)) / (1 - a) tokens, a plain one
1: drafting pays off above the acceptance rate where that equals t_verify / t_plain, printed with the times.

  python bench/bench_mtp.py --model tiny --batch 8 --context 1024 --out /tmp/mtp.json
  python bench/bench_mtp.py --model deepseek-v3.2 --num-layers 4 --batch 32 --context 16384   # an H200
  (add --quantization fp8 for the block-fp8 weights the release serves in)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens a verify step of `drafts` drafts emits when each is kept with probability `acceptance`."""
    return sum(acceptance ** i for i in range(drafts + 1))


def breakeven_acceptance(cost_ratio: float, drafts: int) -> float:
    """The acceptance rate at which a verify step costing `cost_ratio` plain steps emits as many tokens per unit of
    time (bisection; 1.0 when even full acceptance does not pay, 0.0 when a verify step costs no more than a plain
    one, so any acceptance pays)."""
    if expected_tokens(1.0, drafts) <= cost_ratio:
        return 1.0
    if cost_ratio <= 1.0:
        return 0.0
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if expected_tokens(middle, drafts) < cost_ratio else (low, middle)
    return (low + high) / 2


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
    from dcp_jax.config import QUANTIZATION_CHOICES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--dcp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--num-speculative-tokens", default="1,2,3", help="the draft counts N to time")
    parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="auto",
                        help="fp8: the preset's linear weights, the MTP layer's too, in DeepSeek's block fp8")
    parser.add_argument("--out", default=None, help="a JSON file for the results")
    args = parser.parse_args(argv)

    import numpy as np

    from bench.common import run_info
    from dcp_jax.host.sampling import SamplingParams
    from dcp_jax.host.step_plan import ScheduledRows
    from dcp_jax.serving.engine_args import EngineArgs
    from dcp_jax.serving.loading import load_model

    info = run_info()
    draft_counts = [int(n) for n in args.num_speculative_tokens.split(",")]
    room = 2 * max(draft_counts)  # the verify rows and the chained passes' after them
    results = {}
    for drafts in [0, *draft_counts]:
        spec = {"method": "mtp", "num_speculative_tokens": drafts} if drafts else None
        loaded = load_model(EngineArgs(model=args.model, dcp=args.dcp, num_layers=args.num_layers,
                                       max_num_seqs=args.batch, max_model_len=args.context + room,
                                       max_num_batched_tokens=(drafts + 1) * args.batch, speculative_config=spec,
                                       quantization=args.quantization))
        runner = loaded.runner
        blocks = runner.layout.virtual_blocks(args.context + room)
        if args.batch * blocks > runner.engine.num_pages:
            raise SystemExit(f"{args.batch} requests of {args.context} tokens need {args.batch * blocks} pages, the "
                             f"pool holds {runner.engine.num_pages}")
        tables = np.arange(args.batch * blocks, dtype=np.int32).reshape(args.batch, blocks)
        slots = list(range(args.batch))
        for slot in slots:
            runner.set_sampling(slot, SamplingParams(temperature=0), 0, args.context)
        lens = [args.context] * args.batch
        rows = (ScheduledRows.verify(slots, lens, [drafts] * args.batch, tables) if drafts
                else ScheduledRows.decode(slots, lens, tables))
        results[drafts] = step_seconds(runner, rows, args.steps)
        del loaded, runner
    plain = results[0]
    rows = []
    print(f"{info['device']}: {args.model} batch {args.batch}, context {args.context}, dcp {args.dcp}: plain step "
          f"{plain * 1e3:.2f} ms")
    for drafts in draft_counts:
        ratio = results[drafts] / plain
        row = dict(model=args.model, num_layers=args.num_layers, batch=args.batch, context=args.context,
                   dcp=args.dcp, num_speculative_tokens=drafts, plain_ms=plain * 1e3, verify_ms=results[drafts] * 1e3,
                   plain_ms_per_request=plain * 1e3 / args.batch,
                   verify_ms_per_request=results[drafts] * 1e3 / args.batch, cost_ratio=ratio,
                   breakeven_acceptance=breakeven_acceptance(ratio, drafts))
        rows.append(row)
        print(f"  N = {drafts}: verify step {row['verify_ms']:.2f} ms ({ratio:.2f}x); MTP pays off above an "
              f"acceptance rate of {row['breakeven_acceptance']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(run=info, args=vars(args), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
