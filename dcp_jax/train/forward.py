"""The model over whole sequences, differentiable, for training: causal MLA with the lightning indexer, attending
densely (every earlier token, explicit per-head keys as HF writes it) or sparsely (the indexer's top-k, selected
exactly as the serving step selects, a chunk of queries at a time, then gathered from the latents: the attention's
memory grows with T K, the selection's with T times a chunk, so 16K-token sequences fit), and the indexer's KL
loss toward the main attention (DeepSeek-V3.2's dense warm-up and sparse stages).

Same weights and projections (`attention/projections.py`) as the serving programs, so a sparse forward's logits are
the serving prefill's (tested), with either cache format: a forward reads through `CacheFormats`, where 'fp8'
rounds the index keys and queries, or the latents, to what that cache stores and scores, the gradient passing
straight through the rounding (quantization-aware training; as the reference kernels compute: the GPU sparse MLA
kernel also rounds the queries and probabilities to bf16, which is not modelled). The indexer reads its inputs
detached from the main model's graph: the LM loss never trains the indexer and the KL loss trains nothing else
(the paper's separate optimization). Letters: see the legend in `dcp_jax/__init__.py`; R query positions, T key
positions (R = T: one sequence).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dcp_jax.config import ModelConfig, check_index_cache
from dcp_jax.model import fp8_linear
from dcp_jax.model.attention import cache_formats, projections
from dcp_jax.model.attention.params import DsaParams
from dcp_jax.model.attention.variant import CacheFormats
from dcp_jax.model.rope import cos_sin, rope_tables
from pallas_kernels import formats, reference

HIGHEST = jax.lax.Precision.HIGHEST
DENSE, SPARSE = "dense", "sparse"
# Evaluation only: index_topk keys drawn at random among the earlier ones (the contrast that shows the indexer's
# selection matters).
RANDOM = "random"
# The kernels backend of the training forward: the references, differentiable (the Pallas kernels have no VJP).
FORWARD_BACKEND = "reference"


def straight_through(x, rounded):
    """`rounded`'s values with `x`'s gradient (the rounding's gradient taken as the identity)."""
    return x + jax.lax.stop_gradient(rounded.astype(x.dtype) - x)


def through_fp8_index_cache(x):
    """Index queries [..., I, J] or keys [..., J] as the fp8 index cache scores them: Hadamard-rotated, then e4m3
    with a power-of-two scale per vector (`formats.quantize_index_keys`: per token for keys, per (row, head) for
    queries, as `quantize_index_queries`); their dot products are the unrotated ones up to the rounding."""
    stored = formats.kept_e4m3(formats.quantize_index_keys(x))
    return straight_through(formats.hadamard(x), formats.dequantize_index_keys(stored))


def through_latent_cache(latent, cfg: ModelConfig, latent_cache: str):
    """Latents [T, C+E] as a `latent_cache` cache holds them: unchanged ('exact') or the fp8 format's values."""
    cache_formats.check_latent_format(latent_cache, cfg)
    if latent_cache == "exact":
        return latent
    cache = formats.kept_e4m3(formats.quantize_latent_cache(latent, value_dim=cfg.kv_lora_rank))
    return straight_through(latent, formats.dequantize_latent_cache(cache))


class IndexerInputs(NamedTuple):
    """The indexer's queries [R, I, J], weights [R, I] and keys [T, J] of one sequence, from inputs detached from
    the main model's graph (the KL loss trains the indexer alone)."""

    queries: jax.Array
    weights: jax.Array
    keys: jax.Array


def indexer_inputs(p: DsaParams, x, q_resid, cos, sin, cfg: ModelConfig,
                   index_cache: str = "exact") -> IndexerInputs:
    check_index_cache(index_cache)
    x, q_resid = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_resid)
    queries = projections.index_query(p, q_resid, cos, sin, cfg, backend=FORWARD_BACKEND)
    keys = projections.index_key(p, x, cos, sin, cfg, backend=FORWARD_BACKEND)
    if index_cache == "fp8":
        queries, keys = through_fp8_index_cache(queries), through_fp8_index_cache(keys)
    return IndexerInputs(queries, projections.index_weights(p, x, cfg), keys)


def index_scores(indexer: IndexerInputs):
    """The indexer's scores [R, T] f32 of every position against every position (causality not applied)."""
    return cache_formats.dense_index_scores(indexer.queries[None], indexer.weights[None], indexer.keys[None])[0]


# Queries whose indexer scores the sparse selection holds at once: [512, I, T] f32, 256 MiB at T = 16K, I = 8.
SELECTION_CHUNK = 512


def selected_keys(indexer: IndexerInputs, *, cfg: ModelConfig, mode: str, key=None):
    """[R, K] int32: the keys each query attends, -1 padded (K = index_topk). SPARSE: the indexer's top index_topk
    of the earlier keys and itself (all of them while fewer), ties to the lower position (`reference.topk`, as
    served), SELECTION_CHUNK queries at a time; RANDOM: as many drawn uniformly (by `key`)."""
    s = indexer.queries.shape[0]
    lengths = jnp.arange(1, s + 1, dtype=jnp.int32)
    if mode == RANDOM:
        if key is None:
            raise ValueError("a RANDOM selection needs a key")
        return reference.topk(jax.random.uniform(key, (s, indexer.keys.shape[0])), lengths, k=cfg.indexer.topk)[1]
    if mode != SPARSE:
        raise ValueError(f"a selection's mode must be {SPARSE!r} or {RANDOM!r}, got {mode!r}")
    indexer = jax.tree.map(jax.lax.stop_gradient, indexer)
    chunk = min(SELECTION_CHUNK, s)
    padded = -(-s // chunk) * chunk

    def one_chunk(args):
        queries, weights, chunk_lengths = args
        scores = cache_formats.dense_index_scores(queries[None], weights[None], indexer.keys[None])[0]
        return reference.topk(scores, chunk_lengths, k=cfg.indexer.topk)[1]

    def split(a):
        return jnp.pad(a, [(0, padded - s)] + [(0, 0)] * (a.ndim - 1)).reshape(-1, chunk, *a.shape[1:])

    selected = jax.lax.map(one_chunk, (split(indexer.queries), split(indexer.weights), split(lengths)))
    return selected.reshape(padded, -1)[:s]


def indexer_kl(scores, probs, keep):
    """KL(target || indexer) summed over the kept keys, averaged over queries: the target is the main attention's
    probabilities [H, R, K] summed over heads and renormalized over `keep` [R, K] (no gradient), the indexer's
    distribution the softmax of its `scores` [R, K] over `keep`."""
    target = jnp.where(keep, jax.lax.stop_gradient(probs.sum(axis=0)), 0.0)
    target = target / jnp.maximum(target.sum(axis=-1, keepdims=True), 1e-30)
    log_indexer = jax.nn.log_softmax(jnp.where(keep, scores, -jnp.inf), axis=-1)
    terms = jnp.where(keep & (target > 0), target * (jnp.log(jnp.where(target > 0, target, 1.0)) - log_indexer), 0.0)
    return terms.sum() / scores.shape[0]


def dense_attention(p: DsaParams, q_nope, q_pe, latent, indexer: IndexerInputs, cfg: ModelConfig):
    """Every query attends every earlier key and itself, with explicit per-head keys and values (as HF writes
    it): (output [R, D], the indexer's KL over the same keys)."""
    c, k_pe = latent[:, : cfg.kv_lora_rank], latent[:, cfg.kv_lora_rank:]
    k_nope, values = projections.per_head_keys_values(p, c)
    logits = (jnp.einsum("shn,thn->hst", q_nope, k_nope, precision=HIGHEST)
              + jnp.einsum("she,te->hst", q_pe, k_pe, precision=HIGHEST)) * cfg.softmax_scale
    s, t = logits.shape[1:]
    causal = jnp.arange(t)[None, :] <= jnp.arange(s)[:, None]
    probs = jax.nn.softmax(jnp.where(causal[None], logits.astype(jnp.float32), -jnp.inf), axis=-1)
    per_head = jnp.einsum("hst,thv->shv", probs.astype(values.dtype), values, precision=HIGHEST)
    out = fp8_linear.einsum("shv,hvd->sd", per_head, p.wo, backend=FORWARD_BACKEND)
    return out, indexer_kl(index_scores(indexer), probs, causal)


def sparse_attention(p: DsaParams, q_nope, q_pe, latent, indexer: IndexerInputs, selected,
                     cfg: ModelConfig):
    """Each query attends its `selected` keys [R, K] only, gathered from the latents (the MQA form the serving
    step computes): (output [R, D], the indexer's KL over the selected keys). Memory grows with R K, not R T."""
    keep = selected >= 0
    rows = jnp.maximum(selected, 0)
    gathered = latent[rows]  # [R, K, C+E]
    query = projections.absorb_query(p, q_nope, q_pe)  # [R, H, C+E]
    logits = jnp.einsum("shc,skc->hsk", query, gathered, precision=HIGHEST) * cfg.softmax_scale
    probs = jax.nn.softmax(jnp.where(keep[None], logits.astype(jnp.float32), -jnp.inf), axis=-1)
    latent_out = jnp.einsum("hsk,skc->shc", probs.astype(latent.dtype), gathered[..., : cfg.kv_lora_rank],
                            precision=HIGHEST)
    # The indexer's scores of the selected keys alone (`dense_index_scores`' terms), with their gradient.
    dots = jnp.einsum("sij,skj->sik", indexer.queries, indexer.keys[rows], precision=HIGHEST,
                      preferred_element_type=jnp.float32)
    scores = jnp.einsum("si,sik->sk", indexer.weights, jax.nn.relu(dots), precision=HIGHEST,
                        preferred_element_type=jnp.float32)
    return projections.output_projection(p, latent_out, backend=FORWARD_BACKEND), indexer_kl(scores, probs, keep)


def causal_attention(p: DsaParams, x, cos, sin, *, cfg: ModelConfig, mode: str, key=None,
                     caches: CacheFormats = CacheFormats()):
    """x [T, D] one sequence's normed hidden states -> (attention output [T, D], the indexer's KL loss, the keys
    each position attended [T, K], -1 padded; K = 0 for DENSE, where every earlier key is), the keys and latents
    read through `caches`."""
    if mode not in (DENSE, SPARSE, RANDOM):
        raise ValueError(f"mode must be {DENSE!r}, {SPARSE!r} or {RANDOM!r}, got {mode!r}")
    q_a, ckv = projections.low_rank_projections(p, x, cfg, backend=FORWARD_BACKEND)
    q_resid, q_nope, q_pe = projections.mla_query(p, q_a, cos, sin, cfg, backend=FORWARD_BACKEND)
    latent = projections.mla_latent(p, ckv, cos, sin, cfg)
    latent = through_latent_cache(latent, cfg, caches.latent)
    indexer = indexer_inputs(p, x, q_resid, cos, sin, cfg, caches.index)
    if mode == DENSE:
        out, kl = dense_attention(p, q_nope, q_pe, latent, indexer, cfg)
        return out, kl, jnp.zeros((x.shape[0], 0), jnp.int32)
    selected = selected_keys(indexer, cfg=cfg, mode=mode, key=key)
    out, kl = sparse_attention(p, q_nope, q_pe, latent, indexer, selected, cfg)
    return out, kl, selected


def feed_forward(layer, hidden):
    """`DecoderLayer.feed_forward` on one device: the MLP or MoE whole (its output not summed over ranks), on the
    references (the MoE's dense experts): differentiable."""
    return hidden + layer.mlp.partial(layer.mlp_input(hidden), backend=FORWARD_BACKEND)


class SequenceOutput(NamedTuple):
    logits: jax.Array  # [T, A] f32, at every position
    hidden: jax.Array  # [T, D]: the last layer's output, before the final norm
    indexer_kl: jax.Array  # f32: the indexer's KL loss, averaged over layers
    selected: jax.Array  # [layers, T, K] int32: the keys each position attended in each layer, -1 padded (K = 0:
    # DENSE, every earlier key)


def decoder_layer_forward(layer, hidden, cos, sin, *, cfg: ModelConfig, mode: str, key=None,
                          caches: CacheFormats = CacheFormats()):
    """One `DecoderLayer` over a sequence: (hidden [T, D] out, the indexer's KL, the selected keys [T, K])."""
    out, kl, selected = causal_attention(layer.attention.params(), layer.attention_input(hidden), cos, sin, cfg=cfg,
                                         mode=mode, key=key, caches=caches)
    return feed_forward(layer, hidden + out), kl, selected


def sequence_forward(model, tokens, *, mode: str, key=None, caches: CacheFormats = CacheFormats()) -> SequenceOutput:
    """tokens [T] int32 through `model` (a `DeepseekV32`, unsharded, outside shard_map), attending as `mode`
    (RANDOM draws each layer's keys from `key`) through `caches`."""
    cfg = model.cfg
    cos, sin = cos_sin(jnp.arange(tokens.shape[0]), *rope_tables(cfg))
    hidden, kl, selected = model.embed_tokens(tokens), 0.0, []
    for index in range(cfg.num_hidden_layers):
        hidden, layer_kl, layer_selected = decoder_layer_forward(
            model.decoder_layer(index), hidden, cos, sin, cfg=cfg, mode=mode,
            key=None if key is None else jax.random.fold_in(key, index), caches=caches)
        kl = kl + layer_kl
        selected.append(layer_selected)
    return SequenceOutput(model.logits(hidden), hidden, kl / cfg.num_hidden_layers, jnp.stack(selected))


class MtpOutput(NamedTuple):
    logits: jax.Array  # [T-1, A] f32: at row r, of token r + 2
    indexer_kl: jax.Array  # f32: the MTP layer's indexer's KL loss
    selected: jax.Array  # [T-1, K] int32, as SequenceOutput's


def mtp_forward(model, mtp, tokens, hidden, *, mode: str, caches: CacheFormats = CacheFormats()) -> MtpOutput:
    """The MTP layer (`model/mtp.py`, an `MtpLayer`) over tokens [T] given the main model's `hidden` [T, D]
    (`SequenceOutput.hidden`): row r (position r) reads the main model's state of r and token r + 1's embedding
    and predicts token r + 2, for r in 0..T-2; the embedding and the head are `model`'s."""
    cfg = model.cfg
    positions = jnp.arange(tokens.shape[0] - 1)
    cos, sin = cos_sin(positions, *rope_tables(cfg))
    h = mtp.layer_input(model.embed_tokens(tokens[1:]), model.final_hidden(hidden[:-1]), positions == 0)
    h, kl, selected = decoder_layer_forward(mtp.layer, h, cos, sin, cfg=cfg, mode=mode, caches=caches)
    return MtpOutput(model.head(mtp.head_input(h)), kl, selected)
