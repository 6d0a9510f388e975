"""The model's per-rank decode and prefill bodies (run inside shard_map by `step.DecodeStep` / `PrefillStep`), with
the next tokens sampled on the device.

Decode: the rows' input tokens (host-given, or each slot's last sampled token) -> embeddings -> per layer (sparse DCP
attention, MLP / MoE) -> final norm -> lm_head logits -> the sampler (`sampler.py`): each row's next token and its
logprobs, recorded in its slot of the sampler state.
Prefill (tensor parallel): the sampler slots of the rows start from their requests' histories; every rank computes
the whole prompt (heads split over TP as in decode) with HF's sparse rule, writes each token's latent and index key
into its owner's shard at the host-computed slots of the step's `PrefillMetadata`, and samples the first token
from the last prompt position's logits. With `PREFILL_PROMPT_LOGPROBS` it also returns each prompt token's logprob
and the top ones at every position, chunk by chunk (never the [T, A] logits).
The `details` variants also return the logits and the per-layer selected global top-k ids (the oracle tests); they
sample greedily.
Letters: R rows, T tokens of a row, K index top-k, A vocab, N top logprobs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dcp_jax.config import ModelConfig
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.metadata import DecodeInputs, DecodeMetadata, PrefillInputs, PrefillMetadata
from dcp_jax.model.deepseek_v32 import merge
from dcp_jax.model.kv_cache import KV_CACHE_SPECS, KVCache, from_layers
from dcp_jax.model.rope import cos_sin, rope_tables
from dcp_jax.runtime import sampler
from dcp_jax.runtime.sampler import SamplerState

# The decode programs of one bucket: every row greedy (no draw), rows that draw (any mix of parameters), and greedy
# with the details. The host picks greedy or sampled from the step's parameters (`sampler.sample`'s draws).
DECODE_GREEDY, DECODE_SAMPLED, DECODE_DETAILS = "greedy", "sampled", "details"
DECODE_VARIANTS = (DECODE_GREEDY, DECODE_SAMPLED, DECODE_DETAILS)
# What a prefill program returns besides the first token: nothing, the prompt's logprobs, or the details. Serving
# prefills draw (one row: the draw costs little); the details one is greedy.
PREFILL_FIRST_TOKEN, PREFILL_PROMPT_LOGPROBS, PREFILL_DETAILS = "first_token", "prompt_logprobs", "details"
PREFILL_OUTPUTS = (PREFILL_FIRST_TOKEN, PREFILL_PROMPT_LOGPROBS, PREFILL_DETAILS)
# Prompt positions whose logits one step of the prompt-logprobs loop holds: [R, 256, A] f32 (132 MB at A = 129280).
PROMPT_LOGPROBS_CHUNK = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceState:
    """What every program reads and donates: the paged KV pools (split over "dcp") and the sampler state
    (replicated: every rank samples the same tokens from the same replicated logits)."""

    kv_cache: KVCache
    sampler: SamplerState


STATE_SPECS = DeviceState(kv_cache=KV_CACHE_SPECS, sampler=SamplerState(P(), P(), P()))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Details:
    """The detailed outputs: logits f32 ([R, A] decode, [R, T, A] prefill) and the selected global top-k ids
    ([layers, R, K] decode, [layers, R, T, K] prefill), -1 padded."""

    logits: jax.Array
    selected: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """At each prompt position t: the logprob of token t + 1 under the raw logits of position t, and the N most
    likely tokens there. [R, T], [R, T, N] int32, [R, T, N] f32; the last position (and pads) hold garbage."""

    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def _layers(model, state: DeviceState, hidden, rope, attend):
    """Run every decoder layer; attend(layer, x, kv pools) -> (attention out, pools, selected). Returns (hidden,
    kv_cache, selected [layers, ...])."""
    caches, selected = [], []
    for i, layer in enumerate(model.layers):
        with jax.named_scope(f"layer_{i}"):
            attn, lat, idx, sel = attend(layer, layer.attention_input(hidden), state.kv_cache.layer(i))
            hidden = layer.feed_forward(hidden + attn)
        caches.append((lat, idx))
        selected.append(sel)
    return hidden, from_layers(caches), jnp.stack(selected)


def decode_body(params, state: DeviceState, inputs: DecodeInputs, md: DecodeMetadata, *, graphdef, abstract,
                cfg: ModelConfig, layout: DcpLayout, backend: str, variant: str):
    """Per rank: inputs and md the rank's view of the step's data; `variant` one of DECODE_VARIANTS. Returns (the
    sampled tokens packed (`sampler.pack`), or SampledTokens and Details for DECODE_DETAILS; the new DeviceState).
    Pad rows read and write no KV (their sampler slot is the scratch one)."""
    model = merge(graphdef, abstract, params)
    tokens = sampler.decode_inputs(state.sampler, inputs.tokens, inputs.sampling.slots)
    rope = cos_sin(md.positions, *rope_tables(cfg))
    hidden, kv_cache, selected = _layers(
        model, state, model.embed_tokens(tokens), rope,
        lambda layer, x, pools: layer.attention.decode(x, rope, *pools, md, layout=layout, backend=backend))
    logits = model.logits(hidden)
    sampled, sampler_state = sampler.sample_decode(logits, inputs.sampling, state.sampler,
                                                   draws=variant == DECODE_SAMPLED)
    outputs = (sampled, Details(logits, selected)) if variant == DECODE_DETAILS else sampler.pack(sampled)
    return outputs, DeviceState(kv_cache, sampler_state)


def prompt_logprobs(model, hidden, tokens) -> PromptLogprobs:
    """PromptLogprobs of hidden [R, T, D] (after the last layer) and the prompt tokens [R, T], PROMPT_LOGPROBS_CHUNK
    positions at a time."""
    r, t, _ = hidden.shape
    chunk = min(PROMPT_LOGPROBS_CHUNK, t)
    padded = -(-t // chunk) * chunk
    nxt = jnp.pad(tokens[:, 1:], ((0, 0), (0, padded - t + 1)))
    hidden = jnp.pad(hidden, ((0, 0), (0, padded - t), (0, 0)))

    def one_chunk(args):
        h, following = args  # [R, chunk, D], [R, chunk]
        lps = jax.nn.log_softmax(model.logits(h), axis=-1)
        top_lps, top_ids = jax.lax.top_k(lps, min(sampler.TOP_LOGPROBS, lps.shape[-1]))
        return jnp.take_along_axis(lps, following[..., None], axis=-1)[..., 0], top_ids.astype(jnp.int32), top_lps

    def by_chunk(a):
        return jnp.moveaxis(a.reshape(r, padded // chunk, chunk, *a.shape[2:]), 1, 0)

    def unchunk(a):
        return jnp.moveaxis(a, 0, 1).reshape(r, padded, *a.shape[3:])[:, :t]

    return PromptLogprobs(*(unchunk(a) for a in jax.lax.map(one_chunk, (by_chunk(hidden), by_chunk(nxt)))))


def prefill_body(params, state: DeviceState, inputs: PrefillInputs, md: PrefillMetadata, *, graphdef, abstract,
                 cfg: ModelConfig, outputs: str):
    """Per rank: inputs and md the rank's view of the step's data. Returns (the sampled tokens packed
    (`sampler.pack`), with PromptLogprobs too, or SampledTokens and Details, as `outputs` says; the new
    DeviceState)."""
    model = merge(graphdef, abstract, params)
    sampler_state = sampler.start_slots(state.sampler, inputs.tokens, inputs.roles, inputs.sampling.slots)
    rope = cos_sin(md.positions, *rope_tables(cfg))
    hidden, kv_cache, selected = _layers(
        model, state, model.embed_tokens(inputs.tokens), rope,
        lambda layer, x, pools: layer.attention.prefill(x, rope, *pools, md.slot_mapping))
    last = hidden[jnp.arange(inputs.tokens.shape[0]), md.logits_indices]
    sampled, sampler_state = sampler.sample_prefill(model.logits(last), inputs.sampling, inputs.resume_tokens,
                                                    sampler_state, draws=outputs != PREFILL_DETAILS)
    new_state = DeviceState(kv_cache, sampler_state)
    if outputs == PREFILL_DETAILS:
        return (sampled, Details(model.logits(hidden), selected)), new_state
    if outputs == PREFILL_PROMPT_LOGPROBS:
        return (sampler.pack(sampled), prompt_logprobs(model, hidden, inputs.tokens)), new_state
    return sampler.pack(sampled), new_state

