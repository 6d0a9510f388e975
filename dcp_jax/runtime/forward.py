"""The model's per-rank decode and prefill bodies (run inside shard_map by `step.DecodeStep` / `PrefillStep`).

Decode: embeddings -> per layer (sparse DCP attention, MLP / MoE) -> final norm -> lm_head logits.
Prefill (tensor parallel): every rank computes the whole prompt (heads split over TP as in decode) with HF's sparse
rule, and writes each token's latent and index key into its owner's shard at the host-computed slots of the
step's `PrefillMetadata`. Both bodies also return the per-layer selected global top-k ids.
Letters: R rows, T tokens of a row, K index top-k, A vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcp_jax.config import ModelConfig
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.metadata import DecodeMetadata, PrefillMetadata
from dcp_jax.model.deepseek_v32 import merge
from dcp_jax.model.kv_cache import KVCache, from_layers
from dcp_jax.model.rope import cos_sin, rope_tables


def decode_body(params, kv_cache: KVCache, tokens, md: DecodeMetadata, *, graphdef, abstract, cfg: ModelConfig,
                layout: DcpLayout, backend: str):
    """Per rank: tokens [R] int32 replicated, md the rank's view of the step's metadata. Returns ((logits [R, A]
    f32, selected [layers, R, K] int32 global ids), kv_cache). Pad rows read and write nothing."""
    model = merge(graphdef, abstract, params)
    rope = cos_sin(md.positions, *rope_tables(cfg))
    hidden = model.embed_tokens(tokens)
    caches, selected = [], []
    for i, layer in enumerate(model.layers):
        with jax.named_scope(f"layer_{i}"):
            attn, lat, idx, sel = layer.attention.decode(layer.attention_input(hidden), rope, *kv_cache.layer(i), md,
                                                         layout=layout, backend=backend)
            hidden = layer.feed_forward(hidden + attn)
        caches.append((lat, idx))
        selected.append(sel)
    return (model.logits(hidden), jnp.stack(selected)), from_layers(caches)


def prefill_body(params, kv_cache: KVCache, tokens, md: PrefillMetadata, *, graphdef, abstract, cfg: ModelConfig,
                 all_logits: bool):
    """Per rank: tokens [R, T] int32 replicated, md the rank's view of the step's metadata. Returns ((logits
    [R, T, A] if all_logits else [R, A] at md.logits_indices, selected [layers, R, T, K]), kv_cache)."""
    model = merge(graphdef, abstract, params)
    rope = cos_sin(md.positions, *rope_tables(cfg))
    hidden = model.embed_tokens(tokens)
    caches, selected = [], []
    for i, layer in enumerate(model.layers):
        with jax.named_scope(f"layer_{i}"):
            attn, lat, idx, sel = layer.attention.prefill(layer.attention_input(hidden), rope, *kv_cache.layer(i),
                                                          md.slot_mapping)
            hidden = layer.feed_forward(hidden + attn)
        caches.append((lat, idx))
        selected.append(sel)
    if not all_logits:
        hidden = hidden[jnp.arange(tokens.shape[0]), md.logits_indices]
    return (model.logits(hidden), jnp.stack(selected)), from_layers(caches)


