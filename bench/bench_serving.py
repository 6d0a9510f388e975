"""Serving benchmark: a concurrency (or request-rate) sweep against the OpenAI-compatible server.

Random token-id prompts of --input-len tokens ask for exactly --output-len tokens (ignore_eos, streaming). Per level
it prints TTFT and TPOT (mean, p50, p99), request and output-token throughput; the table goes to
docs/serving_bench.json and a plot to docs/img/serving_bench.png. Without --url it starts the embedded tiny model
with DCP over simulated CPU devices on loopback. Bounded: --num-prompts requests per level, loopback only.

    .venv/bin/python bench/bench_serving.py --concurrency 1,4,16,64 --num-prompts 64
    .venv/bin/python bench/bench_serving.py --url http://127.0.0.1:8000 --rate 2,8,inf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, str(REPO))


async def one(client, model, prompt, output_len):
    start = time.perf_counter()
    first, n = None, 0
    stream = await client.completions.create(model=model, prompt=[prompt], max_tokens=output_len, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    end = time.perf_counter()
    return first - start, (end - first) / max(n - 1, 1), end - start, n


async def level(url, model, prompts, output_len, concurrency, rate):
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    rnd = random.Random(0)

    async def guarded(p):
        async with gate:
            return await one(client, model, p, output_len)

    tasks, start = [], time.perf_counter()
    for p in prompts:
        tasks.append(asyncio.create_task(guarded(p)))
        if rate != float("inf"):
            await asyncio.sleep(rnd.expovariate(rate))
    results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    await client.close()
    ttft = sorted(r[0] for r in results)
    tpot = sorted(r[1] for r in results)
    tokens = sum(r[3] for r in results)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return dict(concurrency=concurrency, rate=rate, requests=len(results), wall_s=wall,
                ttft_mean_ms=1e3 * statistics.mean(ttft), ttft_p50_ms=1e3 * pct(ttft, 0.5),
                ttft_p99_ms=1e3 * pct(ttft, 0.99), tpot_mean_ms=1e3 * statistics.mean(tpot),
                tpot_p50_ms=1e3 * pct(tpot, 0.5), tpot_p99_ms=1e3 * pct(tpot, 0.99),
                req_per_s=len(results) / wall, output_tok_per_s=tokens / wall)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start the tiny model here)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated max in-flight requests")
    ap.add_argument("--rate", default="inf", help="comma-separated request rates (req/s, Poisson); inf = all at once")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dcp", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--out", default=str(REPO / "docs" / "serving_bench.json"))
    ap.add_argument("--plot", default=str(REPO / "docs" / "img" / "serving_bench.png"))
    args = ap.parse_args(argv)
    server = None
    url = args.url
    if url is None:
        from dcp_jax.serving.engine import Engine
        from dcp_jax.serving.loading import use_cpu_devices
        from dcp_jax.serving.server import OpenAIServer

        use_cpu_devices(8)
        engine = Engine(args.model, dcp=args.dcp, interleave=1, page_size=8, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.input_len + args.output_len + 8, bucket_ladder=(1, 2, 4, 8, 16, 32, 64),
                        prompt_logprobs=False)
        server = OpenAIServer(engine, port=0, access_log=False).start()
        url = server.url
    rnd = random.Random(0)
    prompts = [[rnd.randrange(3, 500) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    rows = []
    print(f"{'conc':>5} {'rate':>6} {'TTFT ms':>9} {'p99':>8} {'TPOT ms':>8} {'p99':>8} {'req/s':>7} {'tok/s':>8}")
    try:
        for c in [int(x) for x in args.concurrency.split(",")]:
            for r in [float(x) for x in args.rate.split(",")]:
                row = asyncio.run(level(url, args.model, prompts, args.output_len, c, r))
                rows.append(row)
                print(f"{c:>5} {r:>6} {row['ttft_mean_ms']:>9.1f} {row['ttft_p99_ms']:>8.1f} "
                      f"{row['tpot_mean_ms']:>8.2f} {row['tpot_p99_ms']:>8.2f} {row['req_per_s']:>7.2f} "
                      f"{row['output_tok_per_s']:>8.1f}", flush=True)
    finally:
        if server is not None:
            server.stop()
    setup = dict(vars(args), url=None if server else url)
    pathlib.Path(args.out).write_text(json.dumps({"setup": setup, "results": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return 0
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    xs = [row["concurrency"] for row in rows]
    axes[0].plot(xs, [row["output_tok_per_s"] for row in rows], "o-")
    axes[0].set(title="output throughput", xlabel="concurrency", ylabel="tokens/s", xscale="log")
    axes[1].plot(xs, [row["ttft_mean_ms"] for row in rows], "o-", label="mean")
    axes[1].plot(xs, [row["ttft_p99_ms"] for row in rows], "s--", label="p99")
    axes[1].set(title="TTFT", xlabel="concurrency", ylabel="ms", xscale="log")
    axes[1].legend()
    axes[2].plot(xs, [row["tpot_mean_ms"] for row in rows], "o-", label="mean")
    axes[2].plot(xs, [row["tpot_p99_ms"] for row in rows], "s--", label="p99")
    axes[2].set(title="TPOT", xlabel="concurrency", ylabel="ms", xscale="log")
    axes[2].legend()
    fig.suptitle(f"dcp-jax serving, {args.model}, dcp={args.dcp}, in={args.input_len} out={args.output_len}")
    fig.tight_layout()
    pathlib.Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
