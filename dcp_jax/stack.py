"""A stack of sparse DCP attention layers (pre-norm, residual): the decode step of the foundation demo and
tests, and its single-device unsharded twin.

Per rank: hidden [R, D] replicated in and out.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from dcp_jax.attention import index_format, latent_format
from dcp_jax.attention.decode import DcpLayout, sparse_dcp_attention
from dcp_jax.attention.kernels import Kernels
from dcp_jax.attention.params import AttentionParams, init_attention_params, partition_specs
from dcp_jax.attention.projections import mla_latent, index_key, rms_norm
from dcp_jax.attention.unsharded import sparse_attention_unsharded
from dcp_jax.config import EngineConfig, ModelConfig, ParallelConfig
from dcp_jax.kv_cache import KVCache, from_layers
from dcp_jax.metadata import DecodeMetadata
from dcp_jax.rope import cos_sin, rope_tables
from dcp_jax.step import DecodeStep, shard_decode_body
from pallas_kernels.quant import Fp8LatentCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackLayerParams:
    input_norm: jax.Array  # [D]
    attention: AttentionParams


def init_stack_params(cfg: ModelConfig, key: jax.Array) -> list[StackLayerParams]:
    keys = jax.random.split(key, cfg.num_hidden_layers)
    return [
        StackLayerParams(
            input_norm=1.0 + 0.1 * jax.random.normal(jax.random.fold_in(k, 1), (cfg.hidden_size,)),
            attention=init_attention_params(cfg, k),
        )
        for k in keys
    ]


def stack_param_specs(cfg: ModelConfig) -> list[StackLayerParams]:
    return [StackLayerParams(input_norm=P(), attention=partition_specs()) for _ in range(cfg.num_hidden_layers)]


def decode_stack_body(params, kv_cache: KVCache, hidden, md: DecodeMetadata, *, cfg, layout, kernels):
    """Per rank: every layer reads the host-provided local lengths and slots of `md` unchanged."""
    rope = cos_sin(md.positions, *rope_tables(cfg))
    caches = []
    for layer, lp in enumerate(params):
        with jax.named_scope(f"layer_{layer}"):
            attn, lat, idx, _ = sparse_dcp_attention(
                lp.attention,
                rms_norm(hidden, lp.input_norm, cfg.rms_norm_eps),
                *kv_cache.layer(layer),
                rope,
                md.local_context_lens,
                md.slot_mapping,
                md.block_tables,
                cfg=cfg,
                layout=layout,
                kernels=kernels,
            )
        hidden = hidden + attn
        caches.append((lat, idx))
    return hidden, from_layers(caches)


def make_stack_step(
    cfg: ModelConfig, parallel: ParallelConfig, engine: EngineConfig, mesh: Mesh, kernels: Kernels, body=None
) -> DecodeStep:
    """The decode step of the layer stack, one program per bucket. `body` replaces `decode_stack_body`
    (tests and benchmarks use it to wire in variants)."""
    layout = DcpLayout(parallel.dcp, parallel.interleave, engine.page_size)
    body = functools.partial(body or decode_stack_body, cfg=cfg, layout=layout, kernels=kernels)
    param_specs = stack_param_specs(cfg)
    sharded = shard_decode_body(body, mesh, param_specs=param_specs, input_specs=P(), output_specs=P())
    return DecodeStep(
        sharded,
        mesh,
        buckets=engine.buckets,
        dcp=parallel.dcp,
        interleave=parallel.interleave,
        max_blocks=engine.max_blocks_per_seq(parallel.dcp),
        param_specs=param_specs,
        input_shapes=lambda rows: jax.ShapeDtypeStruct((rows, cfg.hidden_size), jnp.float32),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseHistory:
    """Unsharded per-row history of every layer: [layers, R, T, C+E] latents and [layers, R, T, J] keys (or
    their fp8 forms, `latent_format.py`, `index_format.py`)."""

    latents: jax.Array | Fp8LatentCache
    index_keys: jax.Array | index_format.Fp8IndexKeys


def empty_history(cfg: ModelConfig, rows: int, max_len: int, index_cache: str = "exact",
                  latent_cache: str = "exact") -> DenseHistory:
    """Zero f32 history, index keys in format `index_cache`, latents in format `latent_cache`."""
    history = (cfg.num_hidden_layers, rows, max_len)
    return DenseHistory(
        latents=latent_format.zeros(history, cfg, latent_cache, jnp.float32),
        index_keys=index_format.zeros(history + (cfg.index_head_dim,), index_cache, jnp.float32),
    )


@functools.partial(jax.jit, static_argnames="cfg")
def decode_stack_unsharded(params, history: DenseHistory, hidden, positions, context_lens, *, cfg: ModelConfig):
    """One decode step on one device without DCP or paging. Rows with context_lens 0 write nothing.
    Returns (hidden [R, D], history, selected positions [layers, R, K])."""
    rope = cos_sin(positions, *rope_tables(cfg))
    rows = jnp.arange(hidden.shape[0])
    max_len = latent_format.leading_shape(history.latents)[2]
    write = jnp.where(context_lens > 0, positions, max_len)  # out of range -> dropped

    def write_row(history_leaf, new):
        return history_leaf.at[rows, write].set(new.astype(history_leaf.dtype), mode="drop")

    latents, index_keys, selected = [], [], []
    for layer, lp in enumerate(params):
        x = rms_norm(hidden, lp.input_norm, cfg.rms_norm_eps)
        lat = jax.tree.map(lambda a: a[layer], history.latents)
        new_lat = latent_format.encode(mla_latent(lp.attention, x, *rope, cfg), lat)
        lat = jax.tree.map(write_row, lat, new_lat)
        keys = jax.tree.map(lambda a: a[layer], history.index_keys)
        new_keys = index_format.encode_keys(index_key(lp.attention, x, *rope, cfg), keys)
        idx = jax.tree.map(write_row, keys, new_keys)
        attn, sel = sparse_attention_unsharded(lp.attention, x, latent_format.values(lat), idx, rope, context_lens,
                                               cfg=cfg)
        hidden = hidden + attn
        latents.append(lat)
        index_keys.append(idx)
        selected.append(sel)
    stack = functools.partial(jax.tree.map, lambda *a: jnp.stack(a))
    history = DenseHistory(stack(*latents), stack(*index_keys))
    return hidden, history, jnp.stack(selected)
