"""A stack of sparse DCP attention layers (pre-norm, residual, no MLP): the decode body of the foundation demo
and tests (`demo.make_stack_step` compiles it), and its single-device unsharded twin.

Per rank: hidden [R, D] replicated in and out.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dcp_jax.config import ModelConfig
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.metadata import StepMetadata
from dcp_jax.model.attention import cache_formats
from dcp_jax.model.attention.sparse_dcp import sparse_dcp_attention
from dcp_jax.model.attention.params import AttentionParams, init_attention_params, partition_specs
from dcp_jax.model.attention.projections import index_key, low_rank_projections, mla_latent, rms_norm
from dcp_jax.model.attention.unsharded import sparse_attention_unsharded
from dcp_jax.model.kv_cache import KVCache, on_layer
from dcp_jax.model.rope import cos_sin, rope_tables
from pallas_kernels import Fp8IndexKeys, Fp8LatentCache


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


def decode_stack_body(params, kv_cache: KVCache, hidden, md: StepMetadata, *, cfg: ModelConfig,
                      layout: DcpLayout, backend: str):
    """Per rank: every layer reads the host-provided local lengths and slots of `md`, moved to its own pages."""
    rope = cos_sin(md.positions, *rope_tables(cfg))
    latent, index_k = kv_cache.local_pools()
    for layer, lp in enumerate(params):
        with jax.named_scope(f"layer_{layer}"):
            layer_md = on_layer(md, layer, num_pages=kv_cache.num_pages, page_size=kv_cache.page_size)
            attn, latent, index_k, _ = sparse_dcp_attention(
                lp.attention, rms_norm(hidden, lp.input_norm, cfg.rms_norm_eps), latent, index_k, rope, layer_md,
                cfg=cfg, layout=layout, backend=backend)
        hidden = hidden + attn
    return hidden, kv_cache.with_local_pools(latent, index_k)


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
        index_keys=cache_formats.zero_index_keys(history + (cfg.index_head_dim,), index_cache, jnp.float32),
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
