"""The model's per-rank step body (run inside shard_map by `step.StepProgram`), with the next tokens sampled on the
device.

A step's rows are decode rows and the tokens of prefill chunks alike (`host/step_metadata.py`): the rows' tokens (host-
given, or each slot's last sampled token) join their requests' sampler histories -> embeddings -> per layer (the
architecture's attention variant, MLP / MoE) -> final norm -> lm_head logits of the sampled rows only (a decode
row, a prompt's last token) -> the sampler (`sampler.py`): each sampled row's next token and its logprobs,
recorded in its slot of the sampler state. With an MTP layer (speculative decoding) a request samples a group of
rows instead, its decode row and its drafts' (N + 1), and the device verifies the drafts
(`speculative.verify_groups`); the MTP layer then runs over every row with the token after it (the prompt's next,
or the one emitted there) and writes its own cache; its argmax at a request's last emitted row is the request's
next first draft, and with N >= 2 chained passes of one row a request (`_chained_drafts`) draft the others, all
kept in the device state.
What a program returns is its `ProgramKind`'s choice from what the step computed (`StepResult`): the sampled tokens
(greedy or drawing), or with them every row's prompt logprobs, chunk by chunk (never the [R, A] logits at once);
the oracle's kind (`runtime/oracle.py`) returns every row's logits and the per-layer selections.
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from dcp_jax.host.step_inputs import DRAFT_TOKEN, StepInputs
from dcp_jax.host.step_metadata import StepMetadata, draft_pass_view
from dcp_jax.model.kv_cache import KVCache, entry_table, kv_cache_specs, on_layer
from dcp_jax.model.rope import cos_sin, rope_tables
from dcp_jax.runtime import sampler
from dcp_jax.runtime.context import StepContext
from dcp_jax.runtime.sampler import SampledTokens, SamplerState
from dcp_jax.runtime.speculative import verify_groups

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


def state_specs(pools, *, drafts: bool) -> DeviceState:
    """The PartitionSpecs of a DeviceState of these KV pools (`CachePool`s or names), with the drafts or without."""
    return DeviceState(kv_cache=kv_cache_specs(pools), sampler=SamplerState(P(), P(), P()),
                       drafts=P() if drafts else None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """At each row: the logprob of the token after it (`StepInputs.next_tokens`) under the raw logits of the row, and
    the N most likely tokens there. [R], [R, N] int32, [R, N] f32; rows with no next token (and pads) hold garbage."""

    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def _layers(model, kv_cache: KVCache, hidden, rope, md: StepMetadata, *, ctx: StepContext, keep_selected: bool):
    """Run every decoder layer, each scan group (`scan_groups`: stacks of one structure each, taking turns) under one
    `jax.lax.scan` (compiled once, whatever its depth; fully unrolled when ctx.unroll_layers). The carry holds the
    hidden states, the folded pools and, where some layer has no indexer of its own (IndexShare), the most recent
    layer's selection [R, K] (what that layer attends; [R, 0] otherwise, so no other model carries it). Each layer
    reads md moved to its entry of each pool it caches in (`entry_table`: static per layer). Returns (hidden,
    kv_cache, the global positions [layers, R, K] each row attended when `keep_selected`, else None)."""
    cfg, pools = ctx.cfg, kv_cache.local_pools()
    tables = {name: jnp.asarray(entry_table(cfg, name, cfg.num_hidden_layers)) for name in pools}
    carries = any(map(cfg.shares_index_selection, range(cfg.num_hidden_layers)))
    selection = jnp.full((hidden.shape[0], cfg.indexer.topk if carries else 0), -1, jnp.int32)
    selected = []
    for group in ctx.architecture.model.scan_groups(cfg):
        graphdefs, weights = zip(*(nnx.split(getattr(model, stack.name)) for stack in group))

        def block(carry, group_xs, graphdefs=graphdefs, group=group):
            hidden, pools, selection = carry
            kept = []
            for stack, graphdef, (layer_weights, index) in zip(group, graphdefs, group_xs):
                with jax.named_scope(stack.name):
                    layer = nnx.merge(graphdef, layer_weights)
                    mds = {name: on_layer(md, tables[name][index], num_pages=kv_cache.num_pages,
                                          page_size=kv_cache.page_size) for name in layer.attention.variant.pool_names}
                    attn, pools, layer_selected = layer.attention(layer.attention_input(hidden), rope, pools, mds,
                                                                  ctx=ctx, selection=selection)
                    hidden = layer.feed_forward(hidden + attn, backend=ctx.backend)
                selection = layer_selected if carries else selection
                kept.append(layer_selected)
            return (hidden, pools, selection), (jnp.stack(kept) if keep_selected else None)

        xs = tuple((w, jnp.asarray(stack.layers)) for w, stack in zip(weights, group))
        (hidden, pools, selection), group_selected = jax.lax.scan(
            block, (hidden, pools, selection), xs, unroll=group[0].count if ctx.unroll_layers else 1)
        if keep_selected:  # [repeats, block, R, K] -> layer order
            selected.append(group_selected.reshape(group[0].count * len(group), *group_selected.shape[2:]))
    return hidden, kv_cache.with_local_pools(pools), jnp.concatenate(selected) if keep_selected else None


def _mtp_rows(model, mtp, hidden, following, is_position_zero, rope, kv_cache: KVCache, md: StepMetadata, *,
              ctx: StepContext):
    """The MTP layer (`MtpLayer` of the model file) over rows, its cache each pool's last entry: row r reads the
    state hidden[r] [R, D] (the main model's final-normed one; in a chained pass the layer's output of the pass
    before, as vLLM's deepseek_mtp chains it) and the token after it following[r] [R] (is_position_zero [R] masks
    it). Returns (the layer's output [R, D], before the shared head's norm (`MtpLayer.head_input`), the KV
    cache)."""
    x = mtp.layer_input(model.embed_tokens(following), hidden, is_position_zero > 0)
    mds = {name: on_layer(md, kv_cache.entries(name) - 1, num_pages=kv_cache.num_pages, page_size=kv_cache.page_size)
           for name in mtp.layer.attention.variant.pool_names}
    topk = ctx.cfg.indexer.topk if ctx.cfg.indexer is not None else 0
    attn, pools, _ = mtp.layer.attention(mtp.layer.attention_input(x), rope, kv_cache.local_pools(), mds, ctx=ctx,
                                         selection=jnp.full((x.shape[0], topk), -1, jnp.int32))
    return mtp.layer.feed_forward(x + attn, backend=ctx.backend), kv_cache.with_local_pools(pools)


def _chained_drafts(model, mtp, first, hidden, accepted, kv_cache: KVCache, md: StepMetadata, *, ctx: StepContext):
    """Drafts 2..N of each sample group by chained MTP passes (N - 1 = md.draft_positions' offsets // 2): pass j
    reads the MTP layer's output hidden [G, D] and the draft first [G] of the pass before, at the group's row of
    column accepted + j - 1 of md's draft_* fields (host-built for every count kept, `StepMetadata`). Returns
    ([G, N - 1] drafts, the KV cache)."""
    drafts = []
    for j in range(1, (md.draft_positions.shape[1] + 1) // 2):
        pass_md = draft_pass_view(md, accepted + j - 1)
        rope = cos_sin(pass_md.positions, *rope_tables(ctx.cfg))
        hidden, kv_cache = _mtp_rows(model, mtp, hidden, first, jnp.zeros_like(first), rope, kv_cache, pass_md,
                                     ctx=ctx)
        first = jnp.argmax(model.head(mtp.head_input(hidden)), axis=-1).astype(jnp.int32)
        drafts.append(first)
    return jnp.stack(drafts, axis=1), kv_cache


def _following_tokens(inputs: StepInputs, sampled_tokens):
    """[R] the token after each row: its prompt's next (`next_tokens`), else the one sampled at the row (a decode
    row, a prompt's last); 0 on pad rows. Pad entries of `sample_rows` (R: past the rows) write nothing."""
    rows = inputs.tokens.shape[0]
    sampled_at = jnp.zeros(rows, jnp.int32).at[inputs.sample_rows].set(sampled_tokens, mode="drop")
    return jnp.where(inputs.next_tokens >= 0, inputs.next_tokens, sampled_at)


class StepResult(NamedTuple):
    """What one step computed, from which its program's kind picks the outputs (traced values)."""

    model: Any  # the model, merged with the step's weights
    mtp: Any  # its MTP layer (None without drafting)
    inputs: StepInputs
    hidden: jax.Array  # [R, D]: the last decoder layer's output, before the final norm
    sampled: SampledTokens  # the sampled rows' tokens and logprobs
    selected: jax.Array | None  # [layers, R, K]: the positions each row attended (when the kind keeps them)
    mtp_hidden: jax.Array | None  # [R, D]: the MTP layer's output at every row (with an MTP layer)
    backend: str  # the kernels' (`StepContext.backend`)


@dataclasses.dataclass(frozen=True)
class ProgramKind:
    """One kind of step program (each compiled once per bucket): whether its sampled rows may draw (else all are
    greedy, no draw), whether it keeps each layer's selection, and its outputs, a function of the `StepResult`."""

    name: str
    draws: bool
    outputs: Callable[[StepResult], Any]
    keeps_selected: bool = False


def _tokens(result: StepResult):
    return sampler.pack(result.sampled)


def _tokens_and_prompt_logprobs(result: StepResult):
    return sampler.pack(result.sampled), prompt_logprobs(result.model, result.hidden, result.inputs.next_tokens,
                                                       backend=result.backend)


# The serving programs of a bucket: its sampled rows all greedy (no draw); rows that draw (any mix of parameters);
# drawing, with every row's prompt logprobs. The host picks one from the step's rows (`runner.step_kind`).
GREEDY = ProgramKind("greedy", draws=False, outputs=_tokens)
SAMPLED = ProgramKind("sampled", draws=True, outputs=_tokens)
PROMPT_LOGPROBS = ProgramKind("prompt_logprobs", draws=True, outputs=_tokens_and_prompt_logprobs)
SERVING_KINDS = (GREEDY, SAMPLED, PROMPT_LOGPROBS)
# Their names, by index: what a multi-host deployment's processes are told to run (`multihost.Mirror`).
SERVING_KIND_NAMES = tuple(kind.name for kind in SERVING_KINDS)


def step_body(params, state: DeviceState, inputs: StepInputs, md: StepMetadata, *, ctx: StepContext,
              kind: ProgramKind):
    """Per rank: inputs and md the rank's view of the step's data. Returns (`kind.outputs` of what the step
    computed, the new DeviceState). Pad rows read and write no KV and join the scratch slot's history. With
    ctx.mtp (drafting), `params` is (the model's, the MTP layer's) and the MTP layer drafts (`_mtp_rows`)."""
    merge = ctx.architecture.model.merge
    mtp = None
    if ctx.mtp is not None:
        params, mtp_params = params
        mtp = merge(ctx.mtp.graphdef, ctx.mtp.abstract, mtp_params)
    model = merge(ctx.model.graphdef, ctx.model.abstract, params)
    tokens = sampler.row_tokens(state.sampler, inputs.tokens, inputs.row_slots)
    if mtp is not None:  # a verify row's token DRAFT_TOKEN - i: its slot's draft i
        draft_index = jnp.clip(DRAFT_TOKEN - inputs.tokens, 0, state.drafts.shape[1] - 1)
        tokens = jnp.where(inputs.tokens <= DRAFT_TOKEN, state.drafts[inputs.row_slots, draft_index], tokens)
    sampler_state = sampler.add_history(state.sampler, tokens, inputs.roles, inputs.row_slots, inputs.fresh_slots)
    rope = cos_sin(md.positions, *rope_tables(ctx.cfg))
    hidden, kv_cache, selected = _layers(model, state.kv_cache, model.embed_tokens(tokens), rope, md, ctx=ctx,
                                         keep_selected=kind.keeps_selected)
    drafts, mtp_hidden = state.drafts, None
    if mtp is None:
        logits = model.logits(hidden[inputs.sample_rows])
        sampled, sampler_state = sampler.sample_rows(logits, inputs.sampling, sampler_state, draws=kind.draws,
                                                    backend=ctx.backend)
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
                                                         sampler_state, verified, draws=kind.draws,
                                                         backend=ctx.backend)
        following = jnp.maximum(_following_tokens(inputs, sampled.tokens), 0)  # rejected rows: any token
        mtp_hidden, kv_cache = _mtp_rows(model, mtp, normed, following, inputs.is_position_zero, rope, kv_cache, md,
                                         ctx=ctx)
        last_rows = jnp.take_along_axis(group_rows, accepted[:, None], axis=-1)[:, 0]  # the last emitted's row
        drafted = jnp.argmax(model.head(mtp.head_input(mtp_hidden[last_rows])), axis=-1).astype(jnp.int32)[:, None]
        if group > 2:
            chained, kv_cache = _chained_drafts(model, mtp, drafted[:, 0], mtp_hidden[last_rows], accepted,
                                                kv_cache, md, ctx=ctx)
            drafted = jnp.concatenate([drafted, chained], axis=1)
        drafts = drafts.at[slots].set(drafted)  # pads: the scratch slot's
    result = StepResult(model, mtp, inputs, hidden, sampled, selected, mtp_hidden, ctx.backend)
    return kind.outputs(result), DeviceState(kv_cache, sampler_state, drafts)


def prompt_logprobs(model, hidden, next_tokens, *, backend: str) -> PromptLogprobs:
    """PromptLogprobs of hidden [R, D] (after the last layer) and the tokens after the rows [R] (-1: none),
    PROMPT_LOGPROBS_CHUNK rows at a time; the top ones by the kernels of `backend` (`sampler.top_logprobs`)."""
    rows = hidden.shape[0]
    chunk = min(PROMPT_LOGPROBS_CHUNK, rows)
    padded = -(-rows // chunk) * chunk
    hidden = jnp.pad(hidden, ((0, padded - rows), (0, 0)))
    following = jnp.pad(jnp.maximum(next_tokens, 0), (0, padded - rows))

    def one_chunk(args):
        h, nxt = args  # [chunk, D], [chunk]
        lps = jax.nn.log_softmax(model.logits(h), axis=-1)
        top_lps, top_ids = sampler.top_logprobs(lps, backend=backend)
        return jnp.take_along_axis(lps, nxt[:, None], axis=-1)[:, 0], top_ids, top_lps

    chunks = jax.lax.map(one_chunk, (hidden.reshape(-1, chunk, hidden.shape[-1]), following.reshape(-1, chunk)))
    return PromptLogprobs(*(a.reshape(padded, *a.shape[2:])[:rows] for a in chunks))
