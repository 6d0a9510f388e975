"""Time the tiny retrieval model's training step (`train/loop.py`) at each stage's shape: the compile, the median
of timed steps, tokens per second and the device's peak memory so far, so a schedule can be sized to the issue's
20-minute budget.

  python bench/bench_train_step.py --stages dense:20:64:64,sparse:20:4096:4 --out /tmp/train_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="dense:20:64:128,dense:20:256:64,dense:20:1024:16,sparse:20:1024:16,"
                                            "dense:20:4096:4,sparse:20:4096:4,sparse:5:16384:1",
                        help="mode:timed_steps:context:batch, comma-separated")
    parser.add_argument("--out", default=None, help="a JSON file for the results")
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    from bench.common import run_info
    from dcp_jax.serving.tokenizer import ByteTokenizer
    from dcp_jax.train.loop import DSA_TINY, Trainer, batches, init_train_params
    from scripts.train_tiny import parse_stages

    info = run_info()
    cfg = DSA_TINY
    tokenizer = ByteTokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    trainer = Trainer(cfg, init_train_params(cfg, 0), learning_rate=1e-3, total_steps=1000)
    rows = []
    device = jax.devices()[0]
    print(f"{'mode':>6} {'context':>7} {'batch':>5} {'compile s':>9} {'step ms':>8} {'tokens/s':>10} {'peak GiB':>8}")
    for stage in parse_stages(args.stages):
        data = batches(tokenizer, np.random.default_rng(0), context=stage.context, batch=stage.batch)
        start = time.perf_counter()
        trainer.step(*next(data), stage.mode)  # compiles; the metrics' floats wait for the step
        compile_s = time.perf_counter() - start
        times = []
        for _ in range(stage.steps):
            tokens, mask = next(data)
            start = time.perf_counter()
            trainer.step(tokens, mask, stage.mode)
            times.append(time.perf_counter() - start)
        step_s = statistics.median(times)
        peak = (device.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30  # so far in the run (GPU only)
        rows.append(dict(mode=stage.mode, context=stage.context, batch=stage.batch, compile_s=compile_s,
                         step_ms=step_s * 1e3, tokens_per_s=stage.context * stage.batch / step_s, peak_gib=peak))
        print(f"{stage.mode:>6} {stage.context:>7} {stage.batch:>5} {compile_s:>9.1f} {step_s * 1e3:>8.1f} "
              f"{rows[-1]['tokens_per_s']:>10.0f} {peak:>8.1f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(run=info, devices=str(jax.devices()), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
