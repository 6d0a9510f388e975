"""Sharded decode-step benchmark: DCP size x context x batch bucket, Pallas and plain-XLA kernels, host-supplied vs
device-derived local lengths, stage breakdown, capacity. `dcp-jax bench decode` runs this file.

Usage (repository root; --help lists every option):
  python bench/bench_decode.py --preset tiny --dcp 1,2 --contexts 256,1K --batches 1,8 --kernels reference \
      --steps 20 --out /tmp/decode.jsonl                      # CPU, 8 simulated devices
  PYTHONPATH=. python3 bench/bench_decode.py --dcp 2 --budget-s 300 --out $OUT/decode_w2.jsonl   # 2 GPUs
  python bench/bench_decode.py --report a.jsonl b.jsonl --img-dir docs/img     # merge runs: tables + plots
  PYTHONPATH=. python3 bench/bench_decode.py --num-layers 4 --dcp 1 --kernels pallas --no-fallback \
      --breakdown-batches none --profile --out $OUT/profile.jsonl     # the step against its roofline, by kernel
Method and GPU commands: docs/perf_decode.md.

For every DCP size W (TP = W, one DCP group) x kernels ('pallas' / 'reference') x batch bucket B x context L it
builds the engine's own greedy decode program (`runtime.runner.step_program`: random weights of a preset, the
runner's device state with its KV pools filled with random latents and index keys in the grid's cache formats,
host-built metadata), compiles each bucket once, and times it after warm-up inside `jax.no_tracing()` with a
compile counter: step latency, pipelined steps and the program alone (`time_steps`). Beside it, the same program
with another attention variant in its step context (`StepContext.attention`), same pool and same metadata:
- `tbo` (`--tbo`): the same step with two-batch overlap (each layer's attention as two micro-batches);
- `fallback`: every layer re-derives the local lengths on device from the global ones (`DerivedLengths`,
  `runtime.jaxpr_check.local_context_lens_on_device`) - the failure mode the design forbids;
- stage-isolating variants `through_<stage>` (see `STAGES`, `StagedAttention`; DSA presets): each layer runs the
  attention data flow of `attention/sparse_dcp.py` only up to that stage (the rest of the layer as it is), and the
  per-stage time is the difference of consecutive variants.
A dense-MLA preset (`deepseek-r1`, `kimi-k2`: `attention/dense_dcp.py`) runs the host, TBO and fallback variants.
With `--profile`, each host step's point also gets its roofline and the device time of a profiler trace of a few
steps by kernel category (`step_profile.py`; the step-efficiency table). DeepSeek-V3.2's first three layers are
dense, so `--num-layers 3` is three dense layers and `--num-layers 4` adds one MoE layer (GLM-5.2's fourth layer is
an IndexShare "shared" one: `--preset glm-5.2 --num-layers 4` mixes three full layers with one that reuses their
selection; its stage variants are refused, they cut the full layers' data flow).
Tables, plots and target checks: `decode_results.py`; see docs/perf_decode.md for the method.
Letters: see the legend in `dcp_jax/__init__.py` (here B is the batch of decode rows, the bucket R).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels
from bench import step_profile
from bench.common import CompileCounter, hlo_op_counts, run_info as common_run_info, sizes as parse_sizes
from bench.decode_results import STAGES, report
from dcp_jax.config import (EngineConfig, ModelConfig, ParallelConfig, check_index_cache, check_latent_cache, preset,
                            resolve_dtype)
from dcp_jax.host.sampling_metadata import SamplingTable
from dcp_jax.host.step_inputs import FED_BACK, StepInputs, build_step_inputs
from dcp_jax.host.step_metadata import build_step_metadata
from dcp_jax.model import architecture, fp8_linear, mxfp4
from dcp_jax.model.attention import cache_formats, mla_dcp, sparse_dcp
from dcp_jax.model.kv_cache import KVCache, cache_pools, pool_layers
from dcp_jax.model.memory_plan import FP8_BLOCK
from dcp_jax.model.mesh import DCP, make_mesh
from dcp_jax.runtime.context import StepContext, kernel_backend
from dcp_jax.runtime.forward import GREEDY, DeviceState
from dcp_jax.runtime import sampler
from dcp_jax.runtime.jaxpr_check import local_context_lens_on_device
from dcp_jax.runtime.runner import state_allocator, step_context, step_program
from dcp_jax.runtime.step import Placed, StepProgram
from dcp_jax.serving.engine_args import EngineArgs
from dcp_jax.serving.loading import use_cpu_devices
from pallas_kernels import Fp8IndexKeys, Fp8LatentCache, formats
from pallas_kernels.formats import quantize_mxfp4

# A truncated layer adds this times the per-row mean of its dangling outputs to the residual stream, so XLA cannot
# drop the work and the next layer depends on this one, as in the real step; small enough to keep values tame.
SINK_SCALE = 1e-3


def _row_mean(x):
    """Per-row mean of the finite entries of x [R, ...] as f32 [R] (-inf logits and -1 ids are fine)."""
    x = x.astype(jnp.float32)
    return jnp.mean(jnp.where(jnp.isfinite(x), x, 0.0).reshape(x.shape[0], -1), axis=1)


def attention_through(p, x, pools, rope, md, *, ctx: StepContext, through: str):
    """Stages 1..`through` of `attention.sparse_dcp.sparse_dcp_attention` (its own stage functions), per rank.

    Returns (residual update [R, D], pools): the attention output for through="merge", else SINK_SCALE times the
    row means of every value computed and not yet consumed (so nothing is dead code); "base" computes nothing.
    """
    if through not in STAGES:
        raise ValueError(f"unknown stage {through!r}; choose from {STAGES}")
    cfg, backend = ctx.cfg, ctx.backend
    if through == "base":
        return jnp.zeros_like(x), pools
    queries, latent, index_k = sparse_dcp.project_and_write(p, x, pools["latent"], pools["index_k"], rope,
                                                            md.slot_mapping, cfg=cfg, backend=backend)
    pools = dict(pools, latent=latent, index_k=index_k)

    def sunk(*values, has_dangling_query=True):
        """q_nope and q_pe are consumed only in step 6; until then they dangle too."""
        values = values + ((queries.q_nope, queries.q_pe) if has_dangling_query else ())
        sink = sum(_row_mean(v) for v in values)
        return jnp.broadcast_to((SINK_SCALE * sink)[:, None], x.shape).astype(x.dtype), pools

    if through == "projections":
        return sunk(queries.index_q, queries.index_weights)
    if through == "indexer":
        q, weights = cache_formats.encode_index_queries(queries.index_q, queries.index_weights, index_k)
        return sunk(pallas_kernels.indexer_logits(q, weights, index_k, mla_dcp.row_block_tables(md),
                                                  md.local_context_lens, backend=backend))
    values, local_ids = sparse_dcp.local_top_k(queries, index_k, md, cfg=cfg, backend=backend)
    if through == "topk":
        return sunk(values, local_ids)
    _, owned_slots, counts = sparse_dcp.select_owned(values, local_ids, md, cfg=cfg, layout=ctx.layout)
    if through == "exchange":
        return sunk(owned_slots, counts)
    out, lse = sparse_dcp.attend(p, queries.q_nope, queries.q_pe, latent, owned_slots, counts, cfg=cfg,
                                 backend=backend)
    if through == "sparse_mla":
        return sunk(out, lse, has_dangling_query=False)
    return mla_dcp.merge_heads(p, out, lse, x.dtype, backend=backend), pools


class StagedAttention(sparse_dcp.SparseMla):
    """DSA's attention cut after stage `through` (`attention_through`): the sink of what it left dangling as the
    layer's attention output; no row's selection is kept (-1)."""

    def __init__(self, through: str):
        if through not in STAGES:
            raise ValueError(f"unknown stage {through!r}; choose from {STAGES}")
        self.through = through

    def attend(self, p, x, pools, rope, mds, *, ctx, selection):
        update, pools = attention_through(p, x, pools, rope, mds["latent"], ctx=ctx, through=self.through)
        return update, pools, jnp.full((x.shape[0], ctx.cfg.indexer.topk), -1, jnp.int32)


class DerivedLengths:
    """The forbidden variant's step: a layer's own attention variant with its local lengths re-derived on device
    from the global ones (what a captured graph recorded in the engine this project ports)."""

    def __init__(self, variant):
        self.variant = variant

    def attend(self, p, x, pools, rope, mds, *, ctx, selection):
        derived = local_context_lens_on_device(mds["latent"].context_lens, jax.lax.axis_index(DCP),
                                               dcp=ctx.layout.dcp_size, interleave=ctx.layout.interleave)
        mds = {name: md._replace(local_context_lens=derived) for name, md in mds.items()}
        return self.variant.attend(p, x, pools, rope, mds, ctx=ctx, selection=selection)


def variant_context(ctx: StepContext, variant: str) -> StepContext:
    """The step context of one variant: 'host' (the engine's), 'tbo' (two-batch overlap), 'fallback'
    (`DerivedLengths`) or 'through_<stage>' (`StagedAttention`)."""
    if variant == "host":
        return ctx
    if variant == "tbo":
        return dataclasses.replace(ctx, micro_batches=2)
    if variant == "fallback":
        return dataclasses.replace(ctx, attention=DerivedLengths)
    if variant.startswith("through_"):
        if any(ctx.cfg.shares_index_selection(layer) for layer in range(ctx.cfg.num_hidden_layers)):
            raise ValueError(f"variant {variant!r} cuts the full DSA layers' data flow; {ctx.cfg.architecture} has "
                             f"IndexShare layers (run host, tbo or fallback)")
        staged = StagedAttention(variant[len("through_"):])
        return dataclasses.replace(ctx, attention=lambda layer_variant: staged)
    raise ValueError(f"unknown variant {variant!r}")


def decode_inputs(tokens: np.ndarray, context_lens, slots, scratch_slot: int) -> StepInputs:
    """Greedy inputs of a decode step feeding `tokens` (the bucket's rows; the first len(context_lens) scheduled)."""
    rows, n = len(tokens), len(context_lens)
    return build_step_inputs(slots, [1] * n, np.asarray(tokens[:n], np.int32), [FED_BACK] * n, [-1] * n, [False] * n,
                             [True] * n, context_lens=context_lens, rows=rows, seqs=rows,
                             table=SamplingTable(scratch_slot + 1, scratch_slot=scratch_slot, eos_token_id=None))


@dataclasses.dataclass(frozen=True)
class Grid:
    """One benchmark run. `batches` are the bucket ladder (each one compiled program); contexts are global
    lengths L (every row of a point has length L); the KV pool holds max(batches) rows of max(contexts)."""

    preset: str = "deepseek-v3.2"
    num_layers: int | None = 2
    dcp_sizes: tuple[int, ...] = (1, 2, 4, 8)
    contexts: tuple[int, ...] = (4096, 16384, 65536, 131072)
    batches: tuple[int, ...] = (1, 8, 32, 64)
    kernels: tuple[str, ...] = ("pallas", "reference")
    breakdown_batches: tuple[int, ...] = (32,)
    steps: int = 20
    warmup: int = 3
    page_size: int = 64
    interleave: int = 1
    dtype: str = "bfloat16"
    # The preset's random weights: "plain" (in dtype), "fp8" (the linear ones block fp8, `--quantization fp8`) or
    # "mxfp4" (the routed experts MXFP4, as an AMD Quark checkpoint keeps them); channel_fp8: the linear ones but
    # the experts per-channel fp8 (`--quantization ptpc_fp8`, with plain or mxfp4).
    weight_format: str = "plain"
    channel_fp8: bool = False
    index_cache: str = "exact"
    latent_cache: str = "exact"
    fallback: bool = True
    tbo: bool = False
    expert_parallel: bool = False
    device_memory_gb: float | None = None
    seed: int = 0
    # `--profile`: the step-efficiency profile of each host step (`step_profile`), its trace over profile_steps
    # steps, its rates over a copy of copy_bytes and a bf16 matmul of matmul_size^3.
    profile: bool = False
    profile_steps: int = 5
    copy_bytes: int = 2 << 30
    matmul_size: int = 8192

    def __post_init__(self):
        check_index_cache(self.index_cache)
        check_latent_cache(self.latent_cache)
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}; got {self.weight_format!r}")
        if self.channel_fp8 and self.weight_format == "fp8":
            raise ValueError("ptpc_fp8 quantizes unquantized linear weights: not with block fp8 ones")

    @property
    def cfg(self) -> ModelConfig:
        return preset(self.preset, num_layers=self.num_layers)

    def engine(self, dcp: int) -> EngineConfig:
        max_len = max(self.contexts)
        blocks = -(-max_len // (self.page_size * dcp))
        return EngineConfig(page_size=self.page_size, num_pages=max(self.batches) * blocks,
                            max_num_seqs=max(self.batches), max_model_len=max_len,
                            bucket_ladder=tuple(sorted(set(self.batches))), max_num_batched_tokens=max(self.batches),
                            index_cache=self.index_cache, latent_cache=self.latent_cache)

    def variants(self, batch: int) -> tuple[str, ...]:
        out = ("host",) + (("tbo",) if self.tbo else ()) + (("fallback",) if self.fallback else ())
        cfg = self.cfg
        all_full = cfg.indexer is not None and not any(map(cfg.shares_index_selection, range(cfg.num_hidden_layers)))
        if batch in self.breakdown_batches and all_full:  # DSA's stages; dense MLA and IndexShare have none
            out += tuple(f"through_{s}" for s in STAGES[:-1])  # through the last stage is the host step
        return out


def _normal_like(pool, key):
    """N(0, 1) entries of pool's shape; fp8 index keys and latents hold N(0, 1) values as the decode step writes
    them."""
    if isinstance(pool, Fp8IndexKeys):
        return formats.quantize_index_keys(jax.random.normal(key, pool.keys.shape))
    if isinstance(pool, Fp8LatentCache):
        shape = (*pool.latent.shape[:-1], pool.latent.shape[-1] + pool.rope.shape[-1])
        return formats.quantize_latent_cache(jax.random.normal(key, shape), value_dim=pool.latent.shape[-1])
    return jax.random.normal(key, pool.shape, pool.dtype)


def fill_random(cache: KVCache, key) -> KVCache:
    """Replace every pool entry with N(0, 1) values (latents and index keys are normed, so about unit scale), in
    place on each rank's shard; donates `cache`."""

    def fill(pool, k):
        return jax.jit(_normal_like, donate_argnums=0,
                       out_shardings=jax.tree.map(lambda a: a.sharding, pool))(pool, k)

    keys = jax.random.split(key, len(cache.pools))
    return KVCache({name: fill(pool, k) for (name, pool), k in zip(cache.pools.items(), keys)})


def block_tables_for(batch: int, context: int, *, dcp: int, page_size: int, max_blocks: int) -> list[list[int]]:
    """Row i owns pages [i * max_blocks, ...): disjoint, as the page allocator would hand them out."""
    needed = -(-context // (page_size * dcp))
    return [list(range(i * max_blocks, i * max_blocks + needed)) for i in range(batch)]


def _bytes_per_token(cfg: ModelConfig, itemsize: int, index_cache: str, latent_cache: str) -> tuple[int, int]:
    """(latent, index-K) bytes of one cached token in one layer, in the named formats (index-K 0 for dense MLA)."""
    pools = {pool.name: pool for pool in cache_pools(cfg, EngineConfig(index_cache=index_cache,
                                                                       latent_cache=latent_cache))}
    index_k = pools.get("index_k")
    return pools["latent"].token_bytes(itemsize), index_k.token_bytes(itemsize) if index_k else 0


def kv_bytes_used(cfg: ModelConfig, *, batch: int, context: int, dcp: int, page_size: int, itemsize: int,
                  index_cache: str, latent_cache: str):
    """(latent, index-K) bytes of one rank's pages holding `batch` rows of `context` tokens (whole pages), the
    index keys in format `index_cache`, the latents in format `latent_cache`."""
    tokens = batch * -(-context // (page_size * dcp)) * page_size
    latent_bytes, index_bytes = _bytes_per_token(cfg, itemsize, index_cache, latent_cache)
    return tokens * _entries(cfg, "latent") * latent_bytes, tokens * _entries(cfg, "index_k") * index_bytes


def _entries(cfg: ModelConfig, pool: str) -> int:
    """The decoder layers with an entry in `pool` (IndexShare's shared layers keep no index key)."""
    return len(pool_layers(cfg, pool, cfg.num_hidden_layers))


def _is_consumed(kv_cache: KVCache) -> bool:
    """Whether a call that took the pool as a donated argument deleted it."""
    return any(a.is_deleted() for a in jax.tree.leaves(kv_cache))


def device_memory(grid: Grid) -> tuple[int, str]:
    """(bytes one device may hold, where the number comes from)."""
    if grid.device_memory_gb is not None:
        return int(grid.device_memory_gb * 2**30), "option"
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), "memory_stats"
    return int(139 * 2**30), "assumed H200 (139 GiB)"


def max_tokens(cfg: ModelConfig, *, dcp: int, memory: int, weights: int, workspace: int, itemsize: int,
               index_cache: str, latent_cache: str) -> int:
    """Global KV tokens (summed over rows) that fit: each rank keeps 1/W of them, beside its weights and the
    step's workspace (the compiled program's temp bytes); index keys in format `index_cache`, latents in format
    `latent_cache`."""
    latent_bytes, index_bytes = _bytes_per_token(cfg, itemsize, index_cache, latent_cache)
    per_token = _entries(cfg, "latent") * latent_bytes + _entries(cfg, "index_k") * index_bytes
    return max(0, (memory - weights - workspace) * dcp // per_token)


def _percentile(sorted_values: list[float], q: float) -> float:
    return float(np.percentile(sorted_values, q))


def time_steps(step: StepProgram, params, state, inputs, md, *, steps: int, warmup: int):
    """Warm up, then three loops of `steps` calls, inside jax.no_tracing() and a compile counter:
    1. latency: each call (host validation + one transfer + the compiled program) waited for with
       block_until_ready - what one step costs a caller that waits for its result;
    2. pipelined: the same calls back to back, one wait at the end - host work overlaps the device, so this is
       max(host, device) per step;
    3. device: the program alone, back to back on inputs packed and placed once - the device's step time plus a
       dispatch.
    Returns (latency times_s, pipelined_s, device_s, compiles, the device state)."""
    for _ in range(warmup):
        out, state = step(params, state, inputs, md)
        jax.block_until_ready((out, state))
    times = []
    counter = CompileCounter()
    with jax.no_tracing(), counter.active():
        for _ in range(steps):
            begin = time.perf_counter()
            out, state = step(params, state, inputs, md)
            jax.block_until_ready((out, state))
            times.append(time.perf_counter() - begin)
        begin = time.perf_counter()
        for _ in range(steps):
            out, state = step(params, state, inputs, md)
        jax.block_until_ready((out, state))
        pipelined = (time.perf_counter() - begin) / steps
        placed = place_inputs(step, inputs, md)
        begin = time.perf_counter()
        for _ in range(steps):
            out, state = step.run_placed(params, state, placed)
        jax.block_until_ready((out, state))
        device = (time.perf_counter() - begin) / steps
    out = np.asarray(out)  # the real step's packed tokens, or a staged variant's logits
    if not np.all(np.isfinite(sampler.unpack(out).logprobs if out.dtype == np.int32 else out)):
        raise FloatingPointError("non-finite logprobs or logits")
    return times, pipelined, device, counter.count, state


def place_inputs(step: StepProgram, inputs, md) -> Placed:
    """The step's inputs packed and placed once, for back-to-back `StepProgram.run_placed` calls."""
    packed = step.pack_inputs(inputs, md)
    placed = Placed(packed.bucket, jax.device_put(packed.packed, NamedSharding(step.mesh, P())))
    jax.block_until_ready(placed.packed)
    return placed


def profile_point(step: StepProgram, params, state, inputs, md, *, grid: Grid, batch: int, context: int,
                  dcp: int, ceilings: tuple[float, float], device_s: float) -> tuple[dict, DeviceState]:
    """The `step_profile` fields of one host step's point: its roofline at the same-run rates `ceilings` (copy
    TB/s, matmul TFLOP/s), the ratio of its device step time `device_s` to that, and the kernel time of
    `grid.profile_steps` traced steps of the program alone. Returns (fields, the device state after them)."""
    cfg = grid.cfg
    latent_bytes, index_bytes = _bytes_per_token(cfg, jnp.dtype(grid.dtype).itemsize, grid.index_cache,
                                                  grid.latent_cache)
    roofline = step_profile.roofline(cfg, params, batch=batch, context=context, dcp=dcp,
                                     latent_token_bytes=latent_bytes, index_token_bytes=index_bytes,
                                     copy_tbps=ceilings[0], matmul_tflops=ceilings[1])
    placed = place_inputs(step, inputs, md)

    def run_step():
        nonlocal state
        out, state = step.run_placed(params, state, placed)
        return out, state

    kernels = step_profile.traced_kernel_time(run_step, calls=grid.profile_steps, ranks=dcp)
    moe_layers = sum(cfg.is_moe_layer(layer) for layer in range(cfg.num_hidden_layers))
    return dict(roofline.as_row(), roofline_ratio=1e3 * device_s / roofline.ms, **kernels, moe_layers=moe_layers,
                profile_steps=grid.profile_steps), state


def run_info(grid: Grid) -> dict:
    return dict(common_run_info(), kind="run", grid=dataclasses.asdict(grid))


def plan(grid: Grid) -> tuple[list[int], list[str]]:
    """DCP sizes that this machine and the model allow, and a note for each one left out."""
    cfg, devices, notes, sizes = grid.cfg, len(jax.devices()), [], []
    for w in grid.dcp_sizes:
        if w > devices:
            notes.append(f"dcp={w} skipped: {devices} device(s)")
            continue
        try:
            architecture.of(cfg).model.check_divisible(cfg, w, expert_parallel=grid.expert_parallel)
        except ValueError as error:
            notes.append(f"dcp={w} skipped: {error}")
            continue
        sizes.append(w)
    return sizes, notes


def num_points(grid: Grid, sizes: list[int]) -> int:
    """Progress ticks: one per timed point, plus one per DCP size for its compile phase."""
    points = len(grid.kernels) * sum(len(grid.variants(b)) for b in grid.batches) * len(grid.contexts)
    return len(sizes) * (points + 1)


def work_items(grid: Grid) -> list[tuple[int, str, str]]:
    """(batch, kernels, variant) in the order they run for each DCP size: every host step first, then the TBO
    ones, the fallbacks, then the stage variants, so a --budget-s cut drops the least important ones."""
    items = [(b, k, "host") for b in grid.batches for k in grid.kernels]
    if grid.tbo:
        items += [(b, k, "tbo") for b in grid.batches for k in grid.kernels]
    if grid.fallback:
        items += [(b, k, "fallback") for b in grid.batches for k in grid.kernels]
    first_stage = 1 + grid.tbo + grid.fallback
    items += [(b, k, v) for b in grid.batches for k in grid.kernels for v in grid.variants(b)[first_stage:]]
    return items


def compile_programs(items, step_of: Callable[[str, str], StepProgram], params, kv_cache, *, workers: int,
                     on_point: Callable[[str], None] | None = None) -> dict:
    """Lower every (batch, kernels, variant) program in this thread, then XLA-compile them on `workers` threads
    (the Triton kernels of the Pallas programs take tens of seconds each to compile). Returns
    {item: (step, lower_s, compile_s)} or {item: the exception}; compile_s is that program's wall time while up to
    `workers` compiles ran at once."""
    results, lowered = {}, []
    for batch, kernels_name, variant in items:
        try:
            step = step_of(kernels_name, variant)
            begin = time.perf_counter()
            step.lower(params, kv_cache, batch)
            lowered.append(((batch, kernels_name, variant), step, time.perf_counter() - begin))
        except Exception as e:  # noqa: BLE001 - one failing program must not end the run
            results[batch, kernels_name, variant] = e
    if on_point:
        on_point(f"compiling {len(lowered)} programs on {workers} threads")

    def compile_one(step: StepProgram, batch: int):
        begin = time.perf_counter()
        step.compile(params, kv_cache, batch)
        return time.perf_counter() - begin

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {item: (step, lower_s, pool.submit(compile_one, step, item[0])) for item, step, lower_s in lowered}
        for item, (step, lower_s, future) in futures.items():
            try:
                results[item] = (step, lower_s, future.result())
            except Exception as e:  # noqa: BLE001
                results[item] = e
    return results


WEIGHT_FORMATS = ("plain", "fp8", "mxfp4")


def random_params(grid: Grid, cfg, dtype, fp8_block):
    """The preset's random weights in the grid's formats, on the default device: MXFP4 experts quantized from the
    plain ones an expert at a time (their [X, in, out] to Quark's [X, out, in / 2] codes and [X, out, in / 32]
    scales), then ptpc_fp8's per-channel linear layers."""
    params = architecture.of(cfg).model.init_params(cfg, grid.seed, dtype, fp8_block)
    if grid.weight_format == "mxfp4":
        to_mxfp4 = jax.jit(lambda w: jax.lax.map(lambda expert: quantize_mxfp4(expert.T),
                                                 w.reshape(-1, *w.shape[-2:])))

        def experts(path, leaf):
            if getattr(path[-1], "key", None) not in mxfp4.EXPERT_LEAVES:
                return leaf
            packed, scales = to_mxfp4(leaf)
            lead = leaf.shape[:-2]
            return mxfp4.from_checkpoint(packed.reshape(*lead, *packed.shape[1:]),
                                         scales.reshape(*lead, *scales.shape[1:]), mxfp4.ExpertsFormat())

        params = jax.tree_util.tree_map_with_path(experts, params)
    if grid.channel_fp8:
        params = jax.jit(fp8_linear.quantize_channels_params, donate_argnums=0)(params)
    return params


def run_grid(grid: Grid, *, budget_s: float | None = None, on_point: Callable[[str], None] | None = None,
             compile_workers: int = 1) -> Iterator[dict]:
    """Yield one row (dict) per measurement as it completes: kind 'program' (per dcp x kernels x variant x
    bucket: compile time, length derivations, HLO op counts, workspace, capacity), 'point' (a timed point),
    'error' or 'skipped'. Each DCP size first compiles all its programs (`compile_programs`, `compile_workers`
    threads), then times them in `work_items` order; `budget_s` bounds the seconds spent per DCP size, compiles
    included (programs whose timing has not started in time are 'skipped'). `on_point(description)` is called
    once per point and once for the compile phase (progress bars)."""
    cfg, dtype = grid.cfg, jnp.dtype(grid.dtype)
    sizes, _ = plan(grid)
    # Measured before the weights and pools take the memory.
    ceilings = step_profile.measure_ceilings(grid.copy_bytes, grid.matmul_size) if grid.profile else None
    fp8_block = (FP8_BLOCK, FP8_BLOCK) if grid.weight_format == "fp8" else None
    experts_format = mxfp4.ExpertsFormat() if grid.weight_format == "mxfp4" else None
    host_params = random_params(grid, cfg, dtype, fp8_block)
    memory, memory_source = device_memory(grid)
    rng = np.random.default_rng(grid.seed)
    for w in sizes:
        start = time.perf_counter()
        parallel = ParallelConfig(tp=w, dcp=w, interleave=grid.interleave, enable_expert_parallel=grid.expert_parallel)
        engine = grid.engine(w)
        mesh = make_mesh(parallel)
        max_blocks = engine.max_blocks_per_seq(w)
        steps: dict[tuple[str, str], StepProgram] = {}
        new_state = state_allocator(cfg, parallel, engine, mesh, dtype)

        def step_of(kernels_name: str, variant: str) -> StepProgram:
            if (kernels_name, variant) not in steps:
                ctx = step_context(cfg, parallel, engine, kernel_backend(kernels_name), dtype=dtype,
                                   fp8_block=fp8_block, mxfp4_experts=experts_format, channel_fp8=grid.channel_fp8)
                steps[kernels_name, variant] = step_program(variant_context(ctx, variant), GREEDY, parallel, engine,
                                                            mesh)
            return steps[kernels_name, variant]

        params = step_of(grid.kernels[0], "host").place_params(host_params)
        weights_per_rank = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(params))

        def fresh_pool() -> DeviceState:
            state = new_state()
            return dataclasses.replace(state, kv_cache=fill_random(state.kv_cache, jax.random.key(grid.seed + w)))

        kv_cache = fresh_pool()
        pool = {name: sum(a.nbytes // a.shape[0] for a in jax.tree.leaves(leaves))
                for name, leaves in kv_cache.kv_cache.pools.items()}
        common = dict(preset=grid.preset, layers=cfg.num_hidden_layers, dtype=grid.dtype,
                      weight_format=grid.weight_format, channel_fp8=grid.channel_fp8,
                      index_cache=grid.index_cache, latent_cache=grid.latent_cache, dcp=w, page_size=grid.page_size,
                      interleave=grid.interleave)
        items = work_items(grid)
        compiled = compile_programs(items, step_of, params, kv_cache, workers=compile_workers, on_point=on_point)
        for batch, kernels_name, variant in items:
            key = dict(common, kernels=kernels_name, variant=variant, batch=batch)
            where = f"dcp={w} {kernels_name} B={batch} {variant}"
            result = compiled[batch, kernels_name, variant]
            if isinstance(result, Exception):
                if on_point:
                    for _ in grid.contexts:
                        on_point(f"error {where}")
                yield dict(key, kind="error", stage="compile", error=f"{type(result).__name__}: {result}"[:2000])
                continue
            step, lower_s, compile_s = result
            if _is_consumed(kv_cache):  # a failed call consumed the donated pool
                kv_cache = fresh_pool()
            row = dict(key, kind="program", lower_s=lower_s, compile_s=compile_s, compile_workers=compile_workers,
                       weights_bytes_per_rank=weights_per_rank, pool_bytes_per_rank=pool,
                       device_memory_bytes=memory, memory_source=memory_source)
            if variant in ("host", "fallback"):
                row |= _program_analysis(step, params, kv_cache, batch, step.compile(params, kv_cache, batch))
                total = max_tokens(cfg, dcp=w, memory=memory, weights=weights_per_rank,
                                   workspace=row["temp_bytes"] or 0, itemsize=dtype.itemsize,
                                   index_cache=grid.index_cache, latent_cache=grid.latent_cache)
                row |= dict(max_total_tokens=total, max_context=total // batch)
            yield row
            if budget_s is not None and time.perf_counter() - start > budget_s:
                for context in grid.contexts:
                    if on_point:
                        on_point(f"skipped {where}")
                    yield dict(key, kind="skipped", context=context, reason=f"budget of {budget_s} s per DCP size")
                continue
            for context in grid.contexts:
                if on_point:
                    on_point(f"{where} L={context}")
                point = dict(key, context=context)
                try:
                    tables = block_tables_for(batch, context, dcp=w, page_size=grid.page_size, max_blocks=max_blocks)
                    md = build_step_metadata([context] * batch, [1] * batch, tables, rows=batch, seqs=batch,
                                             layout=step.layout, max_blocks=max_blocks)
                    tokens = decode_inputs(rng.integers(0, cfg.vocab_size, batch).astype(np.int32), [context] * batch,
                                           list(range(batch)), engine.max_num_seqs)
                    if _is_consumed(kv_cache):
                        kv_cache = fresh_pool()
                    times, pipelined, device, compiles, kv_cache = time_steps(step, params, kv_cache, tokens, md,
                                                                      steps=grid.steps, warmup=grid.warmup)
                    profile = {}
                    if ceilings and variant == "host":
                        profile, kv_cache = profile_point(step, params, kv_cache, tokens, md, grid=grid, batch=batch,
                                                          context=context, dcp=w, ceilings=ceilings,
                                                          device_s=device)
                except Exception as e:  # noqa: BLE001
                    yield dict(point, kind="error", stage="run", error=f"{type(e).__name__}: {e}"[:2000])
                    continue
                ordered = sorted(times)
                median = statistics.median(ordered)
                latent_bytes, index_bytes = kv_bytes_used(cfg, batch=batch, context=context, dcp=w,
                                                          page_size=grid.page_size, itemsize=dtype.itemsize,
                                                          index_cache=grid.index_cache,
                                                          latent_cache=grid.latent_cache)
                yield dict(point, kind="point", steps=len(times), median_ms=1e3 * median,
                           p10_ms=1e3 * _percentile(ordered, 10), p90_ms=1e3 * _percentile(ordered, 90),
                           min_ms=1e3 * ordered[0], max_ms=1e3 * ordered[-1], pipelined_ms=1e3 * pipelined,
                           device_ms=1e3 * device, tokens_per_s=batch / median,
                           pipelined_tokens_per_s=batch / pipelined,
                           recompiles=compiles, kv_latent_bytes_per_rank=latent_bytes,
                           kv_index_bytes_per_rank=index_bytes, **profile)
        steps.clear()  # free this DCP size's programs, weights and pool before the next one's
        del params, kv_cache


def _program_analysis(step: StepProgram, params, kv_cache, rows: int, compiled) -> dict:
    """Length-derived integer ops in the jaxpr, HLO op counts and workspace of one compiled bucket."""
    found = step.length_derivations(params, kv_cache, rows)
    counts = hlo_op_counts(compiled.as_text())
    temp = None
    with contextlib.suppress(Exception):
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
    return dict(length_derivations=len(found), length_derivation_ops=sorted(Counter(
                    f.split(":")[0].split("/")[-1] for f in found).items()),
                hlo_ops=sum(v for k, v in counts.items() if not k.startswith("int:")),
                hlo_int_arith_ops=sum(v for k, v in counts.items() if k.startswith("int:")),
                temp_bytes=temp)


# ---- summaries -------------------------------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part.lower().replace("k", "")) * (1024 if part.lower().endswith("k") else 1)
                       for part in text.split(",") if part)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (4K = 4096), got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return values


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part for part in text.split(",") if part)
    if not names or any(n not in ("pallas", "reference") for n in names):
        raise argparse.ArgumentTypeError(f"kernels: a comma-separated subset of pallas,reference; got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `dcp-jax bench decode` (defaults: the GPU grid of docs/perf_decode.md)."""
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    d = Grid()
    parser.add_argument("--preset", default=d.preset, help="a preset: tiny, deepseek-v3.2, glm-5.2, deepseek-r1, ...")
    parser.add_argument("--num-layers", type=int, default=d.num_layers, help="layer-count override (0: the preset's)")
    parser.add_argument("--dcp", type=_ints, default=d.dcp_sizes,
                        help="DCP sizes (TP = DCP), in run order; sizes past the device count are skipped")
    parser.add_argument("--contexts", type=_ints, default=d.contexts, help="context lengths, e.g. 4K,16K,64K,128K")
    parser.add_argument("--batches", type=_ints, default=d.batches, help="batch buckets, run in the order given")
    parser.add_argument("--kernels", type=_names, default=d.kernels, help="pallas,reference (both in one run)")
    parser.add_argument("--breakdown-batches", type=lambda t: () if t == "none" else _ints(t),
                        default=d.breakdown_batches, help="batches that get the stage breakdown ('none': skip it)")
    parser.add_argument("--no-fallback", dest="fallback", action="store_false", help="skip the fallback variant")
    parser.add_argument("--tbo", action="store_true", help="also time the step with two-batch overlap (`tbo`)")
    parser.add_argument("--steps", type=int, default=d.steps, help="timed steps per point")
    parser.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps per point first")
    parser.add_argument("--profile", action="store_true",
                        help="each host step's roofline and kernel time by category (bench/step_profile.py)")
    parser.add_argument("--profile-steps", type=int, default=d.profile_steps, help="steps the profiler traces")
    parser.add_argument("--copy-bytes", type=lambda t: parse_sizes(t)[0], default=d.copy_bytes,
                        help="--profile: bytes of the same-run copy rate's array, e.g. 2G")
    parser.add_argument("--matmul-size", type=int, default=d.matmul_size,
                        help="--profile: n of the same-run n x n x n bf16 matmul rate")
    # The engine's own options (their one default each): the weights' and caches' formats, the layout, the seed.
    EngineArgs.add_cli_args(parser, only=ENGINE_ARGUMENTS)
    parser.add_argument("--weight-format", choices=("plain", "mxfp4"), default="plain",
                        help="mxfp4: the routed experts in MXFP4 (an AMD Quark checkpoint's), the rest in --dtype, "
                             "or per-channel fp8 under --quantization ptpc_fp8")
    parser.add_argument("--device-memory-gb", type=float, default=None,
                        help="device memory for the capacity column (default: memory_stats, else 139 GiB)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="per DCP size, compiles included: time no program after this many seconds (the rest: "
                             "'skipped' rows)")
    parser.add_argument("--out", default="results_decode.jsonl", help="JSON lines output")
    parser.add_argument("--img-dir", default="docs/img", help="where plots go ('none': no plots)")
    parser.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices (no effect on GPUs)")
    parser.add_argument("--compile-workers", type=int, default=min(16, os.cpu_count() or 1),
                        help="threads that XLA-compile the programs of a DCP size at once")
    parser.add_argument("--compile-cache", default=None, help="persistent compilation cache directory")
    parser.add_argument("--report", nargs="+", default=None, metavar="JSONL",
                        help="measure nothing: merge these result files into the tables and plots")


# The engine arguments (`EngineArgs`) the benchmark takes; quantization fp8 puts the preset's linear weights in
# block fp8, ptpc_fp8 those but the experts' in per-channel fp8.
ENGINE_ARGUMENTS = ("dtype", "quantization", "page_size", "interleave", "enable_expert_parallel", "kv_cache_dtype",
                    "latent_cache", "index_cache", "seed")


def grid_from_args(args: argparse.Namespace) -> Grid:
    engine_args = EngineArgs.from_cli_args(args, only=ENGINE_ARGUMENTS)
    return Grid(preset=args.preset, num_layers=args.num_layers or None, dcp_sizes=args.dcp, contexts=args.contexts,
                batches=args.batches, kernels=args.kernels, breakdown_batches=args.breakdown_batches,
                steps=args.steps, warmup=args.warmup, page_size=engine_args.page_size,
                interleave=engine_args.interleave,
                dtype=resolve_dtype(engine_args.dtype, preset(args.preset)),
                weight_format="fp8" if engine_args.quantization == "fp8" else args.weight_format,
                channel_fp8=engine_args.quantization == "ptpc_fp8",
                index_cache=engine_args.index_cache_format, latent_cache=engine_args.latent_cache_format,
                fallback=args.fallback, tbo=args.tbo, expert_parallel=engine_args.enable_expert_parallel,
                device_memory_gb=args.device_memory_gb, seed=engine_args.seed, profile=args.profile,
                profile_steps=args.profile_steps, copy_bytes=args.copy_bytes, matmul_size=args.matmul_size)


def run(args: argparse.Namespace, *, echo: Callable[[str], None], progress=None) -> int:
    """The whole benchmark: grid from `args`, rows to `args.out` as they come, then the markdown tables, plots
    and the target checks through `echo`. `progress(total=...)` makes a tqdm-like bar. Returns the exit code."""
    if args.report:
        rows = []
        for path in args.report:
            with open(path) as f:
                rows += [json.loads(line) for line in f if line.strip()]
        return report(rows, img_dir=args.img_dir, echo=echo)
    use_cpu_devices(args.cpu_devices)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    grid = grid_from_args(args)
    cfg = grid.cfg  # validates the preset and layer count
    for c in grid.contexts:
        if c > cfg.max_position_embeddings:
            echo(f"bench decode: context {c} exceeds {grid.preset}'s max_position_embeddings "
                 f"{cfg.max_position_embeddings}")
            return 2
    info = run_info(grid)
    sizes, notes = plan(grid)
    memory, memory_source = device_memory(grid)
    echo(f"{info['num_devices']} x {info['device']} ({info['backend']}), commit {info['commit']}, {grid.preset} "
         f"{cfg.num_hidden_layers} layers {grid.dtype}, {grid.index_cache} index cache, {grid.latent_cache} latent "
         f"cache, dcp {sizes}, kernels "
         f"{list(grid.kernels)}, device memory "
         f"{memory / 2**30:.1f} GiB ({memory_source})")
    for note in notes:
        echo(note)
    if not sizes:
        return 2
    rows = [info]
    bar = progress(total=num_points(grid, sizes)) if progress else None
    on_point = (lambda text: (bar.set_description(text[:60]), bar.update(1))) if bar else None
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    has_profile_header = False
    with open(args.out, "w") as f:
        f.write(json.dumps(info) + "\n")
        for row in run_grid(grid, budget_s=args.budget_s, on_point=on_point,
                            compile_workers=max(1, args.compile_workers)):
            rows.append(row)
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            if step_profile.is_profiled(row):  # the table's rows as they come; the whole table in the report
                if not has_profile_header:
                    echo(step_profile.HEADER)
                    has_profile_header = True
                echo(step_profile.table_row(row))
    if bar:
        bar.close()
    echo(f"wrote {len(rows)} rows to {args.out}")
    return report(rows, img_dir=args.img_dir, echo=echo)


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    parser = argparse.ArgumentParser(prog="dcp-jax bench decode", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args, echo=lambda text: print(text, flush=True),
               progress=lambda total: tqdm(total=total, unit="point", file=sys.stderr,
                                           mininterval=1 if sys.stderr.isatty() else 30))


if __name__ == "__main__":
    sys.exit(main())
