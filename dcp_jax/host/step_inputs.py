"""The step's per-row data besides its metadata (`StepInputs`: the rows' tokens, their requests' sampler slots, which
rows sample and how) and its one builder (host only: numpy, no jax).
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, NamedTuple

import numpy as np

from dcp_jax.host.arrays import spec
from dcp_jax.host.sampling_metadata import SamplingMetadata, SamplingTable, padded

# What a row's token adds to its request's sampler history (`StepInputs.roles`): nothing (a pad row), the prompt's
# mask (a prompt token), a generated token's count (one fed again: a resumed request's history), or nothing again
# (the last sampled token fed back: counted when it was sampled).
PAD, PROMPT, GENERATED, FED_BACK = 0, 1, 2, 3
# A row's token that is its slot's draft i, DRAFT_TOKEN - i (the MTP layer's, still on the device):
# `StepInputs.tokens`.
DRAFT_TOKEN = -2


class StepInputs(NamedTuple):
    """The step's per-row data besides its metadata: the rows' tokens and their requests' sampler slots, and the U
    rows whose next token is sampled (`sample_rows`: U = M x the sample group's width)."""

    # [R] int32: each row's token; -1 = its slot's last sampled token (a decode row whose input is still on the
    # device); DRAFT_TOKEN - i = its slot's draft i (a verify row). Pad rows 0.
    tokens: Annotated[np.ndarray, spec("R")]
    # [R] int32: what each row's token adds to its request's sampler history (PAD, PROMPT, GENERATED, FED_BACK).
    roles: Annotated[np.ndarray, spec("R")]
    # [R] int32: the sampler slot of each row's request; pad rows the scratch slot.
    row_slots: Annotated[np.ndarray, spec("R")]
    # [R] int32: the token after each row's in its request where known (a prompt's next token), else -1: the
    # prompt-logprobs programs report its logprob.
    next_tokens: Annotated[np.ndarray, spec("R")]
    # [R] int32: 1 on a row at its request's position 0, else 0 (the MTP layer zeroes that row's embedding input;
    # given by the host, as nothing in a program may derive values from the global positions).
    is_position_zero: Annotated[np.ndarray, spec("R")]
    # [M] int32: slots whose history starts over this step (the request's first rows); pad one past the scratch
    # slot (no slot: nothing reset, no [A]-wide row written for a pad).
    fresh_slots: Annotated[np.ndarray, spec("M")]
    # [U] int32: the rows whose next token is sampled, in groups of G = num_speculative_tokens + 1 per sampling
    # sequence (U = M * G; G = 1 without drafting): its last row, or with drafts (a verify group) the row of its
    # last accepted token and then its draft rows; pad R, one past the last row (a gather clamps it to a real row,
    # whose draw on the scratch slot is never read; a scatter drops it).
    sample_rows: Annotated[np.ndarray, spec("U")]
    sampling: SamplingMetadata


def step_inputs_sizes(rows: int, seqs: int, group: int) -> dict[str, int]:
    """The sizes of StepInputs' dims for a step of `rows` rows and `seqs` sequences sampled in groups of `group`."""
    return dict(R=rows, M=seqs, U=seqs * group)


def build_step_inputs(slots: Sequence[int], num_queries: Sequence[int], tokens, roles, next_tokens, is_fresh,
                      samples, *, context_lens: Sequence[int], rows: int, seqs: int, table: SamplingTable,
                      num_drafts: Sequence[int] | None = None, group: int = 1) -> StepInputs:
    """`StepInputs` of the sequences of `build_step_metadata` (same order): sequence i on sampler slot `slots[i]`
    has `num_queries[i]` rows, whose tokens, roles and next tokens are the next entries of the flat `tokens`,
    `roles` and `next_tokens`; its history starts over when `is_fresh[i]`; its last row's next token (position
    context_lens[i]) is sampled when `samples[i]`, with the parameters and seed of its slot in `table`, and so is
    the next token of each of the `num_drafts[i]` rows before it (< `group`, the sample groups' width: a verify
    group). Padded to `rows` rows and `seqs` sequences on the scratch slot."""
    slots = np.asarray(slots, np.int32)
    queries = np.asarray(num_queries, np.int64)
    tokens, roles, next_tokens = (np.asarray(a, np.int32).reshape(-1) for a in (tokens, roles, next_tokens))
    is_fresh, samples = np.asarray(is_fresh, bool), np.asarray(samples, bool)
    drafts = np.zeros(len(slots), np.int64) if num_drafts is None else np.asarray(num_drafts, np.int64)
    total = int(queries.sum())
    if not (len(slots) == len(queries) == len(is_fresh) == len(samples) == len(context_lens) == len(drafts) <= seqs
            and len(tokens) == len(roles) == len(next_tokens) == total <= rows):
        raise ValueError(f"{len(slots)} sequences of {queries.tolist()} queries with {len(tokens)} tokens do not fit "
                         f"a step of {rows} rows and {seqs} sequences")
    if (drafts < 0).any() or (drafts >= group).any() or (drafts >= queries).any() or (drafts[~samples] > 0).any():
        raise ValueError(f"draft counts {drafts.tolist()} must be below the group width {group} and the rows "
                         f"{queries.tolist()}, on sampling sequences only")
    scratch = table.scratch_slot
    # Each sampling sequence's group: its last row, or the row before its draft rows and those (its last ones),
    # each sampling the token after it; then pads.
    offsets, sampled_drafts = np.arange(group), drafts[samples][:, None]
    real = offsets <= sampled_drafts
    group_rows = (np.cumsum(queries) - 1)[samples][:, None] - sampled_drafts + offsets
    group_positions = np.asarray(context_lens, np.int64)[samples][:, None] - sampled_drafts + offsets
    is_position_zero = np.zeros(total, np.int32)
    is_position_zero[(np.cumsum(queries) - queries)[np.asarray(context_lens) == queries]] = 1
    return StepInputs(
        tokens=padded(tokens, rows, 0, np.int32),
        roles=padded(roles, rows, PAD, np.int32),
        row_slots=padded(slots if total == len(slots) else np.repeat(slots, queries), rows, scratch, np.int32),
        next_tokens=padded(next_tokens, rows, -1, np.int32),
        is_position_zero=padded(is_position_zero, rows, 0, np.int32),
        fresh_slots=padded(slots[is_fresh], seqs, scratch + 1, np.int32),
        sample_rows=padded(np.where(real, group_rows, rows).reshape(-1), seqs * group, rows, np.int32),
        sampling=table.gather(np.where(real, slots[samples][:, None], scratch).reshape(-1),
                              np.where(real, group_positions, 0).reshape(-1), rows=seqs * group),
    )
