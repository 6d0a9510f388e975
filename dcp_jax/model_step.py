"""The model's prefill and decode programs over the device mesh, and `ModelRunner`, which drives them.

Decode: `DecodeStep` of `step.py` (one compiled program per bucket, host-built `DecodeMetadata`, KV donated)
around `decode_body`: embeddings -> per layer (sparse DCP attention, MLP / MoE) -> final norm -> lm_head logits.
Prefill (first version): every rank computes the whole prompt (heads split over TP as in decode) with HF's sparse
rule, and writes each token's latent and index key into its owner's shard at host-computed slots
(`layout.slot_mapping` over every prompt position). Both programs output the per-layer selected global top-k ids;
`ModelRunner` copies them to the host only when asked (`return_selected=True`: the oracle tests do, serving does not).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from dcp_jax import layout
from dcp_jax.attention.decode import DcpLayout
from dcp_jax.attention.kernels import Kernels
from dcp_jax.config import EngineConfig, ModelConfig, ParallelConfig
from dcp_jax.kv_cache import KV_CACHE_SPECS, KVCache, allocate_kv_cache, from_layers
from dcp_jax.mesh import DCP, sharding
from dcp_jax.metadata import DecodeMetadata, build_decode_metadata
from dcp_jax.model import abstract_model, merge, param_specs
from dcp_jax.rope import cos_sin, rope_tables
from dcp_jax.step import DecodeStep, shard_decode_body


def decode_body(params, kv_cache: KVCache, tokens, md: DecodeMetadata, *, graphdef, abstract, cfg: ModelConfig,
                layout: DcpLayout, kernels: Kernels):
    """Per rank: tokens [R] int32 replicated, md the rank's metadata view. Returns ((logits [R, A] f32,
    selected [layers, R, K] int32 global ids), kv_cache). Pad rows read and write nothing."""
    model = merge(graphdef, abstract, params)
    rope = cos_sin(md.positions, *rope_tables(cfg))
    hidden = model.embed_tokens(tokens)
    caches, selected = [], []
    for i, layer in enumerate(model.layers):
        with jax.named_scope(f"layer_{i}"):
            attn, lat, idx, sel = layer.attention.decode(
                layer.attention_input(hidden), rope, *kv_cache.layer(i),
                md.local_context_lens, md.slot_mapping, md.block_tables, layout=layout, kernels=kernels,
            )
            hidden = layer.feed_forward(hidden + attn)
        caches.append((lat, idx))
        selected.append(sel)
    return (model.logits(hidden), jnp.stack(selected)), from_layers(caches)


def prefill_body(params, kv_cache: KVCache, tokens, slots, last, *, graphdef, abstract, cfg: ModelConfig,
                 all_logits: bool):
    """Per rank: tokens [B, T] int32 (positions 0..T-1), slots [1, B, T] this rank's write slots (-1: none),
    last [B] each prompt's last position. Returns ((logits [B, T, A] if all_logits else [B, A],
    selected [layers, B, T, K]), kv_cache)."""
    model = merge(graphdef, abstract, params)
    b, t = tokens.shape
    rope = cos_sin(jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), *rope_tables(cfg))
    hidden = model.embed_tokens(tokens)
    caches, selected = [], []
    for i, layer in enumerate(model.layers):
        with jax.named_scope(f"layer_{i}"):
            attn, lat, idx, sel = layer.attention.prefill(layer.attention_input(hidden), rope, *kv_cache.layer(i),
                                                          slots[0])
            hidden = layer.feed_forward(hidden + attn)
        caches.append((lat, idx))
        selected.append(sel)
    if not all_logits:
        hidden = hidden[jnp.arange(b), last]
    return (model.logits(hidden), jnp.stack(selected)), from_layers(caches)


def prefill_lengths(max_model_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Padded prompt lengths (each one prefill program): powers of two from `smallest`, capped by max_model_len."""
    out, t = [], smallest
    while t < max_model_len:
        out.append(t)
        t *= 2
    return tuple(out) + (max_model_len,)


class ModelRunner:
    """Holds the placed weights, the KV cache and the compiled programs; takes host token ids, lengths and
    block tables, returns host logits (and, when asked, the selected top-k ids). Page allocation is the caller's.

    Both programs donate the KV cache: when one raises, the cache may be gone (`kv_cache_is_usable`), and
    `reset_kv_cache` allocates a fresh zeroed one (every context it held is lost)."""

    def __init__(self, cfg: ModelConfig, params: dict, parallel: ParallelConfig, engine: EngineConfig, mesh: Mesh,
                 kernels: Kernels):
        layout.check_layout(parallel.dcp, parallel.interleave, engine.page_size)
        self.cfg, self.parallel, self.engine, self.mesh = cfg, parallel, engine, mesh
        self.max_blocks = engine.max_blocks_per_seq(parallel.dcp)
        self.prefill_lengths = prefill_lengths(engine.max_model_len)
        graphdef, abstract = abstract_model(cfg)
        specs = param_specs(nnx.to_pure_dict(abstract))
        statics = dict(graphdef=graphdef, abstract=abstract, cfg=cfg)
        dcp_layout = DcpLayout(parallel.dcp, parallel.interleave, engine.page_size)
        body = functools.partial(decode_body, layout=dcp_layout, kernels=kernels, **statics)
        sharded = shard_decode_body(body, mesh, param_specs=specs, input_specs=P(), output_specs=(P(), P()))
        self.decode_step = DecodeStep(
            sharded, mesh, buckets=engine.buckets, dcp=parallel.dcp, interleave=parallel.interleave,
            max_blocks=self.max_blocks, param_specs=specs,
            input_shapes=lambda rows: jax.ShapeDtypeStruct((rows,), jnp.int32),
        )
        self._prefill = {
            all_logits: jax.jit(
                jax.shard_map(
                    functools.partial(prefill_body, all_logits=all_logits, **statics),
                    mesh=mesh,
                    in_specs=(specs, KV_CACHE_SPECS, P(), P(DCP), P()),
                    out_specs=((P(), P()), KV_CACHE_SPECS),
                    check_vma=False,
                ),
                donate_argnums=(1,),
            )
            for all_logits in (False, True)
        }
        self._prefill_input_shardings = (sharding(mesh, P()), sharding(mesh, P(DCP)), sharding(mesh, P()))
        self.params = self.decode_step.place_params(params)
        # One compiled allocator, so `reset_kv_cache` never compiles while serving.
        self._new_kv_cache = jax.jit(functools.partial(allocate_kv_cache, cfg, engine, parallel.dcp, mesh))
        self.kv_cache = self._new_kv_cache()

    def kv_cache_is_usable(self) -> bool:
        """False when a failed program consumed the donated cache (deleted) or left it poisoned by an error."""
        try:
            leaves = jax.tree.leaves(self.kv_cache)
            if any(leaf.is_deleted() for leaf in leaves):
                return False
            jax.block_until_ready(leaves)
        except Exception:  # an asynchronous failure surfaces here
            return False
        return True

    def reset_kv_cache(self) -> None:
        """A fresh zeroed KV cache in the same placement (no recompile); every cached context is lost."""
        self.kv_cache = self._new_kv_cache()

    def compile_decode(self, progress=None) -> None:
        """Compile every decode bucket (start-up); `progress` may wrap the loop (tqdm)."""
        buckets = self.engine.buckets
        for rows in progress(buckets) if progress else buckets:
            self.decode_step.compile(self.params, self.kv_cache, rows)

    def prefill(self, prompts: Sequence[Sequence[int]], block_tables: Sequence[Sequence[int]], *,
                all_logits: bool = False, return_selected: bool = False):
        """Prefill `prompts` (token ids, lengths >= 1) into the pages of `block_tables` (virtual-block page ids,
        enough for each prompt). Returns host (logits [n, A] at each prompt's last token, or [n, Tpad, A] at
        every position when all_logits, and selected [layers, n, Tpad, K] global ids, -1 padded, when
        return_selected, else None)."""
        n = len(prompts)
        lens = [len(p) for p in prompts]
        if n != len(block_tables) or not n or min(lens) < 1:
            raise ValueError(f"need one non-empty prompt per block table, got {lens=} and {len(block_tables)} tables")
        if max(lens) > self.engine.max_model_len:
            raise ValueError(f"prompt of {max(lens)} tokens exceeds max_model_len={self.engine.max_model_len}")
        for i, (length, table) in enumerate(zip(lens, block_tables)):
            needed = int(layout.virtual_blocks(length, self.parallel.dcp, self.engine.page_size))
            used = np.asarray(table, np.int64)[:needed]
            if len(used) < needed or np.any((used < 0) | (used >= self.engine.num_pages)):
                raise ValueError(f"prompt {i} of {length} tokens needs page ids in [0, {self.engine.num_pages}) for "
                                 f"its blocks, got {list(table)}")
        rows = self.engine.bucket_for(n)
        t = next(length for length in self.prefill_lengths if length >= max(lens))
        tokens = np.zeros((rows, t), np.int32)
        slots = np.full((self.parallel.dcp, rows, t), -1, np.int32)
        last = np.zeros(rows, np.int32)
        for i, (prompt, table) in enumerate(zip(prompts, block_tables)):
            tokens[i, : lens[i]] = prompt
            last[i] = lens[i] - 1
            positions = np.where(np.arange(t) < lens[i], np.arange(t), -1)
            tables = np.full((t, self.max_blocks), -1, np.int32)
            tables[:, : len(table)] = np.asarray(table, np.int32)[: self.max_blocks]
            slots[:, i] = layout.slot_mapping(positions, tables, self.parallel.dcp, self.parallel.interleave,
                                              self.engine.page_size)
        inputs = jax.device_put((tokens, slots, last), self._prefill_input_shardings)
        (logits, selected), self.kv_cache = self._prefill[all_logits](self.params, self.kv_cache, *inputs)
        return np.asarray(logits)[:n], np.asarray(selected)[:, :n] if return_selected else None

    def decode(self, tokens: Sequence[int], context_lens: Sequence[int], block_tables: Sequence[Sequence[int]], *,
               return_selected: bool = False):
        """One decode step: row i feeds `tokens[i]` at position context_lens[i] - 1. Returns host
        (logits [n, A] f32, selected [layers, n, K] global ids when return_selected, else None). The program
        is the same either way (one per bucket); only the host copy of the selected ids is skipped."""
        n = len(tokens)
        if not n == len(context_lens) == len(block_tables):
            raise ValueError(f"{n} tokens, {len(context_lens)} context lengths and {len(block_tables)} block tables "
                             "must match")
        md = build_decode_metadata(
            context_lens, block_tables, bucket=self.engine.bucket_for(n), dcp=self.parallel.dcp,
            interleave=self.parallel.interleave, page_size=self.engine.page_size, max_blocks=self.max_blocks,
        )
        padded = np.zeros(md.rows, np.int32)
        padded[:n] = tokens
        (logits, selected), self.kv_cache = self.decode_step(self.params, self.kv_cache, padded, md)
        return np.asarray(logits)[:n], np.asarray(selected)[:, :n] if return_selected else None
