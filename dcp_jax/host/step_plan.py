"""The plan of one step before padding (`ScheduledRows`: which sequences compute which rows, with what tokens) and
the two ways it becomes a step's padded `StepInputs` and `StepMetadata`: `build_step` for any plan, and
`fill_decode_rows` for the steady state's decode rows, written into a step of pads (host only: numpy, no jax).
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.sampling_metadata import SamplingTable
from dcp_jax.host.step_inputs import DRAFT_TOKEN, FED_BACK, StepInputs, build_step_inputs
from dcp_jax.host.step_metadata import StepMetadata, build_draft_metadata, build_step_metadata, draft_offsets


@dataclasses.dataclass(frozen=True)
class ScheduledRows:
    """What one step computes, before padding: n sequences in step order, sequence i on sampler slot slots[i] with
    num_queries[i] rows ending at its context_lens[i] (`build_step_metadata`), and the rows' tokens, roles and next
    tokens, flat in row order (`build_step_inputs`). Host numpy arrays; `decode` and `concat` build them."""

    slots: np.ndarray  # [n] int32
    context_lens: np.ndarray  # [n] int32
    num_queries: np.ndarray  # [n] int32
    block_tables: object  # [n, m] int32, -1 past each table, or a sequence of n tables
    tokens: np.ndarray  # [rows] int32, -1: the slot's last sampled token
    roles: np.ndarray  # [rows] int32
    next_tokens: np.ndarray  # [rows] int32, -1: unknown
    is_fresh: np.ndarray  # [n] bool
    samples: np.ndarray  # [n] bool
    # [n] int32: the drafted tokens each sequence verifies (its rows before the last hold them, all sampled); None:
    # none.
    num_drafts: np.ndarray | None = None

    @classmethod
    def decode(cls, slots: Sequence[int], context_lens: Sequence[int], block_tables, tokens=None) -> ScheduledRows:
        """One decode row per sequence, each sampling its next token; its input is the slot's last sampled token,
        or tokens[i] when given."""
        n = len(slots)
        return cls(np.asarray(slots, np.int32), np.asarray(context_lens, np.int32), np.ones(n, np.int32),
                   block_tables, np.full(n, -1, np.int32) if tokens is None else np.asarray(tokens, np.int32),
                   np.full(n, FED_BACK, np.int32), np.full(n, -1, np.int32), np.zeros(n, bool), np.ones(n, bool))

    @classmethod
    def verify(cls, slots: Sequence[int], context_lens: Sequence[int], num_drafts: Sequence[int],
               block_tables) -> ScheduledRows:
        """Per sequence a verify group (speculative decoding): its decode row (the slot's last sampled token, at
        context_lens[i] - 1) and num_drafts[i] rows of its slot's drafted tokens after it, each sampling the token
        after it."""
        lens, drafts = np.asarray(context_lens, np.int32), np.asarray(num_drafts, np.int32)
        queries = drafts + 1
        first = np.repeat(np.cumsum(queries) - queries, queries)
        index = np.arange(int(queries.sum())) - first  # 0: the decode row, i + 1: draft i's
        tokens = np.where(index == 0, -1, DRAFT_TOKEN + 1 - index).astype(np.int32)
        rows = len(tokens)
        return cls(np.asarray(slots, np.int32), lens + drafts, queries, block_tables, tokens,
                   np.full(rows, FED_BACK, np.int32), np.full(rows, -1, np.int32), np.zeros(len(lens), bool),
                   np.ones(len(lens), bool), drafts)

    @property
    def num_rows(self) -> int:
        return int(self.num_queries.sum())

    @property
    def is_decode(self) -> bool:
        """One row a sequence, each sampling, none starting its history over, the tables one array: what
        `fill_decode_rows` writes."""
        return (len(self.tokens) == len(self.slots) and isinstance(self.block_tables, np.ndarray)
                and bool((self.num_queries == 1).all() and self.samples.all()) and not self.is_fresh.any())

    @staticmethod
    def concat(parts: Sequence[ScheduledRows]) -> ScheduledRows:
        """The sequences of `parts`, in order (their block tables arrays of one width)."""
        if len(parts) == 1:
            return parts[0]
        drafts = None
        if any(p.num_drafts is not None for p in parts):
            drafts = np.concatenate([np.zeros(len(p.slots), np.int32) if p.num_drafts is None else p.num_drafts
                                     for p in parts])
        return ScheduledRows(**{f.name: np.concatenate([getattr(p, f.name) for p in parts])
                                for f in dataclasses.fields(ScheduledRows) if f.name != "num_drafts"},
                             num_drafts=drafts)


def fill_decode_rows(inputs: StepInputs, md: StepMetadata, rows: ScheduledRows, *, layout: DcpLayout,
                     table: SamplingTable) -> None:
    """Write `rows`, one decode row a sequence (`ScheduledRows.is_decode`), into the views `inputs` and `md` of a
    padded step that holds no rows yet (`build_step` of none): the step `build_step` builds for them, in a few
    writes. ValueError where `build_step` refuses them; the pages are `check_step_metadata`'s."""
    n, (seqs_width, max_blocks) = len(rows.slots), md.block_tables.shape
    lens, tables = rows.context_lens, np.asarray(rows.block_tables)
    if not len(lens) == len(rows.tokens) == len(rows.roles) == len(rows.next_tokens) == n:
        raise ValueError(f"{n} decode rows need one context length, token, role and next token each, got "
                         f"{len(lens)}, {len(rows.tokens)}, {len(rows.roles)} and {len(rows.next_tokens)}")
    if n > seqs_width or lens.min(initial=1) < 1:
        raise ValueError(f"{n} decode rows of lengths {lens.tolist()} do not fit a step of {seqs_width} sequences")
    if tables.ndim != 2 or len(tables) != n:
        raise ValueError(f"{n} decode rows need their block tables as one [{n}, blocks] array, got shape "
                         f"{tables.shape}")
    seqs = np.arange(n, dtype=np.int32)
    md.positions[:n] = lens - 1
    md.context_lens[:n] = lens
    md.local_context_lens[:, :n] = layout.local_context_lens(lens)
    md.block_tables[:n, : tables.shape[1]] = tables[:, :max_blocks]  # wider tables cut, as the builder cuts them
    md.slot_mapping[:, :n] = layout.slot_mapping(md.positions[:n], md.block_tables, seqs)
    md.query_seqs[:n] = seqs
    inputs.tokens[:n] = rows.tokens
    inputs.roles[:n] = rows.roles
    inputs.row_slots[:n] = rows.slots
    inputs.next_tokens[:n] = rows.next_tokens
    inputs.is_position_zero[:n] = lens == 1
    inputs.sample_rows[:n] = seqs
    table.gather_into(inputs.sampling, rows.slots, lens)


def build_step(rows: ScheduledRows, *, bucket: int, seqs: int, layout: DcpLayout, max_blocks: int,
               table: SamplingTable, group: int = 1) -> tuple[StepInputs, StepMetadata]:
    """The step's `StepInputs` and `StepMetadata` for `rows`, padded to `bucket` rows and `seqs` sequences, sampled
    in groups of `group` rows (`StepInputs.sample_rows`; group - 1 drafts at most, with their chained passes'
    rows from 2 on)."""
    md = build_step_metadata(rows.context_lens, rows.num_queries, rows.block_tables, rows=bucket, seqs=seqs,
                             layout=layout, max_blocks=max_blocks)
    inputs = build_step_inputs(rows.slots, rows.num_queries, rows.tokens, rows.roles, rows.next_tokens,
                               rows.is_fresh, rows.samples, context_lens=rows.context_lens, rows=bucket, seqs=seqs,
                               table=table, num_drafts=rows.num_drafts, group=group)
    if draft_offsets(group - 1):
        drafts = np.zeros(len(rows.slots), np.int64) if rows.num_drafts is None else rows.num_drafts
        md = build_draft_metadata(md, rows.context_lens, drafts, rows.samples, layout=layout,
                                  num_speculative_tokens=group - 1)
    return inputs, md
