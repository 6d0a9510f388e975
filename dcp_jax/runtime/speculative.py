"""Verifying drafted tokens on the device (speculative decoding, the MTP issue): which of a request's n drafted
tokens the target model keeps, and the token it adds after them.

A request verifies with n + 1 rows: row i holds the target's distribution p_i of the token after draft i - 1 (row 0:
after the last accepted token), already through the sampler's penalties and filters (`sampler.filter_logits`).
The drafts come from a greedy draft layer (MTP), so the draft distribution q_i is one-hot at d_i and rejection
sampling reads: keep d_i with probability p_i(d_i); at the first draft rejected, draw from p_i without d_i
(max(0, p_i - q_i) renormalized); when all n are kept, draw a bonus token from p_n. Every emitted token is then
distributed as the target's own draw (Leviathan et al. 2023), and a greedy row (temperature 0) keeps d_i exactly
while it is p_i's argmax, then emits the argmax: token for token the output of greedy decoding without drafts (in
f32; in bf16 a verify row may round otherwise than the decode row it stands for and flip a near-tie).
Draws are counter-based as the sampler's: row i's uniform and Gumbel noise come from its request's seed and the
position of the token it decides, so a request's output depends on nothing else (with drafting on, not the same
draws as without: a seeded request's sampled output differs, each distributed as the target's).
Letters: see the legend in `dcp_jax/__init__.py`; here R requests, n drafts each.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dcp_jax.runtime.sampler import (NEG_INF, SampledTokens, SamplerState, processed_logits, row_arguments,
                                     row_keys)


def accept_drafts(kept_logits, drafts, *, is_greedy, seeds, positions, draws: bool = True):
    """kept_logits [R, n+1, A] f32: row i's filtered, temperature-scaled logits (-inf where filtered out; a greedy
    row's any logits: only their argmax counts); drafts [R, n] int32, -1 past a request's drafts (one with fewer,
    or none: its row after the last draft emits a plain draw); is_greedy [R] bool; seeds [R, 2] uint32;
    positions [R, n+1] int32: the position of the token each row decides. `draws` (static) False: every request
    is greedy (no noise drawn). Returns (accepted [R] int32: how many drafts are kept, 0..n; tokens [R, n+1] int32:
    the kept drafts, then the token after them, then -1)."""
    r, rows, vocab = kept_logits.shape
    n = rows - 1
    expected = {"drafts": (r, n), "is_greedy": (r,), "seeds": (r, 2), "positions": (r, rows)}
    given = {"drafts": drafts, "is_greedy": is_greedy, "seeds": seeds, "positions": positions}
    wrong = {name: jnp.shape(a) for name, a in given.items() if jnp.shape(a) != expected[name]}
    if n < 1 or wrong:
        raise ValueError(f"accept_drafts: for kept_logits {kept_logits.shape} (n = {n} >= 1 drafts) expected "
                         f"{expected}, got {wrong}")
    argmax = jnp.argmax(kept_logits, axis=-1).astype(jnp.int32)  # [R, n+1]
    kept = (drafts >= 0) & (drafts == argmax[:, :n])
    after = argmax  # [R, n+1]
    if draws:
        keys = row_keys(jnp.repeat(seeds, rows, axis=0), positions.reshape(-1))
        uniforms = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 0)))(keys).reshape(r, rows)
        gumbels = jax.vmap(lambda key: jax.random.gumbel(jax.random.fold_in(key, 1), (vocab,)))(keys)
        gumbels = gumbels.reshape(r, rows, vocab)
        probs = jax.nn.softmax(kept_logits, axis=-1)
        p_draft = jnp.take_along_axis(probs[:, :n], jnp.maximum(drafts, 0)[..., None], axis=-1)[..., 0]  # [R, n]
        kept = jnp.where(is_greedy[:, None], kept, (drafts >= 0) & (uniforms[:, :n] < p_draft))
        # The token after the kept drafts: at a rejected row, a draw without its draft; at row n or past a
        # request's drafts (-1 excludes nothing), a plain draw.
        rejected_draft = jnp.concatenate([drafts, jnp.full((r, 1), -1, jnp.int32)], axis=-1)  # row n rejects none
        without = jnp.where(jnp.arange(vocab) == rejected_draft[..., None], NEG_INF, kept_logits)
        drawn = jnp.argmax(without + gumbels, axis=-1).astype(jnp.int32)
        after = jnp.where(is_greedy[:, None], argmax, drawn)
    accepted = jnp.sum(jnp.cumprod(kept.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
    last = jnp.take_along_axis(after, accepted[:, None], axis=-1)[:, 0]
    index = jnp.arange(rows)[None, :]
    padded_drafts = jnp.concatenate([drafts, jnp.zeros((r, 1), jnp.int32)], axis=-1)
    tokens = jnp.where(index < accepted[:, None], padded_drafts,
                       jnp.where(index == accepted[:, None], last[:, None], -1))
    return accepted, tokens.astype(jnp.int32)


def verify_groups(logits, sampling, state: SamplerState, drafts, *, draws: bool, backend: str):
    """Each request's group of n + 1 sampled rows, flat: logits [U, A] f32 (U = M (n + 1); row 0 at its last token,
    row i at its draft i; rows past a request's drafts are pads), `sampling` (`SamplingMetadata`) per row, drafts [M, n]
    int32 (-1 past a request's). Each row's logits go through the sampler's processing (`processed_logits`; row i's
    penalties over the history before the group and drafts 0..i-1, the tokens it follows when it counts: as
    decoding without drafts would penalize it; the top logprobs by the kernels of `backend`); `accept_drafts`
    decides. Returns (SampledTokens per row: the token it emits, -1 past the group's last, with the raw logits'
    logprobs; accepted [M]; the state with every emitted token counted and each group's last one its slot's last
    token)."""
    groups, n = drafts.shape
    g = n + 1
    arguments = row_arguments(sampling, state)
    vocab = logits.shape[-1]
    counts, group_first = arguments["output_counts"], jnp.arange(groups) * g
    for k in range(n):  # draft k counts for rows k + 1..n of its group
        kept_rows = (group_first[:, None] + jnp.arange(k + 1, g)[None, :]).reshape(-1)
        draft = jnp.repeat(jnp.where(drafts[:, k] >= 0, drafts[:, k], vocab), n - k)
        counts = counts.at[kept_rows, draft].add(1, mode="drop")
    out = processed_logits(logits, draws=draws, backend=backend, **(arguments | dict(output_counts=counts)))
    accepted, tokens = accept_drafts(out.kept.reshape(groups, g, -1), drafts,
                                     is_greedy=sampling.temperature[::g] <= 0, seeds=sampling.seeds[::g],
                                     positions=sampling.positions.reshape(groups, g), draws=draws)
    flat = tokens.reshape(-1)
    logprobs = jnp.take_along_axis(out.raw_logprobs, jnp.maximum(flat, 0)[:, None], axis=-1)[:, 0]
    last = jnp.take_along_axis(tokens, accepted[:, None], axis=-1)[:, 0]
    state = dataclasses.replace(
        state, last_tokens=state.last_tokens.at[sampling.slots[::g]].set(last),
        output_counts=state.output_counts.at[sampling.slots, jnp.where(flat >= 0, flat, vocab)].add(1, mode="drop"))
    return SampledTokens(flat, logprobs, out.top_ids, out.top_logprobs), accepted, state

