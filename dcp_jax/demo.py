"""The foundation demo (`dcp-jax demo`): a stack of sparse DCP attention layers (pre-norm, residual, no MLP)
against its single-device unsharded twin.

Requests join and leave a continuously batched decode loop; every step runs the DCP step (host-built metadata,
bucketed, compiled once per bucket; per rank: hidden [R, D] replicated in and out) and the unsharded computation
on the same inputs, and the outputs are compared.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from dcp_jax.config import EngineConfig, ModelConfig, ParallelConfig
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.page_allocator import PageAllocator
from dcp_jax.host.step_metadata import StepMetadata, build_step_metadata
from dcp_jax.model.attention import cache_formats
from dcp_jax.model.attention.params import DsaParams, init_dsa_params
from dcp_jax.model.attention.projections import index_key, low_rank_projections, mla_latent, rms_norm
from dcp_jax.model.attention.sparse_dcp import SPARSE_MLA, sparse_dcp_attention
from dcp_jax.model.attention.unsharded import sparse_attention_unsharded
from dcp_jax.model.kv_cache import KVCache, allocate_kv_cache, cache_pools, kv_cache_specs, on_layer
from dcp_jax.model.mesh import make_mesh
from dcp_jax.model.rope import cos_sin, rope_tables
from dcp_jax.runtime.context import kernel_backend
from dcp_jax.runtime.step import StepProgram
from pallas_kernels import Fp8IndexKeys, Fp8LatentCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackLayerParams:
    input_norm: jax.Array  # [D]
    attention: DsaParams


def init_stack_params(cfg: ModelConfig, key: jax.Array) -> list[StackLayerParams]:
    keys = jax.random.split(key, cfg.num_hidden_layers)
    return [
        StackLayerParams(
            input_norm=1.0 + 0.1 * jax.random.normal(jax.random.fold_in(k, 1), (cfg.hidden_size,)),
            attention=init_dsa_params(cfg, k),
        )
        for k in keys
    ]


def stack_param_specs(cfg: ModelConfig) -> list[StackLayerParams]:
    return [StackLayerParams(input_norm=P(), attention=SPARSE_MLA.partition_specs())
            for _ in range(cfg.num_hidden_layers)]


def decode_stack_body(params, kv_cache: KVCache, hidden, md: StepMetadata, *, cfg: ModelConfig,
                      layout: DcpLayout, backend: str):
    """Per rank: every layer reads the host-provided local lengths and slots of `md`, moved to its own pages."""
    rope = cos_sin(md.positions, *rope_tables(cfg))
    pools = kv_cache.local_pools()
    latent, index_k = pools["latent"], pools["index_k"]
    for layer, lp in enumerate(params):
        with jax.named_scope(f"layer_{layer}"):
            layer_md = on_layer(md, layer, num_pages=kv_cache.num_pages, page_size=kv_cache.page_size)
            attn, latent, index_k, _ = sparse_dcp_attention(
                lp.attention, rms_norm(hidden, lp.input_norm, cfg.rms_norm_eps), latent, index_k, rope, layer_md,
                cfg=cfg, layout=layout, backend=backend)
        hidden = hidden + attn
    return hidden, kv_cache.with_local_pools(dict(latent=latent, index_k=index_k))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseHistory:
    """Unsharded per-row history of every layer: [layers, R, T, C+E] latents and [layers, R, T, J] keys (or
    their fp8 forms, `cache_formats.py`)."""

    latents: jax.Array | Fp8LatentCache
    index_keys: jax.Array | Fp8IndexKeys


def empty_history(cfg: ModelConfig, rows: int, max_len: int, index_cache: str = "exact",
                  latent_cache: str = "exact") -> DenseHistory:
    """Zero f32 history, index keys in format `index_cache`, latents in format `latent_cache`."""
    history = (cfg.num_hidden_layers, rows, max_len)
    return DenseHistory(
        latents=cache_formats.zero_latents(history, cfg, latent_cache, jnp.float32),
        index_keys=cache_formats.zero_index_keys(history + (cfg.indexer.head_dim,), index_cache, jnp.float32),
    )


@functools.partial(jax.jit, static_argnames="cfg")
def decode_stack_unsharded(params, history: DenseHistory, hidden, positions, context_lens, *, cfg: ModelConfig):
    """One decode step on one device without DCP or paging. Rows with context_lens 0 write nothing.
    Returns (hidden [R, D], history, selected positions [layers, R, K])."""
    rope = cos_sin(positions, *rope_tables(cfg))
    rows = jnp.arange(hidden.shape[0])
    max_len = cache_formats.leading_shape(history.latents)[2]
    write = jnp.where(context_lens > 0, positions, max_len)  # out of range -> dropped

    def write_row(history_leaf, new):
        return history_leaf.at[rows, write].set(new.astype(history_leaf.dtype), mode="drop")

    latents, index_keys, selected = [], [], []
    for layer, lp in enumerate(params):
        x = rms_norm(hidden, lp.input_norm, cfg.rms_norm_eps)
        lat = jax.tree.map(lambda a: a[layer], history.latents)
        q_a, ckv = low_rank_projections(lp.attention, x, cfg, backend="reference")
        new_lat = cache_formats.encode_latents(mla_latent(lp.attention, ckv, *rope, cfg), lat)
        lat = jax.tree.map(write_row, lat, new_lat)
        keys = jax.tree.map(lambda a: a[layer], history.index_keys)
        new_keys = cache_formats.encode_index_keys(index_key(lp.attention, x, *rope, cfg, backend="reference"), keys)
        idx = jax.tree.map(write_row, keys, new_keys)
        attn, sel = sparse_attention_unsharded(lp.attention, x, q_a, cache_formats.latent_values(lat), idx, rope,
                                               context_lens, cfg=cfg)
        hidden = hidden + attn
        latents.append(lat)
        index_keys.append(idx)
        selected.append(sel)
    stack = functools.partial(jax.tree.map, lambda *a: jnp.stack(a))
    history = DenseHistory(stack(*latents), stack(*index_keys))
    return hidden, history, jnp.stack(selected)


def make_stack_step(cfg: ModelConfig, parallel: ParallelConfig, engine: EngineConfig, mesh: Mesh, kernels: str,
                    body=None) -> StepProgram:
    """The decode step of the attention stack, one program per bucket of `engine`; `kernels` an engine's choice
    (`config.KERNEL_CHOICES`). `body` replaces `decode_stack_body` (tests wire in variants)."""
    layout = DcpLayout(parallel.dcp, parallel.interleave, engine.page_size)
    body = functools.partial(body or decode_stack_body, cfg=cfg, layout=layout, backend=kernel_backend(kernels))
    return StepProgram(body, mesh, buckets=engine.buckets, seqs_for=engine.seqs_for, layout=layout,
                       num_pages=engine.num_pages, max_blocks=engine.max_blocks_per_seq(parallel.dcp),
                       param_specs=stack_param_specs(cfg), input_specs=P(), output_specs=P(),
                       state_specs=kv_cache_specs(cache_pools(cfg, engine)),
                       input_shapes=lambda rows: jax.ShapeDtypeStruct((rows, cfg.hidden_size), jnp.float32))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Request i decodes during steps [start[i], stop[i]); its context grows by one token a step."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    @property
    def num_steps(self) -> int:
        return max(self.stop)

    def active(self, step: int) -> list[int]:
        return [i for i, (a, b) in enumerate(zip(self.start, self.stop)) if a <= step < b]


def staggered_schedule(num_requests: int, num_steps: int, seed: int) -> Schedule:
    """Requests start at staggered steps and some finish early, so batch sizes and lengths vary."""
    rng = np.random.default_rng(seed)
    start = np.sort(rng.integers(0, num_steps // 3, num_requests))
    start[0] = 0
    stop = np.where(rng.random(num_requests) < 0.3, rng.integers(num_steps // 2, num_steps, num_requests), num_steps)
    return Schedule(tuple(int(s) for s in start), tuple(int(s) for s in np.maximum(stop, start + 1)))


@dataclasses.dataclass(frozen=True)
class Report:
    dcp: int
    tp: int
    interleave: int
    buckets_compiled: int
    steps: int
    step_ms: float
    max_abs_err: float
    max_context: int


def run_comparison(
    cfg: ModelConfig,
    parallel: ParallelConfig,
    engine: EngineConfig,
    schedule: Schedule,
    *,
    seed: int = 0,
    kernels: str = "reference",
    params=None,
) -> Report:
    """Run `schedule` through the DCP step and the unsharded twin (both with latents and index keys in
    `engine.latent_cache`'s and `engine.index_cache`'s formats); return the worst output difference."""
    mesh = make_mesh(parallel)
    params = init_stack_params(cfg, jax.random.key(seed)) if params is None else params
    step = make_stack_step(cfg, parallel, engine, mesh, kernels)
    layout = step.layout
    unsharded_params, params = params, step.place_params(params)
    kv_cache = allocate_kv_cache(cfg, engine, parallel.dcp, mesh)
    for rows in engine.buckets:
        step.compile(params, kv_cache, rows)

    num_requests = len(schedule.start)
    history = empty_history(cfg, num_requests, engine.max_model_len, engine.index_cache, engine.latent_cache)
    allocator = PageAllocator(engine.num_pages)
    tables: list[list[int]] = [[] for _ in range(num_requests)]
    lens = np.zeros(num_requests, np.int64)
    rng = np.random.default_rng(seed + 1)
    max_err, elapsed = 0.0, 0.0
    for t in range(schedule.num_steps):
        active = schedule.active(t)
        for i in range(num_requests):
            if i not in active and tables[i] and t >= schedule.stop[i]:
                allocator.free(tables[i])
                tables[i] = []
        for i in active:
            lens[i] += 1
            missing = layout.virtual_blocks(lens[i]) - len(tables[i])
            tables[i] += allocator.allocate(int(missing))
        hidden = rng.standard_normal((num_requests, cfg.hidden_size)).astype(np.float32)
        bucket = engine.bucket_for(len(active))
        md = build_step_metadata([lens[i] for i in active], [1] * len(active), [tables[i] for i in active],
                                 rows=bucket, seqs=engine.seqs_for(bucket), layout=layout, max_blocks=step.max_blocks)
        inputs = np.zeros((md.rows, cfg.hidden_size), np.float32)
        inputs[: len(active)] = hidden[active]
        begin = time.perf_counter()
        out, kv_cache = step(params, kv_cache, jnp.asarray(inputs), md)
        out = np.asarray(out)
        elapsed += time.perf_counter() - begin

        is_active = np.isin(np.arange(num_requests), active)
        context = np.where(is_active, lens, 0).astype(np.int32)
        expected, history, _ = decode_stack_unsharded(
            unsharded_params, history, jnp.asarray(np.where(is_active[:, None], hidden, 0)),
            jnp.asarray(np.maximum(context - 1, 0)), jnp.asarray(context), cfg=cfg)
        max_err = max(max_err, float(np.max(np.abs(out[: len(active)] - np.asarray(expected)[active]))))
    return Report(
        dcp=parallel.dcp,
        tp=parallel.tp,
        interleave=parallel.interleave,
        buckets_compiled=step.num_compiled,
        steps=schedule.num_steps,
        step_ms=1e3 * elapsed / schedule.num_steps,
        max_abs_err=max_err,
        max_context=int(lens.max()),
    )
