"""Train the tiny DeepSeek-V3.2-architecture retrieval model (`train/loop.py`, issue 26): a dense stage (the main
model learns the task attending to everything; the indexer warms up toward its attention), then sparse stages at
growing contexts (the main model attends to the indexer's top-64 only). Writes the checkpoint (HF layout,
safetensors) and the loss log (`train_log.jsonl`, and `loss.png` with matplotlib) under --out.

  python scripts/train_tiny.py --out /tmp/dsa-tiny                      # the full schedule (an H200)
  python scripts/train_tiny.py --out /tmp/t --stages dense:20:128:4 --eval-every 10   # a smoke run (CPU)

A stage is mode:steps:context:batch (mode dense or sparse).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_STAGES = "dense:3000:512:32,sparse:1500:1024:16,sparse:1000:4096:4"


def parse_stages(text: str):
    from dcp_jax.train.forward import DENSE, SPARSE
    from dcp_jax.train.loop import Stage

    stages = []
    for part in text.split(","):
        fields = part.split(":")
        if len(fields) != 4 or fields[0] not in (DENSE, SPARSE) or not all(f.isdigit() and int(f) > 0
                                                                            for f in fields[1:]):
            raise argparse.ArgumentTypeError(f"a stage is mode:steps:context:batch (mode {DENSE} or {SPARSE}, "
                                             f"positive integers), got {part!r}")
        stages.append(Stage(fields[0], *map(int, fields[1:])))
    return stages


def plot(log: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in log]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, [row["lm"] for row in log], label="answer loss")
    ax.plot(steps, [row["indexer_kl"] for row in log], label="indexer KL")
    ax.plot(steps, [row["accuracy"] for row in log], label="batch accuracy")
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the checkpoint and the log")
    parser.add_argument("--stages", type=parse_stages, default=DEFAULT_STAGES)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--kl-weight", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=100)
    args = parser.parse_args(argv)

    import numpy as np

    from dcp_jax.model.deepseek_v32 import init_params
    from dcp_jax.model.weights import save_hf
    from dcp_jax.serving.tokenizer import ByteTokenizer
    from dcp_jax.train.loop import DSA_TINY, Trainer, batches

    cfg = DSA_TINY
    tokenizer = ByteTokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    trainer = Trainer(cfg, init_params(cfg, args.seed), learning_rate=args.learning_rate,
                      total_steps=sum(stage.steps for stage in args.stages), kl_weight=args.kl_weight)
    rng, eval_rng = np.random.default_rng(args.seed), np.random.default_rng(args.seed + 1)
    os.makedirs(args.out, exist_ok=True)
    log, step, begin = [], 0, time.perf_counter()
    with open(os.path.join(args.out, "train_log.jsonl"), "w") as out:
        for stage in args.stages:
            data = batches(tokenizer, rng, context=stage.context, batch=stage.batch)
            held_out = next(batches(tokenizer, eval_rng, context=stage.context, batch=stage.batch))
            for _ in range(stage.steps):
                metrics = trainer.step(*next(data), stage.mode)
                step += 1
                if step % args.eval_every == 0 or step == 1:
                    row = dict(step=step, mode=stage.mode, context=stage.context, seconds=time.perf_counter() - begin,
                               **metrics, held_out=trainer.evaluate(*held_out, stage.mode))
                    log.append(row)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(f"step {step} {stage.mode} {stage.context}: loss {metrics['lm']:.4f} kl "
                          f"{metrics['indexer_kl']:.4f} acc {metrics['accuracy']:.2f} held-out acc "
                          f"{row['held_out']['accuracy']:.2f} ({row['seconds']:.0f} s)", flush=True)
    save_hf(cfg, trainer.params, args.out)
    plot(log, os.path.join(args.out, "loss.png"))
    print(f"checkpoint in {args.out} after {step} steps, {time.perf_counter() - begin:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
