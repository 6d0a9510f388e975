"""DeepSeek-V3.2 in flax nnx: embeddings, MLA + lightning indexer, dense MLP, DeepSeek MoE, final norm, lm_head.

Layouts (HF stores linear weights `[out, in]`; `weights.py` converts): projections applied as `x @ W` are stored
`[in, out...]` (wq_a [D, Q], wq_b [Q, H, N+E], wkv_a [D, C+E], wo [H, V, D], index_wq [Q, I, J], index_wk [D, J],
index_weights [D, I], MLP gate/up [D, F] and down [F, D], experts [X, D, F] / [X, F, D], router [D, X], lm_head
[D, A]); the two halves of HF's kv_b_proj keep HF's per-head `[out, in]` order: w_uk [H, N, C] and w_uv [H, V, C],
with w_uv applied C -> V (`projections.output_projection`); embed is [A, D]. The router, its bias
(e_score_correction_bias) and index_weights (the indexer's weights_proj) are always f32, as HF keeps them; every
other weight has the model's dtype.
The attention module holds exactly the fields of `AttentionParams`, so the shared projections, the sparse DCP
decode pieces and the kernels read it unchanged. Methods named `prefill` / `decode` run inside `shard_map`
(`model_step.py`): attention heads, the MLP width and the routed experts are split over every TP rank (partial
sums meet in one psum per block); embeddings, norms, the router and lm_head are replicated.

Letters: B batch, T tokens (prefill), S query tokens, R rows (decode), D hidden, Q q_lora, H heads (local h),
N nope, E rope, V v dim, C kv_lora (latent), I index heads, J index head dim, K index top-k, X experts,
F expert / MLP width, A vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from dcp_jax.attention import index_format, latent_format, projections
from dcp_jax.attention.decode import DcpLayout, sparse_dcp_attention, write_slots
from dcp_jax.attention.kernels import Kernels
from dcp_jax.attention.params import AttentionParams, init_attention_params, partition_specs
from dcp_jax.attention.projections import rms_norm
from dcp_jax.config import ModelConfig
from dcp_jax.mesh import HEADS
from pallas_kernels import reference

HIGHEST = jax.lax.Precision.HIGHEST
NEG_INF = float("-inf")
# Prefill queries per attention step. Its per-head index dots take B x 64 x index_n_heads x T f32 (2 GiB at 64
# heads and T = 128K, instead of T x T x heads), its gathered latents B x 64 x index_topk x (C + E).
PREFILL_QUERY_CHUNK = 64


def _dense(rngs: nnx.Rngs, shape, fan_in: int, dtype):
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5).astype(dtype))


def _norm(rngs: nnx.Rngs, size: int, dtype):
    return nnx.Param((1.0 + 0.1 * jax.random.normal(rngs.params(), (size,), jnp.float32)).astype(dtype))


class Attention(nnx.Module):
    """MLA with q_lora and the lightning indexer; the fields are those of `AttentionParams`, initialized by
    `init_attention_params` (index_weights f32 whatever `dtype`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        p = init_attention_params(cfg, rngs.params(), dtype)
        for f in dataclasses.fields(AttentionParams):
            setattr(self, f.name, nnx.Param(getattr(p, f.name)))

    def params(self) -> AttentionParams:
        return AttentionParams(**{f.name: getattr(self, f.name)[...] for f in dataclasses.fields(AttentionParams)})

    def prefill(self, x, cos_sin, kv_cache, index_cache, slots, *, query_chunk: int = PREFILL_QUERY_CHUNK):
        """Per rank: x [B, T, D] replicated (every prompt token), cos/sin [B, T, E/2], this rank's kv_cache
        [pages, Bp, C+E] and index_cache [pages, Bp, J] (or their fp8 forms, `latent_format.py`, `index_format.py`),
        slots [B, T] (-1: not owned or pad, no write).

        HF's sparse rule per query s: keys t <= s, the top-min(K, s+1) by index score (with an fp8 index cache,
        the scores of the fp8 queries and the fp8 keys it stores, as decode computes them), attending over the
        latents as the cache stores them (an fp8 cache's dequantized values). Queries run in chunks
        of `query_chunk` (one `lax.map` step each), so the index scores take O(B * chunk * T) memory and attention
        gathers each query's K selected latents, O(B * chunk * K); neither is O(T^2). Pad queries past a
        prompt's end compute garbage that nobody reads; a valid query never sees a later (pad) key.
        Returns (output [B, T, D] summed over TP ranks, kv_cache, index_cache, selected ids [B, T, K]).
        """
        cfg, p = self.cfg, self.params()
        b, t, d = x.shape
        cos, sin = (a.reshape(b * t, -1) for a in cos_sin)
        flat = x.reshape(b * t, d)
        # 1. Projections of every token, index queries and keys in the index cache's format; each token's latent
        # and index key are written by its owner only.
        with jax.named_scope("projections"):
            q_resid, q_nope, q_pe = projections.mla_query(p, flat, cos, sin, cfg)
            index_q, weights = index_format.encode_queries(
                projections.index_query(p, q_resid, cos, sin, cfg).reshape(b, t, cfg.index_n_heads, -1),
                projections.index_weights(p, flat, cfg).reshape(b, t, -1), index_cache)
            latent = latent_format.encode(projections.mla_latent(p, flat, cos, sin, cfg), kv_cache)
            index_k = index_format.encode_keys(projections.index_key(p, flat, cos, sin, cfg), index_cache)
            kv_cache = write_slots(kv_cache, slots.reshape(-1), latent)
            index_cache = write_slots(index_cache, slots.reshape(-1), index_k)
            q = projections.absorb_query(p, q_nope, q_pe).reshape(b, t, -1, cfg.latent_dim)
        latent = latent_format.values(latent).reshape(b, t, cfg.latent_dim)  # as the cache stores them
        index_k = jax.tree.map(lambda a: a.reshape(b, t, *a.shape[1:]), index_k)
        chunk = min(query_chunk, t)
        num_chunks = -(-t // chunk)
        padded = num_chunks * chunk

        def by_chunk(a):  # [B, T, ...] -> [num_chunks, B, chunk, ...], pad queries past T
            a = jnp.pad(a, [(0, 0), (0, padded - t)] + [(0, 0)] * (a.ndim - 2))
            return jnp.moveaxis(a.reshape(b, num_chunks, chunk, *a.shape[2:]), 1, 0)

        def attend_chunk(args):
            first, chunk_index_q, chunk_weights, chunk_q = args
            # 2. Index scores of this chunk's queries over the causal prefix, then the top-min(K, s+1) per query.
            with jax.named_scope("indexer"):
                scores = index_format.dense_scores(chunk_index_q, chunk_weights, index_k)
                causal_lens = jnp.minimum(first + jnp.arange(1, chunk + 1, dtype=jnp.int32), t)
                _, selected = reference.topk(scores.reshape(b * chunk, t), jnp.tile(causal_lens, b),
                                             k=cfg.index_topk)
                selected = selected.reshape(b, chunk, -1)
            # 3. Absorbed MLA over the gathered selected latents of this rank's heads.
            with jax.named_scope("sparse_mla"):
                keys = latent[jnp.arange(b)[:, None, None], jnp.maximum(selected, 0)]  # [B, chunk, K, C+E]
                # f32 logits, softmax and value accumulation in any dtype (HF: fp32 softmax; decode's kernel: f32).
                logits = jnp.einsum("bshc,bskc->bhsk", chunk_q, keys, precision=HIGHEST,
                                    preferred_element_type=jnp.float32) * cfg.softmax_scale
                logits = jnp.where((selected >= 0)[:, None], logits, NEG_INF)
                probs = jax.nn.softmax(logits, axis=-1)
                out = jnp.einsum("bhsk,bskc->bshc", probs, keys[..., : cfg.kv_lora_rank].astype(jnp.float32),
                                 precision=HIGHEST, preferred_element_type=jnp.float32).astype(x.dtype)
            return out, selected

        firsts = jnp.arange(num_chunks, dtype=jnp.int32) * chunk
        out, selected = jax.lax.map(attend_chunk, (firsts, by_chunk(index_q), by_chunk(weights), by_chunk(q)))
        out = jnp.moveaxis(out, 0, 1).reshape(b, padded, *out.shape[3:])[:, :t]
        selected = jnp.moveaxis(selected, 0, 1).reshape(b, padded, -1)[:, :t]
        # 4. W_UV, o_proj and the TP all-reduce.
        attn = jax.lax.psum(projections.output_projection(p, out.reshape(b * t, -1, cfg.kv_lora_rank)), HEADS)
        return attn.reshape(b, t, d), kv_cache, index_cache, selected

    def decode(self, x, cos_sin, kv_cache, index_cache, local_lens, slots, block_tables, *, layout: DcpLayout,
               kernels: Kernels):
        """Per rank: the sparse DCP decode layer of `attention/decode.py` (x [R, D], kv_cache [pages, Bp, C+E]
        and index_cache [pages, Bp, J] or their fp8 forms, local_lens / slots [R], block_tables [R, P]), also returning
        the global top-k ids. Returns (output [R, D] summed over TP ranks, kv_cache, index_cache, selected [R, K])."""
        return sparse_dcp_attention(self.params(), x, kv_cache, index_cache, cos_sin, local_lens, slots, block_tables,
                                    cfg=self.cfg, layout=layout, kernels=kernels)


class MLP(nnx.Module):
    """down(silu(gate x) * up x); also the shared experts (width moe_intermediate_size * n_shared_experts)."""

    def __init__(self, hidden: int, width: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.gate = _dense(rngs, (hidden, width), hidden, dtype)
        self.up = _dense(rngs, (hidden, width), hidden, dtype)
        self.down = _dense(rngs, (width, hidden), width, dtype)

    def partial(self, x):
        """Per rank, width F split over TP ranks: x [..., D] -> this rank's share [..., D] of the output."""
        gate = jnp.einsum("...d,df->...f", x, self.gate[...], precision=HIGHEST)
        up = jnp.einsum("...d,df->...f", x, self.up[...], precision=HIGHEST)
        return jnp.einsum("...f,fd->...d", jax.nn.silu(gate) * up, self.down[...], precision=HIGHEST)

    def __call__(self, x):
        """Per rank: x [..., D] -> [..., D], summed over the TP ranks."""
        return jax.lax.psum(self.partial(x), HEADS)


class MoE(nnx.Module):
    """DeepSeek MoE: sigmoid router with e_score_correction_bias, group-limited top-k, shared experts."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d, x, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.cfg = cfg
        self.router = _dense(rngs, (d, x), d, jnp.float32)
        self.router_bias = nnx.Param(0.1 * jax.random.normal(rngs.params(), (x,), jnp.float32))
        self.experts_gate = _dense(rngs, (x, d, f), d, dtype)
        self.experts_up = _dense(rngs, (x, d, f), d, dtype)
        self.experts_down = _dense(rngs, (x, f, d), f, dtype)
        self.shared = MLP(d, f * cfg.n_shared_experts, rngs=rngs, dtype=dtype)

    def route(self, x):
        """x [R, D] -> dense combine weights [R, X] f32 (zero for experts a token does not use)."""
        cfg = self.cfg
        logits = jnp.einsum("rd,dx->rx", x.astype(jnp.float32), self.router[...], precision=HIGHEST)
        scores = jax.nn.sigmoid(logits)
        choice = scores + self.router_bias[...]
        rows = x.shape[0]
        grouped = choice.reshape(rows, cfg.n_group, -1)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [R, groups]: sum of each group's top-2
        _, kept_groups = jax.lax.top_k(group_scores, cfg.topk_group)
        is_kept = jnp.zeros((rows, cfg.n_group), bool).at[jnp.arange(rows)[:, None], kept_groups].set(True)
        masked = jnp.where(jnp.repeat(is_kept, grouped.shape[-1], axis=1), choice, NEG_INF)
        _, experts = jax.lax.top_k(masked, cfg.num_experts_per_tok)  # [R, k]
        weights = jnp.take_along_axis(scores, experts, axis=1)  # unbiased scores
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        weights = weights * cfg.routed_scaling_factor
        return jnp.zeros_like(scores).at[jnp.arange(rows)[:, None], experts].add(weights)

    def __call__(self, x):
        """Per rank, the X routed experts split over TP ranks: x [..., D] -> [..., D], summed over the ranks.
        Each rank runs its experts densely on every token, weighted by the (replicated) router."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        local_experts = self.experts_gate.shape[0]
        first = jax.lax.axis_index(HEADS) * local_experts
        combine = jax.lax.dynamic_slice_in_dim(self.route(flat), first, local_experts, axis=1)  # [R, X/tp]
        gate = jnp.einsum("rd,xdf->rxf", flat, self.experts_gate[...], precision=HIGHEST)
        up = jnp.einsum("rd,xdf->rxf", flat, self.experts_up[...], precision=HIGHEST)
        per_expert = jnp.einsum("rxf,xfd->rxd", jax.nn.silu(gate) * up, self.experts_down[...], precision=HIGHEST)
        routed = jnp.einsum("rx,rxd->rd", combine.astype(per_expert.dtype), per_expert, precision=HIGHEST)
        return jax.lax.psum(routed + self.shared.partial(flat), HEADS).reshape(shape)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.input_norm = _norm(rngs, cfg.hidden_size, dtype)
        self.post_attention_norm = _norm(rngs, cfg.hidden_size, dtype)
        self.attention = Attention(cfg, rngs=rngs, dtype=dtype)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, rngs=rngs, dtype=dtype)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype)

    def attention_input(self, h):
        return rms_norm(h, self.input_norm[...], self.cfg.rms_norm_eps)

    def feed_forward(self, h):
        """h + MLP/MoE(post-attention norm of h)."""
        return h + self.mlp(rms_norm(h, self.post_attention_norm[...], self.cfg.rms_norm_eps))


class DeepseekV32(nnx.Module):
    """The whole model; `prefill` and `decode` of `model_step.py` drive the layers."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size)).astype(dtype))
        self.layers = nnx.List(
            [DecoderLayer(cfg, i, rngs=rngs, dtype=dtype) for i in range(cfg.num_hidden_layers)]
        )
        self.final_norm = _norm(rngs, cfg.hidden_size, dtype)
        self.lm_head = _dense(rngs, (cfg.hidden_size, cfg.vocab_size), cfg.hidden_size, dtype)

    def embed_tokens(self, tokens):
        return jnp.take(self.embed[...], tokens, axis=0)

    def logits(self, h):
        """h [..., D] -> f32 logits [..., A] (final RMSNorm, untied lm_head)."""
        h = rms_norm(h, self.final_norm[...], self.cfg.rms_norm_eps)
        return jnp.einsum("...d,da->...a", h, self.lm_head[...], precision=HIGHEST).astype(jnp.float32)


# Attention fields split over heads (every TP rank), from `attention/params.py`.
_HEAD_SPECS = {f.name: getattr(partition_specs(), f.name) for f in dataclasses.fields(AttentionParams)}
# MLP / shared-expert width and routed experts split over every TP rank.
_FEED_FORWARD_SPECS = {
    "gate": P(None, HEADS), "up": P(None, HEADS), "down": P(HEADS, None),
    "experts_gate": P(HEADS, None, None), "experts_up": P(HEADS, None, None), "experts_down": P(HEADS, None, None),
}


def param_specs(params: dict) -> dict:
    """PartitionSpecs for the pure-dict state of `DeepseekV32`: attention heads, MLP widths and routed experts
    split over every TP rank; the rest replicated."""

    def spec(path, _):
        names = [getattr(k, "key", None) for k in path]
        if "attention" in names:
            return _HEAD_SPECS[names[-1]]
        if "mlp" in names:
            return _FEED_FORWARD_SPECS.get(names[-1], P())
        return P()

    return jax.tree_util.tree_map_with_path(spec, params)


def check_divisible(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError unless every dimension split over the `tp` ranks divides evenly."""
    split = {
        "num_attention_heads": cfg.num_attention_heads,
        "intermediate_size": cfg.intermediate_size,
        "n_routed_experts": cfg.n_routed_experts,
        "moe_intermediate_size * n_shared_experts": cfg.moe_intermediate_size * cfg.n_shared_experts,
    }
    bad = {name: size for name, size in split.items() if size % tp}
    if bad:
        raise ValueError(f"tp={tp} must divide {bad}")


def abstract_model(cfg: ModelConfig, dtype=jnp.float32):
    """(graphdef, abstract pure-dict state of ShapeDtypeStructs) without allocating anything."""
    model = nnx.eval_shape(lambda: DeepseekV32(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, state = nnx.split(model)
    return graphdef, state


def init_params(cfg: ModelConfig, seed: int, dtype=jnp.float32) -> dict:
    """Random weights (normal / sqrt(fan_in), norms 1 + 0.1 normal) as a pure dict of jax arrays: the full,
    unsharded model on the default device (device 0), router / router_bias / index_weights in f32, the rest in
    `dtype`. `jax.device_put` them with `param_specs` to shard."""
    return nnx.to_pure_dict(nnx.state(DeepseekV32(cfg, rngs=nnx.Rngs(seed), dtype=dtype)))


def merge(graphdef, abstract_state, params: dict) -> DeepseekV32:
    """A model whose weights are the arrays of `params` (a pure dict; traced values inside jit work)."""
    state = jax.tree.map(lambda x: x, abstract_state)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)
