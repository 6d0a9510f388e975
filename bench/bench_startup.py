"""Start-up against depth, and what compiling the layers once costs the decode step.

`compile`: the serving programs of a model (greedy and drawing, every bucket of the engine config) lowered and
compiled exactly as `Engine.warmup` does (`runtime.runner.compile_programs`), from abstract weights and device
state (nothing is allocated, so 61 layers of DeepSeek-V3.2 compile on any machine), for each layer count, with the
layers scanned (the default) and, for the counts in --unrolled-layers, unrolled (one copy a layer). Run it twice
with the same --compilation-cache-dir: the second run is a restart on the persistent compilation cache.

`step`: the real decode step (random weights, the KV pool filled with random values) timed with the layers scanned
and unrolled, beside the same-run copy rate; its rows' pages are the pool's last ones, so a pool past 2^31
elements (--num-pages) checks the kernels' offsets there: the Pallas step's tokens and logprobs against the
reference kernels' on the same state.

Usage (repository root; XLA_FLAGS apply to the whole run):
  PYTHONPATH=. python3 bench/bench_startup.py compile --layers 2 8 61 --unrolled-layers 2 8 \\
      --compilation-cache-dir $OUT/cache --out $OUT/startup.jsonl
  PYTHONPATH=. python3 bench/bench_startup.py step --layers 3 --batch 64 --context 4096 --out $OUT/step.jsonl
  python bench/bench_startup.py compile --preset tiny --layers 2 4 --unrolled-layers 2 4     # CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench.bench_decode import block_tables_for, decode_inputs, fill_random, time_steps  # noqa: E402
from bench.common import copy_tbps, run_info, throughput_seconds, warm_up_clocks  # noqa: E402
from dcp_jax.config import ONLINE_FP8_BLOCK, EngineConfig, ParallelConfig, preset, resolve_dtype  # noqa: E402
from dcp_jax.host.layout import DcpLayout  # noqa: E402
from dcp_jax.host.step_metadata import build_step_metadata  # noqa: E402
from dcp_jax.model import architecture  # noqa: E402
from dcp_jax.model.mesh import make_mesh  # noqa: E402
from dcp_jax.runtime import sampler  # noqa: E402
from dcp_jax.runtime.context import kernel_backend  # noqa: E402
from dcp_jax.runtime.forward import GREEDY, SAMPLED  # noqa: E402
from dcp_jax.runtime.runner import compile_programs, state_allocator, step_context, step_program  # noqa: E402
from dcp_jax.serving.engine_args import EngineArgs  # noqa: E402

# The engine arguments (`EngineArgs`) the benchmark takes; the pool and batch it sizes its programs for by default.
ENGINE_ARGUMENTS = ("dtype", "quantization", "kernels", "page_size", "num_pages", "max_num_seqs", "max_model_len",
                    "max_num_batched_tokens")
POOL_DEFAULTS = {"num_pages": 1024, "max_num_seqs": 64, "max_model_len": 8192}


def _model(args, layers: int):
    """(cfg, dtype, the fp8 block of the weights: quantization fp8 puts the preset's linear weights in DeepSeek's
    block fp8, as the release checkpoint; else None)."""
    cfg = preset(args.preset, num_layers=layers)
    return cfg, jnp.dtype(resolve_dtype(args.dtype, cfg)), ONLINE_FP8_BLOCK if args.quantization == "fp8" else None


def _weights(args) -> str:
    return "fp8" if args.quantization == "fp8" else "bf16"


def _engine(args, **overrides) -> EngineConfig:
    fields = dict(page_size=args.page_size, num_pages=args.num_pages, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens)
    return EngineConfig(**(fields | overrides))


def compile_startup(args, layers: int, unroll: bool) -> dict:
    """Lower and compile the engine's warm-up programs of a `layers`-deep model; seconds and program sizes."""
    cfg, dtype, block = _model(args, layers)
    parallel, engine = ParallelConfig(tp=1, dcp=1), _engine(args)
    mesh = make_mesh(parallel)
    ctx = step_context(cfg, parallel, engine, kernel_backend(args.kernels), dtype=dtype, fp8_block=block,
                       unroll_layers=unroll)
    steps = {kind.name: step_program(ctx, kind, parallel, engine, mesh) for kind in (GREEDY, SAMPLED)}
    params = steps[GREEDY.name].param_shapes(nnx.to_pure_dict(ctx.model.abstract))
    state = jax.eval_shape(state_allocator(cfg, parallel, engine, mesh, dtype))
    programs = [(kind.name, rows) for kind in (GREEDY, SAMPLED) for rows in engine.buckets]
    begin = time.perf_counter()
    compile_programs(steps, programs, params, state, workers=args.workers)
    seconds = time.perf_counter() - begin
    decode_rows = engine.max_num_seqs
    hlo = steps[GREEDY.name].compile(params, state, decode_rows).as_text()
    return dict(kind="compile", preset=args.preset, layers=layers, layers_mode="unrolled" if unroll else "scan",
                weights=_weights(args), programs=len(programs), buckets=list(engine.buckets), workers=args.workers,
                seconds=seconds, decode_hlo_chars=len(hlo), decode_rows=decode_rows,
                cache=bool(args.compilation_cache_dir))


def _filled_state(cfg, parallel, engine, mesh, dtype):
    state = state_allocator(cfg, parallel, engine, mesh, dtype)()
    return dataclasses.replace(state, kv_cache=fill_random(state.kv_cache, jax.random.key(1)))


def _pallas_matches_reference(args, cfg, dtype, block, host_params, inputs, md, engine, mesh, parallel) -> dict:
    """The Pallas step's greedy tokens and logprobs against the reference kernels', one state (same writes)."""
    out = {}
    state = None
    for kernels in ("pallas", "reference"):
        ctx = step_context(cfg, parallel, engine, kernels, dtype=dtype, fp8_block=block)
        step = step_program(ctx, GREEDY, parallel, engine, mesh)
        params = step.place_params(host_params)
        if state is None:
            state = _filled_state(cfg, parallel, engine, mesh, dtype)
        step.compile(params, state, args.batch)
        packed, state = step(params, state, inputs, md)
        out[kernels] = sampler.unpack(packed)
        del params, step
    same = float(np.mean(out["pallas"].tokens == out["reference"].tokens))
    gap = float(np.max(np.abs(out["pallas"].logprobs - out["reference"].logprobs)))
    return dict(same_tokens=same, max_logprob_gap=gap)


def decode_step(args) -> list[dict]:
    """The decode step with the layers scanned and unrolled (and optionally Pallas against the references)."""
    cfg, dtype, block = _model(args, args.layers)
    parallel = ParallelConfig(tp=1, dcp=1)
    blocks = -(-args.context // args.page_size)
    num_pages = max(args.num_pages, args.batch * blocks)
    engine = _engine(args, num_pages=num_pages, max_num_seqs=args.batch, max_model_len=args.context,
                     bucket_ladder=(args.batch,), max_num_batched_tokens=args.batch)
    mesh = make_mesh(parallel)
    host_params = architecture.of(cfg).model.init_params(cfg, args.seed, dtype, block)
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(host_params))
    warm_up_clocks()
    copy = copy_tbps(1 << 30, lambda fn, a: throughput_seconds(fn, a))
    first_page = num_pages - args.batch * blocks  # the rows' pages last: the pool's largest offsets
    tables = [[first_page + p for p in row] for row in
              block_tables_for(args.batch, args.context, dcp=1, page_size=args.page_size, max_blocks=blocks)]
    layout = DcpLayout(parallel.dcp, parallel.interleave, engine.page_size)
    md = build_step_metadata([args.context] * args.batch, [1] * args.batch, tables, rows=args.batch,
                             seqs=args.batch, layout=layout, max_blocks=blocks)
    rng = np.random.default_rng(args.seed)
    inputs = decode_inputs(rng.integers(0, cfg.vocab_size, args.batch).astype(np.int32), [args.context] * args.batch,
                           list(range(args.batch)), engine.max_num_seqs)
    common = dict(preset=args.preset, layers=args.layers, weights=_weights(args), dtype=str(dtype), batch=args.batch,
                  context=args.context, num_pages=num_pages, copy_tbps=copy, weight_bytes=weight_bytes,
                  weight_read_ms=1e3 * weight_bytes / (copy * 1e12), kernels=args.kernels)
    rows = []
    for unroll in (False, True):
        ctx = step_context(cfg, parallel, engine, kernel_backend(args.kernels), dtype=dtype, fp8_block=block,
                           unroll_layers=unroll)
        step = step_program(ctx, GREEDY, parallel, engine, mesh)
        params = step.place_params(host_params)
        state = _filled_state(cfg, parallel, engine, mesh, dtype)
        pools = state.kv_cache.pools
        pool_elements = {name: max(int(np.prod(leaf.shape[1:])) for leaf in jax.tree.leaves(pool))
                         for name, pool in pools.items()}
        begin = time.perf_counter()
        step.compile(params, state, args.batch)
        compile_s = time.perf_counter() - begin
        times, pipelined, device, compiles, state = time_steps(step, params, state, inputs, md, steps=args.steps,
                                                               warmup=args.warmup)
        rows.append(dict(common, kind="step", layers_mode="unrolled" if unroll else "scan", compile_s=compile_s,
                         median_ms=1e3 * float(np.median(times)), pipelined_ms=1e3 * pipelined,
                         device_ms=1e3 * device, recompiles=compiles, pool_elements_per_layer_fold=pool_elements,
                         pool_bytes={name: sum(a.nbytes // a.shape[0] for a in jax.tree.leaves(pool))
                                     for name, pool in pools.items()}))
        del params, state, step, pools
    if args.check_kernels:
        rows.append(dict(common, kind="kernels_check", **_pallas_matches_reference(
            args, cfg, dtype, block, host_params, inputs, md, engine, mesh, parallel)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    for name in ("compile", "step"):
        p = sub.add_parser(name)
        p.add_argument("--preset", default="deepseek-v3.2")
        EngineArgs.add_cli_args(p, only=ENGINE_ARGUMENTS, defaults=POOL_DEFAULTS)
        p.add_argument("--out", default=None, help="JSON lines output (appended)")
    c = sub.choices["compile"]
    c.add_argument("--layers", type=int, nargs="+", default=[2, 8, 61])
    c.add_argument("--unrolled-layers", type=int, nargs="*", default=[2, 8],
                   help="layer counts also compiled unrolled")
    c.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="compiles at once (Engine: one a core)")
    c.add_argument("--compilation-cache-dir", default=None, help="persistent compilation cache (run twice: restart)")
    s = sub.choices["step"]
    s.add_argument("--layers", type=int, default=3)
    s.add_argument("--batch", type=int, default=64)
    s.add_argument("--context", type=int, default=4096)
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--warmup", type=int, default=3)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--check-kernels", action="store_true", help="the Pallas step against the references")
    args = parser.parse_args(argv)
    if getattr(args, "compilation_cache_dir", None):
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    info = run_info()

    def record(row: dict) -> None:
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    record(info)
    if args.what == "compile":
        for layers in args.layers:
            for unroll in (False, True) if layers in args.unrolled_layers else (False,):
                record(compile_startup(args, layers, unroll))
    else:
        for row in decode_step(args):
            record(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
