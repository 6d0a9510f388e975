"""Train the tiny DeepSeek-V3.2-architecture retrieval model (`train/loop.py`, issue 26): a dense stage (the main
model learns the task attending to everything; the indexer warms up toward its attention), then sparse stages at
growing contexts (the main model attends to the indexer's top-64 only). Writes the checkpoint (HF layout,
safetensors) and the loss log (`train_log.jsonl`, and `loss.png` with matplotlib) under --out. With
--max-seconds a run stops in time (a device call's limit) and leaves its state there; --resume goes on from it.
A finished run then measures its retrieval accuracy (`train/evaluate.evaluate_checkpoint`: served, and teacher forced
with the indexer's and a random selection) into eval.json. --index-cache / --latent-cache fp8 train through the fp8
caches' rounding (quantization-aware training: what those caches serve).

  python scripts/train_tiny.py --out /tmp/dsa-tiny                      # the full schedule (an H200)
  python scripts/train_tiny.py --out /tmp/t --stages dense:20:128:4 --eval-every 10   # a smoke run (CPU)

A stage is mode:steps:context:batch[:queries|mixed] (mode dense or sparse; queries per training example, 1 by
default; mixed: each example's number of records drawn uniformly, queries filling the rest (`mixed_example`); the
held-out batch a stage reports is the evaluation's format: the most records and one query).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIXED = "mixed"  # a stage's fifth field for mixed examples

# Mixed examples (records drawn uniformly, queries filling the rest) of 256 tokens first: on an H200 the circuit
# formed within 2,000 such steps where 64-token one-query examples learned to tell 2 records apart but not 4
# (docs/training.md); then the indexer's dense warm-up at 1K, and sparse stages up to the 16K of the evaluation.
DEFAULT_STAGES = ("dense:2500:256:32:mixed,dense:800:1024:8:mixed,sparse:1500:1024:16:mixed,sparse:1000:4096:4:mixed,"
                  "sparse:300:16384:1:mixed")


def parse_stages(text: str):
    from dcp_jax.train.forward import DENSE, SPARSE
    from dcp_jax.train.loop import Stage

    stages = []
    for part in text.split(","):
        fields = part.split(":")
        mixed = len(fields) == 5 and fields[4] == MIXED
        numbers = fields[1:4] if mixed else fields[1:]
        if len(fields) not in (4, 5) or fields[0] not in (DENSE, SPARSE) or not all(
                f.isdigit() and int(f) > 0 for f in numbers):
            raise argparse.ArgumentTypeError(f"a stage is mode:steps:context:batch[:queries|{MIXED}] (mode {DENSE} or "
                                             f"{SPARSE}, positive integers), got {part!r}")
        stages.append(Stage(fields[0], *map(int, numbers), mixed=mixed))
    return stages


# A step or evaluation this long is reported: a compile (the first batch of a shape), or something to look at.
SLOW_STEP_S = 5.0


def slow_step(what: str, started: float) -> None:
    seconds = time.perf_counter() - started
    if seconds > SLOW_STEP_S:
        print(f"{what} took {seconds:.1f} s (a compile, or the first run of a shape)", flush=True)


def plot(log: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in log]
    fig, (losses, rates) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    losses.plot(steps, [row["lm"] for row in log], label="answer loss")
    losses.plot(steps, [row["indexer_kl"] for row in log], label="indexer KL")
    rates.plot(steps, [row["held_out"]["accuracy"] for row in log], label="held-out accuracy (evaluation format)")
    if "mtp_lm" in log[0]:
        losses.plot(steps, [row["mtp_lm"] for row in log], label="MTP answer loss")
        rates.plot(steps, [row["mtp_acceptance"] for row in log], label="MTP acceptance (value digits)")
    for before, row in zip(log, log[1:]):  # stage boundaries: the attention mode or the context changes
        if (before["mode"], before["context"]) != (row["mode"], row["context"]):
            for ax in (losses, rates):
                ax.axvline(row["step"], color="grey", linewidth=0.5)
            rates.text(row["step"], 0.02, f" {row['mode']} {row['context']}", fontsize=7, rotation=90, va="bottom")
    losses.set_yscale("log")
    losses.legend()
    rates.set_ylim(0, 1.05)
    rates.set_xlabel("step")
    rates.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def initial_params_from(cfg, path: str) -> dict:
    """A checkpoint's weights as the trainer's f32 params ({"model", "mtp"}); SystemExit unless its architecture is
    `cfg`'s."""
    import jax
    import jax.numpy as jnp

    from dcp_jax.model.architecture import config_from_hf
    from dcp_jax.model.weights import load_hf_params, load_mtp_params

    saved = config_from_hf(path)
    if dataclasses.replace(saved, torch_dtype=cfg.torch_dtype) != cfg:
        raise SystemExit(f"--init-from: {path} holds another architecture than the one trained here")
    return {"model": load_hf_params(cfg, path, quantization="none"),  # f32 params to train, fp8 dequantized
            "mtp": jax.tree.map(jnp.asarray, load_mtp_params(cfg, path, quantization="none"))}


def main(argv=None) -> int:
    from dcp_jax.config import INDEX_CACHE_FORMATS, LATENT_CACHE_FORMATS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the checkpoint and the log")
    parser.add_argument("--stages", type=parse_stages, default=DEFAULT_STAGES)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--kl-weight", type=float, default=1.0)
    parser.add_argument("--mtp-weight", type=float, default=None, help="the MTP loss's weight (default DeepSeek-V3's "
                                                                        "0.3)")
    parser.add_argument("--chat-fraction", type=float, default=0.25,
                        help="the share of batches whose prompts are wrapped in the chat template")
    parser.add_argument("--save-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the checkpoint's tensors (and its torch_dtype, the dtype it serves in by default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="start no step after this long in this call (one at least), saving the state to resume "
                             "from")
    parser.add_argument("--resume", action="store_true", help="go on from the state a stopped run left in --out")
    parser.add_argument("--init-from", default=None,
                        help="start from this checkpoint's weights (a trained dsa-tiny, with its MTP layer) instead of "
                             "random ones; the optimizer starts afresh on --stages")
    parser.add_argument("--index-cache", choices=INDEX_CACHE_FORMATS, default="exact",
                        help="train through this index-key cache's rounding (fp8: quantization-aware training)")
    parser.add_argument("--latent-cache", choices=LATENT_CACHE_FORMATS, default="exact",
                        help="train through this latent cache's rounding (fp8: quantization-aware training)")
    parser.add_argument("--eval-contexts", default="1024,4096,16384",
                        help="after training, the served accuracy (LLM, greedy) at these prompt lengths ('' none)")
    parser.add_argument("--eval-examples", type=int, default=100)
    args = parser.parse_args(argv)

    import numpy as np

    from dcp_jax.model.weights import save_hf
    from dcp_jax.serving.chat_template import PLAIN_CHAT_TEMPLATE
    from dcp_jax.serving.tokenizer import ByteTokenizer
    from dcp_jax.model.architecture import config_to_hf
    from dcp_jax.model.attention.variant import CacheFormats
    from dcp_jax.train.loop import DSA_TINY, MTP_WEIGHT, Trainer, batches, init_train_params

    cfg = DSA_TINY
    mtp_weight = MTP_WEIGHT if args.mtp_weight is None else args.mtp_weight
    tokenizer = ByteTokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    total = sum(stage.steps for stage in args.stages)
    if args.init_from and not args.resume:  # a resumed run reads its own state
        params = initial_params_from(cfg, args.init_from)
    else:
        params = init_train_params(cfg, args.seed)
    caches = CacheFormats(index=args.index_cache, latent=args.latent_cache)
    trainer = Trainer(cfg, params, learning_rate=args.learning_rate, total_steps=total, kl_weight=args.kl_weight,
                      mtp_weight=mtp_weight, caches=caches)
    os.makedirs(args.out, exist_ok=True)
    run = dict(model=config_to_hf(cfg), stages=[vars(stage) for stage in args.stages],
               learning_rate=args.learning_rate, kl_weight=args.kl_weight, mtp_weight=mtp_weight,
               chat_fraction=args.chat_fraction, seed=args.seed, init_from=args.init_from, caches=caches._asdict())
    rng, step, spent = np.random.default_rng(args.seed), 0, 0.0
    state_path = os.path.join(args.out, "train_state.npz")
    if args.resume:
        saved = trainer.load_state(state_path)
        if saved["run"] != json.loads(json.dumps(run)):
            raise SystemExit(f"--resume: {args.out} holds a run of {saved['run']}, not {run}")
        rng.bit_generator.state, step, spent = saved["rng"], saved["step"], saved["seconds"]
    begin, first, steps_this_call = time.perf_counter() - spent, 0, 0
    with open(os.path.join(args.out, "train_log.jsonl"), "a" if args.resume else "w") as out:
        for index, stage in enumerate(args.stages):
            end = first + stage.steps
            if step < end:
                data = batches(tokenizer, rng, context=stage.context, batch=stage.batch, queries=stage.queries,
                               mixed=stage.mixed, chat_fraction=args.chat_fraction)
                held_out = next(batches(tokenizer, np.random.default_rng([args.seed, 1, index]),
                                        context=stage.context, batch=stage.batch))
            while step < end:
                if (args.max_seconds is not None and steps_this_call
                        and time.perf_counter() - begin - spent > args.max_seconds):
                    break  # checked before a step: none starts (or compiles) past the deadline but the first
                started = time.perf_counter()
                metrics = trainer.step(*next(data), stage.mode)
                step, steps_this_call = step + 1, steps_this_call + 1
                slow_step(f"step {step} ({stage.mode} {stage.context})", started)
                if step % args.eval_every == 0 or step == 1:
                    started = time.perf_counter()
                    held_out_metrics = trainer.evaluate(*held_out, stage.mode)
                    slow_step(f"held-out evaluation at step {step}", started)
                    row = dict(step=step, mode=stage.mode, context=stage.context, seconds=time.perf_counter() - begin,
                               **metrics, held_out=held_out_metrics)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    mtp = (f" mtp loss {metrics['mtp_lm']:.4f} acceptance {metrics['mtp_acceptance']:.2f}"
                           if "mtp_lm" in metrics else "")
                    print(f"step {step} {stage.mode} {stage.context}: loss {metrics['lm']:.4f} kl "
                          f"{metrics['indexer_kl']:.4f} acc {metrics['accuracy']:.2f} held-out acc "
                          f"{row['held_out']['accuracy']:.2f}{mtp} ({row['seconds']:.0f} s)", flush=True)
            if step < end:
                break
            first = end
    trainer.save_state(state_path, dict(run=run, step=step, rng=rng.bit_generator.state,
                                        seconds=time.perf_counter() - begin))
    if step < total:
        print(f"stopped at step {step} of {total} after {time.perf_counter() - begin:.0f} s in all; go on with "
              f"--resume")
        return 0
    saved_cfg = dataclasses.replace(cfg, torch_dtype=args.save_dtype)
    save_hf(saved_cfg, trainer.params["model"], args.out, mtp=trainer.params.get("mtp"))
    with open(os.path.join(args.out, "chat_template.jinja"), "w") as f:  # the chat batches' format
        f.write(PLAIN_CHAT_TEMPLATE)
    with open(os.path.join(args.out, "train_log.jsonl")) as f:
        plot([json.loads(line) for line in f], os.path.join(args.out, "loss.png"))
    print(f"checkpoint in {args.out} after {step} steps, {time.perf_counter() - begin:.0f} s in all")
    contexts = [int(c) for c in args.eval_contexts.split(",") if c]
    if contexts:
        from dcp_jax.train.evaluate import evaluate_checkpoint

        # Seed 1's prompts: training draws from seed 0's stream.
        accuracy = evaluate_checkpoint(args.out, contexts=contexts, examples=args.eval_examples, seed=1)
        with open(os.path.join(args.out, "eval.json"), "w") as f:
            json.dump(dict(examples=args.eval_examples, seed=1, accuracy=accuracy), f)
        for name, per_context in accuracy.items():
            print(f"{name} accuracy: " + ", ".join(f"{c} tokens {a:.3f}" for c, a in per_context.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
