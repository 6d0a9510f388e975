"""Long-context prefill through the engine: time to first token against the prefill's compute roofline, and the
inter-token latency of running decodes while a long prompt prefills, same run.

TTFT: one request of an L-token prompt (max_tokens 1) through `Engine.add_request` (chunked prefill under the token
budget, the sparse DCP data flow per query token, sampling on the device), from its arrival to its first token,
median of `--repeats` after a warm-up request. The roofline beside it is the prefill's FLOPs at the same-run bf16
matmul rate (`bench.common.matmul_tflops`): the dense projections and MLP of every token, the indexer's scores of
every causal (query, key) pair, sparse MLA over min(K, position + 1) keys per query (`prefill_flops`).
Mixed load: `--decodes` requests decode (short prompts, long max_tokens); their inter-token latency (the wall time
between consecutive steps that gave each of them a token) is measured alone (`--itl-tokens` tokens each), then
while one `--mixed-context` prompt prefills, each under the token budget `--mixed-budget` (the chunk a step takes
next to the decode rows).
`dcp-jax bench prefill` runs this file.

Usage (repository root):
  python bench/bench_prefill.py --preset tiny --contexts 256 --decodes 2 --mixed-context 256 --out /tmp/p.jsonl  # CPU
  python3 bench/bench_prefill.py --out $OUT/prefill.jsonl     # H200: DeepSeek-V3.2 shapes, 2 layers, bf16
  python3 bench/bench_prefill.py --contexts 32768 --decodes 0 --index-cache fp8 --out $OUT/p.jsonl  # fp8 index keys
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import statistics
import sys
import time

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from bench.common import median_seconds, run_info
from dcp_jax.config import ModelConfig, preset
from dcp_jax.host.sampling import SamplingParams
from dcp_jax.serving.engine_args import EngineArgs
from dcp_jax.serving.loading import use_cpu_devices

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(p.lower().replace("k", "")) * (1024 if p.lower().endswith("k") else 1)
                 for p in text.split(",") if p)


def prefill_flops(cfg: ModelConfig, tokens: int) -> dict[str, float]:
    """FLOPs of prefilling `tokens` prompt tokens (2 per multiply-add): dense (every weight matrix of every layer
    applied to every token, absorbed MLA as the step computes it, the MoE's activated experts), indexer (every
    causal (query, key) pair over the index heads) and sparse MLA (each query over its min(K, position + 1)
    selected latents, scores and values, every head)."""
    d, h, c, e = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v, q_rank = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    attention = (d * q_rank + q_rank * h * (nope + e) + d * (c + e)  # q_a, q_b, kv_a
                 + h * nope * c + h * c * v + h * v * d  # absorbed W_UK, W_UV, o_proj
                 + q_rank * cfg.indexer.heads * cfg.indexer.head_dim + d * cfg.indexer.head_dim + d * cfg.indexer.heads)
    dense = 0
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(layer):
            width = cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)
            dense += attention + 3 * d * width + d * cfg.n_routed_experts
        else:
            dense += attention + 3 * d * cfg.intermediate_size
    positions = np.arange(tokens, dtype=np.float64)
    pairs = float((positions + 1).sum())  # causal (query, key) pairs
    selected = float(np.minimum(positions + 1, cfg.indexer.topk).sum())
    layers = cfg.num_hidden_layers
    return dict(dense=2.0 * tokens * dense,
                indexer=2.0 * pairs * cfg.indexer.heads * cfg.indexer.head_dim * layers,
                attention=2.0 * selected * h * ((c + e) + c) * layers)


def time_to_first_token(engine, prompt: list[int]) -> float:
    """Seconds from adding a one-token request of `prompt` to its first event."""
    sink = queue.Queue()
    begin = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, **GREEDY), sink)
    event = sink.get(timeout=3600)
    elapsed = time.perf_counter() - begin
    while event.finish_reason is None:
        event = sink.get(timeout=3600)
    return elapsed


def inter_token_latencies(engine, sinks: list[queue.Queue], *, tokens: int | None = None, until=None) -> list[float]:
    """Seconds between consecutive events of the decoding requests of `sinks`, until each gave `tokens` more tokens
    (or until `until()` holds)."""
    last, gaps, counts = [None] * len(sinks), [], [0] * len(sinks)
    while not (until and until()) and not (tokens is not None and min(counts) >= tokens):
        for i, sink in enumerate(sinks):
            while True:
                try:
                    event = sink.get_nowait()
                except queue.Empty:
                    break
                now = time.perf_counter()
                if last[i] is not None and event.token_ids:
                    gaps.append(now - last[i])
                last[i] = now
                counts[i] += len(event.token_ids)
        time.sleep(0.0002)
    return gaps


def summary_ms(gaps: list[float]) -> dict[str, float]:
    """Count, median, p90 and max of `gaps` in ms (NaN when there are none)."""
    gaps = sorted(gaps)
    if not gaps:
        return dict(n=0, median_ms=float("nan"), p90_ms=float("nan"), max_ms=float("nan"))
    return dict(n=len(gaps), median_ms=1e3 * statistics.median(gaps), p90_ms=1e3 * gaps[int(0.9 * (len(gaps) - 1))],
                max_ms=1e3 * gaps[-1])


# The engine arguments (`EngineArgs`) the benchmark takes, their one default each.
ENGINE_ARGUMENTS = ("dtype", "kernels", "quantization", "kv_cache_dtype", "latent_cache", "index_cache", "page_size",
                    "gpu_memory_utilization", "dcp", "max_num_batched_tokens")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `dcp-jax bench prefill`: the loads, the engine's own (`ENGINE_ARGUMENTS`)."""
    parser.add_argument("--preset", default="deepseek-v3.2")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--contexts", type=_ints, default=(4096, 32768, 131072), help="TTFT prompt lengths")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--buckets", type=_ints, default=(1, 32, 512, 2048),
                        help="step widths compiled (with max_num_seqs and the budget)")
    parser.add_argument("--decodes", type=int, default=32, help="decoding requests of the mixed load (0: skip it)")
    parser.add_argument("--mixed-context", type=_ints, default=(131072,), help="the prompt prefilled meanwhile")
    parser.add_argument("--mixed-budget", type=int, default=None,
                        help="token budget of the mixed load's steps (default --max-num-batched-tokens)")
    parser.add_argument("--itl-tokens", type=int, default=500,
                        help="decode-only window of the mixed load: tokens each decoding request gives")
    EngineArgs.add_cli_args(parser, only=ENGINE_ARGUMENTS)
    parser.add_argument("--matmul-size", type=int, default=8192, help="n of the n x n x n bf16 matmul ceiling")
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--out", default="results_prefill.jsonl")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="trace one more TTFT of the last context and print the N kernels of most device time")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcp-jax bench prefill", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    use_cpu_devices(args.cpu_devices)
    import jax

    from bench.common import matmul_tflops
    from dcp_jax.serving.engine import Engine

    out = open(args.out, "w")

    def record(row: dict) -> None:
        out.write(json.dumps(row, default=str) + "\n")
        out.flush()

    info = dict(run_info(), kind="run", args=vars(args))
    record(info)
    cfg = preset(args.preset, num_layers=args.num_layers)
    tflops = matmul_tflops(lambda fn, sets: median_seconds(fn, sets, 10, sync=jax.block_until_ready),
                           n=args.matmul_size)
    record(dict(kind="ceiling", matmul_tflops=tflops))
    engine_args = EngineArgs.from_cli_args(args)
    print(f"{info['device']} x{info['num_devices']}, commit {info['commit']}, {args.preset} {args.num_layers} layers "
          f"{args.dtype}, {args.quantization} weights, {engine_args.index_cache_format} index / "
          f"{engine_args.latent_cache_format} latent cache, dcp {args.dcp}; same-run bf16 matmul {tflops:.0f} TFLOP/s",
          flush=True)
    rng = np.random.default_rng(0)
    budget = args.max_num_batched_tokens
    mixed_budget = args.mixed_budget or budget
    longest = max(args.contexts + (args.mixed_context if args.decodes else ()))
    max_num_seqs = max(args.decodes + 1, 2)
    # The decoding requests run through the window and every step of the mixed prefills (a token each).
    mixed_steps = sum(-(-c // max(mixed_budget - args.decodes, 1)) for c in args.mixed_context)
    max_model_len = max(longest, 16 + args.itl_tokens + mixed_steps) + 64

    def engine_of(max_num_batched_tokens: int):
        load_args = dataclasses.replace(
            engine_args, model=args.preset, num_layers=args.num_layers, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, bucket_ladder=tuple(b for b in args.buckets if b <= max_num_batched_tokens),
            max_num_batched_tokens=max_num_batched_tokens)
        return Engine(**vars(load_args), prompt_logprobs=False, progress=False)

    begin = time.perf_counter()
    engine = engine_of(budget).start()
    print(f"engine: {engine.num_programs} programs in {time.perf_counter() - begin:.0f} s, buckets "
          f"{engine.engine_config.buckets}, {engine.num_pages} KV pages", flush=True)
    try:
        time_to_first_token(engine, rng.integers(2, cfg.vocab_size, 64).tolist())  # warm-up
        print("| prompt tokens | TTFT ms | roofline ms (dense / indexer / attention) | TTFT / roofline |", flush=True)
        print("|---|---|---|---|", flush=True)
        for context in args.contexts:
            ttfts = [time_to_first_token(engine, rng.integers(2, cfg.vocab_size, context).tolist())
                     for _ in range(args.repeats)]
            flops = prefill_flops(cfg, context)
            roof = {k: 1e3 * f / (tflops * 1e12) for k, f in flops.items()}
            ttft = 1e3 * statistics.median(ttfts)
            record(dict(kind="ttft", context=context, ttft_ms=ttft, ttfts_ms=[1e3 * t for t in ttfts],
                        flops=flops, roofline_ms=sum(roof.values()), budget=budget,
                        index_cache=engine.engine_config.index_cache, latent_cache=engine.engine_config.latent_cache,
                        compiles_after_warmup=engine.compiles_after_warmup))
            print(f"| {context} | {ttft:.1f} | {sum(roof.values()):.1f} ({roof['dense']:.1f} / {roof['indexer']:.1f}"
                  f" / {roof['attention']:.1f}) | {ttft / sum(roof.values()):.2f} |", flush=True)
        if args.profile:
            profile(engine, rng.integers(2, cfg.vocab_size, args.contexts[-1]).tolist(), args.profile, record)
        if args.decodes:
            if mixed_budget != budget:
                engine.stop()
                engine = engine_of(mixed_budget).start()
            mixed(engine, args, cfg, rng, record)
        print(f"compiles after warm-up: {engine.compiles_after_warmup}", flush=True)
    finally:
        engine.stop()
        out.close()
    return 0


def profile(engine, prompt: list[int], top: int, record) -> None:
    """Device time by kernel over one TTFT of `prompt` (a profiler trace): the `top` kernels of most time."""
    import tempfile

    import jax

    from bench.common import kernel_durations_us
    from bench.gpu_trace import trace_events
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            ttft = time_to_first_token(engine, prompt)
        durations = kernel_durations_us(trace_events(trace_dir), line_prefix="Stream", name_chars=60)
    totals = sorted(((sum(d), len(d), name) for name, d in durations.items()), reverse=True)
    busy = sum(t for t, _, _ in totals)
    record(dict(kind="profile", context=len(prompt), ttft_ms=1e3 * ttft, busy_ms=busy / 1e3,
                kernels=[dict(name=n, total_ms=t / 1e3, calls=c) for t, c, n in totals]))
    print(f"profile of one {len(prompt)}-token TTFT (traced {1e3 * ttft:.1f} ms): kernels busy {busy / 1e3:.1f} ms",
          flush=True)
    print("| kernel | device ms | share | calls |\n|---|---|---|---|", flush=True)
    for total, calls, name in totals[:top]:
        print(f"| {name} | {total / 1e3:.2f} | {total / busy:.1%} | {calls} |", flush=True)


def mixed(engine, args, cfg, rng, record) -> None:
    """ITL of `--decodes` decoding requests alone, then while each `--mixed-context` prompt prefills."""
    sinks = [queue.Queue() for _ in range(args.decodes)]
    prompt_len = 16
    longest = SamplingParams(max_tokens=engine.engine_config.max_model_len - prompt_len, **GREEDY)
    for sink in sinks:
        engine.add_request(rng.integers(2, cfg.vocab_size, prompt_len).tolist(), longest, sink)
    for sink in sinks:  # every decode running
        sink.get(timeout=3600)
    alone = summary_ms(inter_token_latencies(engine, sinks, tokens=args.itl_tokens))
    print("| decodes | budget | prompt | ITL alone median / p90 / max ms | ITL during its prefill median / p90 / "
          "max ms | prefill s |", flush=True)
    print("|---|---|---|---|---|---|", flush=True)
    for context in args.mixed_context:
        long = queue.Queue()
        begin = time.perf_counter()
        engine.add_request(rng.integers(2, cfg.vocab_size, context).tolist(), SamplingParams(max_tokens=1, **GREEDY),
                           long)
        during = summary_ms(inter_token_latencies(engine, sinks, until=lambda: not long.empty()))
        prefill_s = time.perf_counter() - begin
        record(dict(kind="mixed", decodes=args.decodes, budget=engine.engine_config.max_num_batched_tokens,
                    context=context, itl_alone=alone, itl_during_prefill=during, prefill_s=prefill_s,
                    compiles_after_warmup=engine.compiles_after_warmup))
        print(f"| {args.decodes} | {engine.engine_config.max_num_batched_tokens} | {context} | "
              f"{alone['median_ms']:.2f} / {alone['p90_ms']:.2f} / {alone['max_ms']:.2f} | "
              f"{during['median_ms']:.2f} / {during['p90_ms']:.2f} / {during['max_ms']:.2f} | {prefill_s:.2f} |",
              flush=True)
    for sink in sinks:
        while not sink.empty():
            sink.get_nowait()


if __name__ == "__main__":
    sys.exit(main())
