"""Sampling on the device: penalties, greedy, temperature, min-p, top-k, top-p and counter-based draws, and the
logprobs a request asked for, for every row of a step at once.

vLLM's `SamplingParams` semantics, in vLLM's order: presence / frequency penalties over the generated tokens and
the repetition penalty over prompt and generated tokens, then greedy (argmax, the lowest id among ties) or:
temperature, min-p (keep p >= min_p * max p), top-k, top-p (the smallest set of most likely tokens whose mass
reaches top_p; ties at its edge all kept), and one draw. Every per-row parameter is a traced array, so one
compiled drawing program serves any mix of them (a step whose rows are all greedy takes the greedy one:
`draws`). Filters are exact: their thresholds are found by a radix search over the 32 bits of the
order-preserving integer keys of the logits (8 passes over a row each, 16 candidates a pass, no sort).
Draws are counter-based: row r draws Gumbel noise from a key made of its request's 64-bit seed and the position of
the token it samples, so a request's tokens depend on nothing else (not its batch, bucket or preemptions).
Logprobs are those of the raw logits (vLLM's default): the sampled token's and the TOP_LOGPROBS largest (the
kernels' exact top-k, `top_logprobs`: no sort of the vocabulary).
Letters: see the legend in `dcp_jax/__init__.py`; the top logprobs are TOP_LOGPROBS wide.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from dcp_jax.host.step_inputs import GENERATED, PROMPT

# The most top logprobs a request may ask for (vLLM's default max_logprobs): every row gets this many.
TOP_LOGPROBS = 20
NEG_INF = float("-inf")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampledTokens:
    """What one step sampled, per row: the only step outputs that cross to the host."""

    # [R] int32: the sampled token.
    tokens: jax.Array
    # [R] f32: its logprob under the raw logits.
    logprobs: jax.Array
    # [R, TOP_LOGPROBS] int32 / f32: the TOP_LOGPROBS most likely tokens under the raw logits (largest first, lower
    # id first among ties) and their logprobs.
    top_ids: jax.Array
    top_logprobs: jax.Array


def pack(sampled: SampledTokens):
    """SampledTokens as one int32 array [R, 2 + 2 TOP_LOGPROBS] (tokens, logprob bits, top ids, top logprob bits):
    the host reads a step's tokens with one transfer (`unpack`)."""
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    return jnp.concatenate([sampled.tokens[:, None], bits(sampled.logprobs)[:, None], sampled.top_ids,
                            bits(sampled.top_logprobs)], axis=1)


def unpack(packed) -> SampledTokens:
    """Host: `pack`'s array (numpy) back as SampledTokens of numpy arrays."""
    packed = np.asarray(packed)
    n = (packed.shape[1] - 2) // 2
    return SampledTokens(packed[:, 0], packed[:, 1].view(np.float32), packed[:, 2:2 + n],
                         packed[:, 2 + n:].view(np.float32))


def _order_keys(x):
    """uint32 keys whose unsigned order is the total order of the f32 values x (-0.0 below 0.0)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


# Bits of the threshold `_largest_threshold` settles per pass: 16 candidates at once, 8 passes for 32 bits. (Each
# pass is a few kernels the host launches one by one: 32 one-bit passes cost ~1.5 ms of launch on the H200.)
RADIX_BITS = 4


def _largest_threshold(keys, is_enough):
    """Per row, the largest uint32 t with is_enough(keys >= t) (a [R, C] bool of a [R, C, A] mask: C candidate
    thresholds per row at once), found RADIX_BITS bits per pass from the top. is_enough must hold for t = 0 (every
    key) and shrink as t grows."""
    digits = jnp.arange(2**RADIX_BITS, dtype=jnp.uint32)

    def step(i, t):
        shift = (32 - RADIX_BITS * (i + 1)).astype(jnp.uint32)
        candidates = t[:, None] | (digits[None, :] << shift)  # [R, C]; digit 0 is t itself, which always holds
        ok = is_enough(keys[:, None, :] >= candidates[:, :, None])
        best = jnp.max(jnp.where(ok, digits[None, :], 0), axis=-1)
        return t | (best << shift)

    return jax.lax.fori_loop(0, 32 // RADIX_BITS, step, jnp.zeros(keys.shape[0], jnp.uint32))


def apply_penalties(logits, output_counts, prompt_mask, presence, frequency, repetition):
    """logits [R, A] f32 with vLLM's penalties: repetition (HF's: a positive logit divided by it, a negative one
    multiplied) on every token of the prompt or the output, then minus frequency * count and minus presence for
    each generated token. output_counts [R, A] int32, prompt_mask [R, A] bool, the penalties [R] f32 (0, 0, 1:
    off)."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    counts = output_counts.astype(jnp.float32)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def top_logprobs(logprobs, *, backend: str):
    """The TOP_LOGPROBS largest of each row's logprobs [R, A] f32 (largest first, the lower id first among ties) and
    their ids int32, by the exact top-k of the kernels of `backend` (`pallas_kernels.topk`)."""
    rows, vocab = logprobs.shape
    return pallas_kernels.topk(logprobs, jnp.full((rows,), vocab, jnp.int32), k=min(TOP_LOGPROBS, vocab),
                               backend=backend)


def filter_logits(logits, temperature, min_p, top_k, top_p):
    """Scaled logits [R, A] f32 with -inf at the tokens min-p, top-k and top-p remove (vLLM's order, after the
    temperature). temperature [R] > 0 (greedy rows take 1: their draw is unused), min_p [R] in [0, 1], top_k [R]
    int32 (<= 0: off), top_p [R] in (0, 1]."""
    scaled = logits / temperature[:, None]
    probs = jax.nn.softmax(scaled, axis=-1)
    scaled = jnp.where(probs >= min_p[:, None] * probs.max(axis=-1, keepdims=True), scaled, NEG_INF)
    vocab = logits.shape[-1]
    keys = _order_keys(scaled)
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kth = _largest_threshold(keys, lambda kept: kept.sum(axis=-1) >= k[:, None])
    scaled = jnp.where(keys >= kth[:, None], scaled, NEG_INF)
    probs = jax.nn.softmax(scaled, axis=-1)
    keys = _order_keys(scaled)
    # Mass in f32 can fall a rounding short of top_p = 1 for the whole set: cap the target at the total.
    target = jnp.minimum(top_p, probs.sum(axis=-1))
    edge = _largest_threshold(keys, lambda kept: jnp.where(kept, probs[:, None, :], 0.0).sum(axis=-1)
                              >= target[:, None])
    return jnp.where(keys >= edge[:, None], scaled, NEG_INF)


def row_keys(seeds, positions):
    """One PRNG key per row from its request's seed (seeds [R, 2] uint32: the low and high words) and the position
    of the token it samples (positions [R] int32)."""

    def key(seed, position):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed[0]), seed[1]), position)

    return jax.vmap(key)(seeds, positions)


def hold_back_stops(logits, stop_ids, stops_from, positions):
    """logits [R, A] with -inf at each row's stop_ids [R, MIN_TOKENS_STOP_IDS] (-1 pads) while the token it samples
    comes before position stops_from [R] (vLLM's min_tokens: EOS and stop token ids cannot be sampled yet)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    is_held = (stop_ids >= 0) & (positions < stops_from)[:, None]
    return logits.at[rows, jnp.where(is_held, stop_ids, logits.shape[-1])].set(NEG_INF, mode="drop")


def sample(logits, *, temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty, repetition_penalty,
           seeds, positions, stop_ids, stops_from, output_counts, prompt_mask, draws: bool,
           backend: str) -> SampledTokens:
    """One token per row of logits [R, A] f32 and its logprobs; every parameter a [R] array (seeds [R, 2] uint32,
    positions [R] int32 the sampled token's position, stop_ids [R, MIN_TOKENS_STOP_IDS] with stops_from [R] what
    min_tokens holds back: `hold_back_stops`), output_counts [R, A] int32 and prompt_mask [R, A] bool the rows'
    requests' token history. temperature 0 is greedy. The logprobs are the raw logits' (vLLM's), held-back stops
    included.
    draws (static): False when every row is greedy (the host knows, and picks that program): no filter, no noise.
    Never a traced branch on the parameters: the GPU runtime reads a `lax.cond`'s predicate on the host, so the
    program's launch would wait for the device and no step could be dispatched ahead. `backend` names the kernels'
    (the top logprobs' top-k)."""
    out = processed_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                           presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                           repetition_penalty=repetition_penalty, positions=positions, stop_ids=stop_ids,
                           stops_from=stops_from, output_counts=output_counts, prompt_mask=prompt_mask, draws=draws,
                           backend=backend)
    tokens = jnp.argmax(out.penalized, axis=-1).astype(jnp.int32)  # the first maximum: the lowest id among ties
    if draws:
        noise = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(
            row_keys(seeds, positions))
        tokens = jnp.where(temperature <= 0, tokens, jnp.argmax(out.kept + noise, axis=-1).astype(jnp.int32))
    logprobs = jnp.take_along_axis(out.raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    return SampledTokens(tokens, logprobs, out.top_ids, out.top_logprobs)


class ProcessedLogits(NamedTuple):
    """What sampling reads of a step's logits [R, A] (`processed_logits`)."""

    raw_logprobs: jax.Array  # [R, A] f32: log-softmax of the raw logits (the logprobs reported)
    top_logprobs: jax.Array  # [R, TOP_LOGPROBS] f32 and
    top_ids: jax.Array  # [R, TOP_LOGPROBS] int32: the largest of them
    penalized: jax.Array  # [R, A] f32: with min_tokens' held-back stops and the penalties (a greedy row's argmax)
    kept: jax.Array  # [R, A] f32: those scaled by the temperature and filtered (`penalized` when not drawing)


def processed_logits(logits, *, temperature, top_k, top_p, min_p, presence_penalty, frequency_penalty,
                     repetition_penalty, positions, stop_ids, stops_from, output_counts, prompt_mask,
                     draws: bool, backend: str) -> ProcessedLogits:
    """Logits [R, A] through the sampler's processing in vLLM's order (`sample`'s parameters): the raw logprobs,
    then min_tokens' hold-back and the penalties, then, when `draws`, the temperature (1 on greedy rows, whose
    argmax the filters keep) and min-p, top-k, top-p. `sample` draws from the result, `speculative.verify_groups`
    verifies drafts against it. The top logprobs (`top_logprobs`, the kernels of `backend`) only when `draws`: the
    host runs a step whose rows want logprobs in the drawing program (`runner.step_kind`); the greedy one's are 0."""
    raw_logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    shape = (logits.shape[0], min(TOP_LOGPROBS, logits.shape[-1]))
    top_lps, top_ids = (top_logprobs(raw_logprobs, backend=backend) if draws else
                        (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.int32)))
    penalized = apply_penalties(hold_back_stops(logits.astype(jnp.float32), stop_ids, stops_from, positions),
                                output_counts, prompt_mask, presence_penalty, frequency_penalty, repetition_penalty)
    kept = penalized
    if draws:
        kept = filter_logits(penalized, jnp.where(temperature <= 0, 1.0, temperature), min_p, top_k, top_p)
    return ProcessedLogits(raw_logprobs, top_lps, top_ids.astype(jnp.int32), penalized, kept)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerState:
    """Each request's token history on the device, one slot per request (the scheduler's `Request.slot`) plus a
    scratch slot that pad rows read and write. Donated with the KV cache on every step."""

    # [slots + 1] int32: the last token sampled for the slot's request: the next decode step's input.
    last_tokens: jax.Array
    # [slots + 1, A] int32: how often the slot's request generated each token (presence / frequency penalties).
    output_counts: jax.Array
    # [slots + 1, A] bool: the tokens of its prompt (the repetition penalty).
    prompt_mask: jax.Array

    @classmethod
    def zeros(cls, slots: int, vocab: int) -> SamplerState:
        """Empty state of `slots` request slots and the scratch slot."""
        return cls(jnp.zeros((slots + 1,), jnp.int32), jnp.zeros((slots + 1, vocab), jnp.int32),
                   jnp.zeros((slots + 1, vocab), jnp.bool_))


def row_arguments(sampling, state: SamplerState) -> dict:
    """`processed_logits`' keyword arguments (all but `draws`) for the rows of `sampling` (a `SamplingMetadata`):
    their parameters and their slots' histories."""
    return dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p,
                presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
                repetition_penalty=sampling.repetition_penalty, positions=sampling.positions,
                stop_ids=sampling.stop_ids, stops_from=sampling.stops_from,
                output_counts=state.output_counts[sampling.slots], prompt_mask=state.prompt_mask[sampling.slots])


def _sample_rows(logits, sampling, state: SamplerState, draws: bool, backend: str) -> SampledTokens:
    return sample(logits, seeds=sampling.seeds, draws=draws, backend=backend, **row_arguments(sampling, state))


def _record(state: SamplerState, slots, tokens) -> SamplerState:
    """The rows' new tokens as their slots' last tokens, counted."""
    return dataclasses.replace(state, last_tokens=state.last_tokens.at[slots].set(tokens),
                               output_counts=state.output_counts.at[slots, tokens].add(1))


def row_tokens(state: SamplerState, tokens, slots):
    """The step's input tokens [R]: a host token where one is given (>= 0), else the slot's last sampled token
    (what an earlier step sampled, still on the device)."""
    return jnp.where(tokens >= 0, tokens, state.last_tokens[slots])


def add_history(state: SamplerState, tokens, roles, slots, fresh_slots) -> SamplerState:
    """Before a step samples: the slots of `fresh_slots` [Q] start their requests' histories over (entries past the
    last slot reset nothing), then each row's token [R] joins its slot's (slots [R]) as its role [R] says
    (`step_inputs.PROMPT`: the prompt mask, `step_inputs.GENERATED`: the generated counts; other roles add nothing)."""
    prompt_mask = state.prompt_mask.at[fresh_slots].set(False, mode="drop")
    output_counts = state.output_counts.at[fresh_slots].set(0, mode="drop")
    prompt_mask = prompt_mask.at[slots, tokens].max(roles == PROMPT)
    output_counts = output_counts.at[slots, tokens].add((roles == GENERATED).astype(jnp.int32))
    return dataclasses.replace(state, prompt_mask=prompt_mask, output_counts=output_counts)


def sample_rows(logits, sampling, state: SamplerState, *, draws: bool,
                backend: str) -> tuple[SampledTokens, SamplerState]:
    """Sample each sampled row's next token from logits [Q, A] (`sample`'s draws and backend) and record it in its
    slot."""
    out = _sample_rows(logits, sampling, state, draws, backend)
    return out, _record(state, sampling.slots, out.tokens)
