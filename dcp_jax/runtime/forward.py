"""The model's per-rank step body (run inside shard_map by `step.StepProgram`), with the next tokens sampled on the
device.

A step's rows are decode rows and the tokens of prefill chunks alike (`host/metadata.py`): the rows' tokens (host-
given, or each slot's last sampled token) join their requests' sampler histories -> embeddings -> per layer (sparse
DCP attention, MLP / MoE) -> final norm -> lm_head logits of the sampled rows only (a decode row, a prompt's last
token) -> the sampler (`sampler.py`): each sampled row's next token and its logprobs, recorded in its slot of the
sampler state. With an MTP layer (speculative decoding) a request samples a group of rows instead, its decode row
and its drafts' (N + 1), and the device verifies the drafts (`speculative.verify_groups`); the MTP layer then runs
over every row with the token after it (the prompt's next, or the one emitted there) and writes its own cache; its
argmax at a request's last emitted row is the request's next first draft, and with N >= 2 chained passes of one row
a request (`_chained_drafts`) draft the others, all kept in the device state. The prompt-logprobs
variant also returns, for every row, the logprob of the token after it and the top ones, chunk by chunk (never the
[R, A] logits at once); the details variant returns every row's logits and the per-layer selected global top-k ids
(the oracle tests).
Letters: R rows, Q sampled rows, K index top-k, A vocab, N top logprobs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from dcp_jax.config import ModelConfig
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.metadata import DRAFT_TOKEN, StepInputs, StepMetadata
from dcp_jax.model.deepseek_v32 import layer_stacks, merge
from dcp_jax.model.kv_cache import KV_CACHE_SPECS, KVCache, on_layer
from dcp_jax.model.rope import cos_sin, rope_tables
from dcp_jax.runtime import sampler
from dcp_jax.runtime.sampler import SamplerState
from dcp_jax.runtime.speculative import verify_groups

# The programs of one bucket: its sampled rows all greedy (no draw); rows that draw (any mix of parameters); drawing,
# with every row's prompt logprobs; greedy, with the details. The host picks one from the step's rows.
GREEDY, SAMPLED, PROMPT_LOGPROBS, DETAILS = "greedy", "sampled", "prompt_logprobs", "details"
VARIANTS = (GREEDY, SAMPLED, PROMPT_LOGPROBS, DETAILS)
# Rows whose logits one step of the prompt-logprobs loop holds: [256, A] f32 (132 MB at A = 129280).
PROMPT_LOGPROBS_CHUNK = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceState:
    """What every program reads and donates: the paged KV pools (split over "dcp") and the sampler state
    (replicated: every rank samples the same tokens from the same replicated logits)."""

    kv_cache: KVCache
    sampler: SamplerState
    # [slots, N] int32 (replicated): each slot's N tokens drafted by the MTP layer after its last emitted row; None
    # without an MTP layer.
    drafts: jax.Array | None = None


def state_specs(*, drafts: bool) -> DeviceState:
    """The PartitionSpecs of a DeviceState (with the drafts or without)."""
    return DeviceState(kv_cache=KV_CACHE_SPECS, sampler=SamplerState(P(), P(), P()), drafts=P() if drafts else None)


STATE_SPECS = state_specs(drafts=False)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Details:
    """The detailed outputs: every row's logits [R, A] f32, the selected global top-k ids [layers, R, K], -1
    padded, and with an MTP layer its logits at every row [R, A] f32 (else None)."""

    logits: jax.Array
    selected: jax.Array
    mtp_logits: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """At each row: the logprob of the token after it (`StepInputs.next_tokens`) under the raw logits of the row, and
    the N most likely tokens there. [R], [R, N] int32, [R, N] f32; rows with no next token (and pads) hold garbage."""

    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def _layers(model, cfg: ModelConfig, kv_cache: KVCache, hidden, md: StepMetadata, attend, *, backend: str,
            unroll: bool):
    """Run every decoder layer, each stack of layers of one structure (`layer_stacks`) under one `jax.lax.scan`
    (compiled once, whatever its depth; fully unrolled when `unroll`); attend(layer, x, latent pool, index pool,
    the layer's metadata) -> (attention out, pools, selected). Returns (hidden, kv_cache, selected
    [layers, ...])."""
    latent, index_k = kv_cache.local_pools()
    selected = []
    for stack in layer_stacks(cfg):
        graphdef, weights = nnx.split(getattr(model, stack.name))

        def one_layer(carry, layer_weights_and_index, graphdef=graphdef):
            hidden, latent, index_k = carry
            layer_weights, index = layer_weights_and_index
            layer = nnx.merge(graphdef, layer_weights)
            layer_md = on_layer(md, index, num_pages=kv_cache.num_pages, page_size=kv_cache.page_size)
            attn, latent, index_k, sel = attend(layer, layer.attention_input(hidden), latent, index_k, layer_md)
            return (layer.feed_forward(hidden + attn, backend=backend), latent, index_k), sel

        with jax.named_scope(stack.name):
            (hidden, latent, index_k), stack_selected = jax.lax.scan(
                one_layer, (hidden, latent, index_k), (weights, jnp.arange(stack.first, stack.first + stack.count)),
                unroll=stack.count if unroll else 1)
        selected.append(stack_selected)
    return hidden, kv_cache.with_local_pools(latent, index_k), jnp.concatenate(selected)


def _mtp_rows(model, mtp, hidden, following, is_position_zero, rope, kv_cache: KVCache, md: StepMetadata, *,
              layout: DcpLayout, backend: str):
    """The MTP layer (`model/mtp.py`) over rows, its cache the pools' last layer: row r reads the state hidden[r]
    [R, D] (the main model's final-normed one; in a chained pass the layer's output of the pass before, as vLLM's
    deepseek_mtp chains it) and the token after it following[r] [R] (is_position_zero [R] masks it). Returns (the
    layer's output [R, D], before the shared head's norm (`MtpLayer.head_input`), the KV cache)."""
    x = mtp.layer_input(model.embed_tokens(following), hidden, is_position_zero > 0)
    latent, index_k = kv_cache.local_pools()
    layer_md = on_layer(md, kv_cache.num_layers - 1, num_pages=kv_cache.num_pages, page_size=kv_cache.page_size)
    attn, latent, index_k, _ = mtp.layer.attention(mtp.layer.attention_input(x), rope, latent, index_k, layer_md,
                                                   layout=layout, backend=backend)
    return mtp.layer.feed_forward(x + attn, backend=backend), kv_cache.with_local_pools(latent, index_k)


def _chained_drafts(model, mtp, first, hidden, accepted, kv_cache: KVCache, md: StepMetadata, cfg: ModelConfig, *,
                    layout: DcpLayout, backend: str):
    """Drafts 2..N of each sample group by chained MTP passes (N - 1 = md.draft_positions' offsets // 2): pass j
    reads the MTP layer's output hidden [G, D] and the draft first [G] of the pass before, at the group's row of
    column accepted + j - 1 of md's draft_* fields (host-built for every count kept, `StepMetadata`). Returns
    ([G, N - 1] drafts, the KV cache)."""
    drafts = []
    for j in range(1, (md.draft_positions.shape[1] + 1) // 2):
        column = (accepted + j - 1)[:, None]

        def pick(table, column=column):
            return jnp.take_along_axis(table, column, axis=1)[:, 0]

        pass_md = dataclasses.replace(
            md, positions=pick(md.draft_positions), context_lens=pick(md.draft_context_lens),
            local_context_lens=pick(md.draft_local_context_lens), slot_mapping=pick(md.draft_slot_mapping),
            query_seqs=md.draft_seqs)
        rope = cos_sin(pass_md.positions, *rope_tables(cfg))
        hidden, kv_cache = _mtp_rows(model, mtp, hidden, first, jnp.zeros_like(first), rope, kv_cache, pass_md,
                                     layout=layout, backend=backend)
        first = jnp.argmax(model.head(mtp.head_input(hidden)), axis=-1).astype(jnp.int32)
        drafts.append(first)
    return jnp.stack(drafts, axis=1), kv_cache


def _following_tokens(inputs: StepInputs, sampled_tokens):
    """[R] the token after each row: its prompt's next (`next_tokens`), else the one sampled at the row (a decode
    row, a prompt's last); 0 on pad rows. Pad entries of `sample_rows` (R: past the rows) write nothing."""
    rows = inputs.tokens.shape[0]
    sampled_at = jnp.zeros(rows, jnp.int32).at[inputs.sample_rows].set(sampled_tokens, mode="drop")
    return jnp.where(inputs.next_tokens >= 0, inputs.next_tokens, sampled_at)


def step_body(params, state: DeviceState, inputs: StepInputs, md: StepMetadata, *, graphdef, abstract,
              cfg: ModelConfig, layout: DcpLayout, backend: str, variant: str, unroll_layers: bool = False,
              mtp_graphdef=None, mtp_abstract=None, micro_batches: int = 1):
    """Per rank: inputs and md the rank's view of the step's data; `variant` one of VARIANTS. Returns (the sampled
    tokens packed (`sampler.pack`); with PromptLogprobs too; or SampledTokens and Details for DETAILS; the new
    DeviceState). Pad rows read and write no KV and join the scratch slot's history. The layers run as one scan per
    layer stack (`_layers`), unrolled when `unroll_layers`. With `mtp_graphdef` and `mtp_abstract` (an
    `MtpLayer`'s), `params` is (the model's, the MTP layer's) and the MTP layer drafts (`_mtp_rows`).
    `micro_batches` 2: each layer's attention runs as two micro-batches (two-batch overlap,
    `sparse_dcp.sparse_dcp_attention`)."""
    mtp = None
    if mtp_graphdef is not None:
        params, mtp_params = params
        mtp = merge(mtp_graphdef, mtp_abstract, mtp_params)
    model = merge(graphdef, abstract, params)
    tokens = sampler.row_tokens(state.sampler, inputs.tokens, inputs.row_slots)
    if mtp is not None:  # a verify row's token DRAFT_TOKEN - i: its slot's draft i
        draft_index = jnp.clip(DRAFT_TOKEN - inputs.tokens, 0, state.drafts.shape[1] - 1)
        tokens = jnp.where(inputs.tokens <= DRAFT_TOKEN, state.drafts[inputs.row_slots, draft_index], tokens)
    sampler_state = sampler.add_history(state.sampler, tokens, inputs.roles, inputs.row_slots, inputs.fresh_slots)
    rope = cos_sin(md.positions, *rope_tables(cfg))
    hidden, kv_cache, selected = _layers(
        model, cfg, state.kv_cache, model.embed_tokens(tokens), md,
        lambda layer, x, latent, index_k, layer_md: layer.attention(x, rope, latent, index_k, layer_md, layout=layout,
                                                                    backend=backend, micro_batches=micro_batches),
        backend=backend, unroll=unroll_layers)
    draws = variant in (SAMPLED, PROMPT_LOGPROBS)
    drafts, mtp_logits = state.drafts, None
    if mtp is None:
        logits = model.logits(hidden[inputs.sample_rows])
        sampled, sampler_state = sampler.sample_rows(logits, inputs.sampling, sampler_state, draws=draws)
    else:
        # Groups of G = N + 1 sampled rows (`StepInputs.sample_rows`): each sampling sequence's row of its last
        # token, then its drafts' rows (pads past the ones it verifies).
        normed = model.final_hidden(hidden)
        group = drafts.shape[1] + 1
        group_rows = inputs.sample_rows.reshape(-1, group)
        slots = inputs.sampling.slots[::group]
        has_draft = group_rows[:, 1:] < inputs.tokens.shape[0]  # a pad entry is R
        verified = jnp.where(has_draft, drafts[slots], -1)
        sampled, accepted, sampler_state = verify_groups(model.head(normed[inputs.sample_rows]), inputs.sampling,
                                                         sampler_state, verified, draws=draws)
        following = jnp.maximum(_following_tokens(inputs, sampled.tokens), 0)  # rejected rows: any token
        mtp_hidden, kv_cache = _mtp_rows(model, mtp, normed, following, inputs.is_position_zero, rope, kv_cache, md,
                                         layout=layout, backend=backend)
        last_rows = jnp.take_along_axis(group_rows, accepted[:, None], axis=-1)[:, 0]  # the last emitted's row
        drafted = jnp.argmax(model.head(mtp.head_input(mtp_hidden[last_rows])), axis=-1).astype(jnp.int32)[:, None]
        if group > 2:
            chained, kv_cache = _chained_drafts(model, mtp, drafted[:, 0], mtp_hidden[last_rows], accepted,
                                                kv_cache, md, cfg, layout=layout, backend=backend)
            drafted = jnp.concatenate([drafted, chained], axis=1)
        drafts = drafts.at[slots].set(drafted)  # pads: the scratch slot's
        if variant == DETAILS:
            mtp_logits = model.head(mtp.head_input(mtp_hidden))
    new_state = DeviceState(kv_cache, sampler_state, drafts)
    if variant == DETAILS:
        return (sampled, Details(model.logits(hidden), selected, mtp_logits)), new_state
    if variant == PROMPT_LOGPROBS:
        return (sampler.pack(sampled), prompt_logprobs(model, hidden, inputs.next_tokens)), new_state
    return sampler.pack(sampled), new_state


def prompt_logprobs(model, hidden, next_tokens) -> PromptLogprobs:
    """PromptLogprobs of hidden [R, D] (after the last layer) and the tokens after the rows [R] (-1: none),
    PROMPT_LOGPROBS_CHUNK rows at a time."""
    rows = hidden.shape[0]
    chunk = min(PROMPT_LOGPROBS_CHUNK, rows)
    padded = -(-rows // chunk) * chunk
    hidden = jnp.pad(hidden, ((0, padded - rows), (0, 0)))
    following = jnp.pad(jnp.maximum(next_tokens, 0), (0, padded - rows))

    def one_chunk(args):
        h, nxt = args  # [chunk, D], [chunk]
        lps = jax.nn.log_softmax(model.logits(h), axis=-1)
        top_lps, top_ids = jax.lax.top_k(lps, min(sampler.TOP_LOGPROBS, lps.shape[-1]))
        return jnp.take_along_axis(lps, nxt[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lps

    chunks = jax.lax.map(one_chunk, (hidden.reshape(-1, chunk, hidden.shape[-1]), following.reshape(-1, chunk)))
    return PromptLogprobs(*(a.reshape(padded, *a.shape[2:])[:rows] for a in chunks))
