"""The engine's decode rate against its own bare device step, same run: what `LLM` / `serve` users get.

For each context L and batch B: B requests of L-token prompts go through `Engine.add_request` (real chunked prefill,
streams, detokenization, stop checks), and once every one has its first token the decode phase is timed until every one
decoded `--steps` more tokens: engine tok/s. Beside it, in the same process, the bucket's compiled serving decode
program alone, back to back on inputs placed once (`StepProgram.run_placed`): the bare device step. Both sample on the
device with the same parameters (greedy, or temperature 0.8 + top_p 0.9 + top_k 50). Host ms per step is the engine
loop's time per step (streams included) minus its wait for the device's tokens, with its phases' means (`StepClock`).
`dcp-jax bench engine` runs this file.

Usage (repository root):
  python bench/bench_engine.py --preset tiny --batches 1,4 --contexts 64 --steps 8 --out /tmp/engine.jsonl  # CPU
  python3 bench/bench_engine.py --out $OUT/engine.jsonl     # H200: DeepSeek-V3.2 shapes, 2 layers, bf16
  python3 bench/bench_engine.py --quantization fp8 --out $OUT/engine_fp8.jsonl   # the same, block-fp8 weights
  python3 bench/bench_engine.py --quantization fp8 --latent-cache fp8 --index-cache fp8 ...   # and fp8 caches
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import statistics
import sys
import tempfile
import time

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from bench.common import run_info
from bench.gpu_trace import busy_fraction, trace_events
from dcp_jax.host.sampling import SamplingParams
from dcp_jax.runtime.step import Placed
from dcp_jax.serving.engine_args import EngineArgs
from dcp_jax.serving.loading import use_cpu_devices

MODES = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8, top_p=0.9, top_k=50),
}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(p.lower().replace("k", "")) * (1024 if p.lower().endswith("k") else 1)
                 for p in text.split(",") if p)


# The host phases of an engine step that `StepClock` times, in order.
PHASES = ("schedule", "metadata", "launch", "wait", "apply", "emit")


class StepClock:
    """Wraps an engine's step: the wall time of every step and of its phases. schedule: the scheduler's plan;
    metadata: building, checking and transferring the programs' inputs; launch: the compiled calls; wait: for the
    device's tokens; apply: reading and recording them (detokenization, stop checks); emit: the streams' events.
    Host time is everything but the wait."""

    def __init__(self, engine):
        self.steps: list[dict[str, float]] = []  # per step: each phase's seconds and the total
        self._phases = dict.fromkeys(PHASES, 0.0)
        core, runner = engine.core, engine.runner

        def timed(obj, name, phase, exclusive_of=()):
            real = getattr(obj, name)

            def call(*args, **kwargs):
                inner = sum(self._phases[p] for p in exclusive_of)
                begin = time.perf_counter()
                try:
                    return real(*args, **kwargs)
                finally:
                    spent = time.perf_counter() - begin
                    self._phases[phase] += spent - (sum(self._phases[p] for p in exclusive_of) - inner)

            setattr(obj, name, call)

        for step in runner.steps.values():
            timed(step, "run_placed", "launch")
        timed(core.scheduler, "schedule", "schedule")
        timed(runner, "dispatch", "metadata", exclusive_of=("launch",))
        real_read = core._read

        def read(dispatched):
            begin = time.perf_counter()
            for d in dispatched:
                jax.block_until_ready(d.outputs)
            self._phases["wait"] += time.perf_counter() - begin
            begin = time.perf_counter()
            out = real_read(dispatched)
            self._phases["apply"] += time.perf_counter() - begin
            return out

        core._read = read
        timed(engine, "_emit", "emit")
        real_step = engine.step

        def step():
            self._phases = dict.fromkeys(PHASES, 0.0)
            begin = time.perf_counter()
            real_step()
            self.steps.append(dict(self._phases, total=time.perf_counter() - begin))

        engine.step = step


class BatchedSink:
    """The client side as the server has it (`streams.LoopSink`): `put` (the engine thread) collects a step's
    events, `flush` hands them over at once (one wake-up of the reader a step, not one per event)."""

    def __init__(self):
        self._batches: queue.Queue = queue.Queue()
        self._batch: list = []

    def put(self, event) -> None:
        self._batch.append(event)

    def flush(self) -> None:
        batch, self._batch = self._batch, []
        if batch:
            self._batches.put(batch)

    def get_batch(self, timeout: float) -> list:
        return self._batches.get(timeout=timeout)

    def drain(self) -> None:
        """Drop the batches handed over so far."""
        while not self._batches.empty():
            self._batches.get_nowait()


def run_point(engine, clock: StepClock, batch: int, context: int, steps: int, mode: str, rng,
              trace_dir: str | None = None) -> dict:
    """B requests of `context`-token prompts through the engine, decoding from when the last one had its first
    token (its prefill done; the first ones decode while the last ones prefill) until every one decoded `steps`
    more: the tokens of that window, its time, and the index of the point's first engine step. The requests are
    aborted after the window (each could decode on). With `trace_dir`, a profiler trace of the window is written
    there. Events reach the client a step at a time, as the server's do (`BatchedSink`)."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=engine.engine_config.max_model_len - context + 1, ignore_eos=True,
                            seed=None, **MODES[mode])
    sink = BatchedSink()
    ids = [engine.add_request(rng.integers(2, vocab, context - 1).tolist(), params, sink) for _ in range(batch)]
    started = set()
    while len(started) < batch:  # every request's first token: its prefill is done
        started.update(event.request_id for event in sink.get_batch(timeout=3600) if event.token_ids)
    sink.drain()  # tokens of steps before the window
    if trace_dir:
        jax.profiler.start_trace(trace_dir)
    # Counted from the first step after every request had its first token (that step's tokens included).
    first_step, start, counts = len(clock.steps), time.perf_counter(), dict.fromkeys(ids, 0)
    short = batch
    while short:
        for event in sink.get_batch(timeout=3600):
            assert event.finish_reason is None, event
            before = counts[event.request_id]
            counts[event.request_id] = before + len(event.token_ids)
            short -= before < steps <= counts[event.request_id]
    decode_s, window = time.perf_counter() - start, (first_step, len(clock.steps))
    if trace_dir:
        jax.profiler.stop_trace()
    for request_id in ids:
        engine.abort(request_id)
    finished = set()
    while len(finished) < batch:
        finished.update(event.request_id for event in sink.get_batch(timeout=3600) if event.finish_reason)
    return dict(tokens=sum(counts.values()), decode_s=decode_s, window=window)


def device_busy(engine, clock: StepClock, batch: int, context: int, steps: int, mode: str, rng) -> dict:
    """A second run of the point under the profiler: how busy the device was while the engine decoded (the union
    of its kernels over the span; 1.0: never idle) and its longest idle gap."""
    with tempfile.TemporaryDirectory() as trace_dir:
        run_point(engine, clock, batch, context, steps, mode, rng, trace_dir=trace_dir)
        busy, span_ms, gap_ms = busy_fraction(trace_events(trace_dir))
    return dict(device_busy=busy, traced_span_ms=span_ms, longest_idle_ms=gap_ms)


def bare_step_seconds(runner, batch: int, context: int, mode: str, repeats: int) -> float:
    """The serving program of bucket `batch` alone, back to back on placed inputs (B decode rows of `context`)."""
    from dcp_jax.host.sampling_metadata import SamplingTable
    from dcp_jax.host.step_plan import ScheduledRows, build_step
    from dcp_jax.runtime.runner import step_kind

    params = SamplingParams(**MODES[mode])
    step = runner.program(step_kind([params], prompt_logprobs=False))
    layout = runner.layout
    blocks = int(layout.virtual_blocks(context + 1))
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    table = SamplingTable(runner.scratch_slot + 1, scratch_slot=runner.scratch_slot,
                          eos_token_id=runner.cfg.eos_token_id)
    for slot in range(batch):
        table.set(slot, params, slot, context)
    inputs, md = build_step(ScheduledRows.decode(list(range(batch)), [context] * batch, tables,
                                                 tokens=np.full(batch, 7, np.int32)),
                            bucket=batch, seqs=runner.engine.seqs_for(batch), layout=layout,
                            max_blocks=runner.max_blocks, table=table)
    packed = step.pack_inputs(inputs, md)
    placed = Placed(packed.bucket, jax.device_put(packed.packed, NamedSharding(step.mesh, PartitionSpec())))
    state = runner.state
    for _ in range(3):
        out, state = step.run_placed(runner.params, state, placed)
    jax.block_until_ready((out, state))
    begin = time.perf_counter()
    for _ in range(repeats):
        out, state = step.run_placed(runner.params, state, placed)
    jax.block_until_ready((out, state))
    runner.state = state
    return (time.perf_counter() - begin) / repeats


def workspace(runner) -> str:
    """Each compiled serving program's temp bytes beside the pool's (a temp near a pool layer's size is a copy)."""
    pool = sum(a.nbytes for a in jax.tree.leaves(runner.state.kv_cache))
    parts = []
    for kind_name, rows in runner.programs():
        compiled = runner.steps[kind_name].compile(runner.params, runner.state, rows)
        parts.append(f"{kind_name} {rows}: {compiled.memory_analysis().temp_size_in_bytes / 2**30:.2f} GiB")
    return f"{'; '.join(parts)}; pool {pool / 2**30:.2f} GiB"


# The engine arguments (`EngineArgs`) the benchmark takes, their one default each.
ENGINE_ARGUMENTS = ("dtype", "kernels", "quantization", "kv_cache_dtype", "latent_cache", "index_cache", "page_size",
                    "gpu_memory_utilization", "dcp", "max_num_batched_tokens", "async_scheduling",
                    "compilation_cache_dir")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `dcp-jax bench engine`: the grid, the engine's own (`ENGINE_ARGUMENTS`), the pool."""
    parser.add_argument("--preset", default="deepseek-v3.2")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--batches", type=_ints, default=(1, 8, 64, 256))
    parser.add_argument("--contexts", type=_ints, default=(4096, 32768))
    parser.add_argument("--modes", default="greedy,sampled")
    parser.add_argument("--steps", type=int, default=64, help="decode tokens per request")
    EngineArgs.add_cli_args(parser, only=ENGINE_ARGUMENTS)
    parser.add_argument("--num-pages", type=int, default=None,
                        help="KV pages (default: the largest batch of full-length requests; 0: from GPU memory)")
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--trace-steps", type=int, default=0,
                        help="also run each point for this many decode tokens under the profiler: device busy share")
    parser.add_argument("--out", default="results_engine.jsonl")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcp-jax bench engine", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    use_cpu_devices(args.cpu_devices)
    from dcp_jax.serving.engine import Engine

    modes = [m for m in args.modes.split(",") if m]
    info = dict(run_info(), kind="run", args=vars(args))
    out = open(args.out, "w")  # a row per point as it is measured: a run cut short keeps what it measured

    def record(row: dict) -> None:
        out.write(json.dumps(row, default=str) + "\n")
        out.flush()

    record(info)
    engine_args = EngineArgs.from_cli_args(args)
    print(f"{info['device']} x{info['num_devices']}, commit {info['commit']}, {args.preset} "
          f"{args.num_layers} layers {args.dtype}, {engine_args.index_cache_format} index cache, "
          f"{engine_args.latent_cache_format} latent cache, dcp {args.dcp}", flush=True)
    print(f"| L | B | mode | engine tok/s | bare step ms | bare tok/s | ratio | host ms/step | "
          f"mean ms: {' / '.join(PHASES)} | steps | device busy |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rng = np.random.default_rng(0)
    for context in args.contexts:
        # The first requests decode while the last ones prefill: at most a token a step of that phase.
        prefill_steps = -(-max(args.batches) * context // args.max_num_batched_tokens) + max(args.batches)
        max_len = context + prefill_steps + 2 * args.steps
        num_pages = (max(args.batches) * -(-max_len // (args.page_size * args.dcp)) if args.num_pages is None
                     else args.num_pages or None)
        point_args = dataclasses.replace(
            engine_args, model=args.preset, num_layers=args.num_layers, num_pages=num_pages,
            max_num_seqs=max(args.batches), bucket_ladder=args.batches, max_model_len=max_len,
            max_num_batched_tokens=max(args.max_num_batched_tokens, max(args.batches)))
        engine = Engine(**vars(point_args), prompt_logprobs=False, progress=False).start()
        clock = StepClock(engine)
        print(f"L={context}: {engine.num_pages} KV pages; programs' workspace (temp) / pool bytes: "
              f"{workspace(engine.runner)}", flush=True)
        try:
            for batch in args.batches:
                for mode in modes:
                    point = run_point(engine, clock, batch, context, args.steps, mode, rng)
                    steps = clock.steps[slice(*point["window"])]
                    host = [st["total"] - st["wait"] for st in steps]
                    phases = {p: 1e3 * statistics.mean(st[p] for st in steps) for p in PHASES}
                    traced = (device_busy(engine, clock, batch, context, args.trace_steps, mode, rng)
                              if args.trace_steps else {})
                    engine.stop()  # the bare step uses the runner's state: no engine step may run meanwhile
                    bare = bare_step_seconds(engine.runner, batch, context, mode, repeats=20)
                    engine.start()
                    tok_s = point["tokens"] / point["decode_s"]
                    row = dict(kind="point", context=context, batch=batch, mode=mode, engine_tokens_per_s=tok_s,
                               bare_step_ms=1e3 * bare, bare_tokens_per_s=batch / bare,
                               ratio=tok_s * bare / batch, host_ms_per_step=1e3 * statistics.median(host),
                               phase_ms=phases, steps=len(steps), host_ms_max=1e3 * max(host),
                               wait_ms=[1e3 * st["wait"] for st in steps],
                               compiles_after_warmup=engine.compiles_after_warmup,
                               index_cache=engine.engine_config.index_cache,
                               latent_cache=engine.engine_config.latent_cache, **traced)
                    record(row)
                    print(f"| {context} | {batch} | {mode} | {tok_s:.0f} | {1e3 * bare:.3f} | {batch / bare:.0f} | "
                          f"{row['ratio']:.2f} | {row['host_ms_per_step']:.3f} | "
                          f"{' / '.join(f'{phases[p]:.2f}' for p in PHASES)} | {len(steps)} | "
                          f"{traced.get('device_busy', float('nan')):.2f} |", flush=True)
            print(f"L={context}: compiles after warm-up: {engine.compiles_after_warmup}", flush=True)
        finally:
            engine.stop()
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
