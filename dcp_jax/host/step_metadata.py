"""The step metadata of the engine's step programs (`StepMetadata`), its one builder and its one structural check
(host only: numpy, no jax).

A step is R query rows over M sequences: a decode row computes a request's next token, a prefill chunk is a run of
rows computing consecutive tokens of one request, MTP verify rows are another such run. Every index a program
needs (positions, causal lengths, per-rank local lengths, slots, block tables) is computed here per row with numpy,
padded to the program's bucket, and handed to the jitted program as a required input. The builders are the only
constructors and validate what they are given (`step_plan.fill_decode_rows` writes the steady state's decode rows
into a step of pads, equal to `build_step_metadata`'s by test); `check_step_metadata` runs before every step and
checks what a program relies on: the structure (fields, shapes, dtypes, a known bucket) and the pages (every page
a sequence uses is in the pool and used by that sequence alone). That the values are the layout's is the
builders' job, proven by tests.

Each field is documented once, above it, and declared with its dims (`host/arrays.py`): a field whose first dim is
W is per rank, [W, ...] sharded over the "dcp" mesh axis (inside the program each rank sees its own [...] slice:
`arrays.rank_view`); every other field is replicated.
Letters: see the legend in `dcp_jax/__init__.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, NamedTuple

import numpy as np

from dcp_jax.host import arrays
from dcp_jax.host.arrays import spec
from dcp_jax.host.layout import DcpLayout


class StepMetadata(NamedTuple):
    """One step of R query rows (the bucket) over M sequences (the bucket's sequence width): row r computes the token
    at position positions[r] of sequence query_seqs[r], attending causally to that sequence's first
    context_lens[r] tokens (the token itself included). A sequence's rows are consecutive, in position order.
    M=2, W=1: context_lens [5, 9], 1 and 3 queries -> rows (seq 0, pos 4), (seq 1, pos 6), (seq 1, pos 7),
    (seq 1, pos 8) with context_lens [5, 7, 8, 9]."""

    # [R] int32: global position of each row's token. Pad rows 0.
    positions: Annotated[np.ndarray, spec("R")]
    # [R] int32: global causal length of each row (position + 1). Pad rows 0.
    context_lens: Annotated[np.ndarray, spec("R")]
    # [W, R] int32, per rank: tokens of row r's causal context held by rank w (sums to context_lens). Pad rows 0.
    local_context_lens: Annotated[np.ndarray, spec("W R")]
    # [W, R] int32, per rank: physical slot where rank w writes row r's token; -1 = not the owner (no write). Pad
    # rows -1 on every rank.
    slot_mapping: Annotated[np.ndarray, spec("W R")]
    # [M, P] int32: virtual-block page ids of each sequence (one id names the same page on every rank); -1 =
    # unallocated. Pad sequences all -1.
    block_tables: Annotated[np.ndarray, spec("M P")]
    # [R] int32: the sequence (row of block_tables) of each row. Pad rows 0 (they read nothing: length 0).
    query_seqs: Annotated[np.ndarray, spec("R")]
    # The MTP layer's chained passes (speculative decoding with N >= 2 drafts; else O = 0). After the verify, a
    # sampling sequence whose group's first row is at position p and which keeps a of its drafts drafts again: its
    # first draft at its last emitted row (p + a), draft j + 1 (j = 1..N-1) with one more row at position
    # p + a + j. The host cannot know a, so it builds the row at each offset o = 1..2N-1 past p (a + j = o); the
    # program picks column a + j - 1 (`draft_pass_view`). Positions past the sequence's pages are pads (length 0,
    # no write: a draft there is never verified). Each draft_X field is the pass rows' X.
    # [G, O] int32: the row's position. Pad entries 0.
    draft_positions: Annotated[np.ndarray, spec("G O")]
    # [G, O] int32: its global causal length (position + 1). Pad entries 0.
    draft_context_lens: Annotated[np.ndarray, spec("G O")]
    # [W, G, O] int32, per rank: tokens of its causal context held by rank w.
    draft_local_context_lens: Annotated[np.ndarray, spec("W G O")]
    # [W, G, O] int32, per rank: the slot where rank w writes its MTP latent; -1 = not the owner, or a pad.
    draft_slot_mapping: Annotated[np.ndarray, spec("W G O")]
    # [G] int32: each sample group's sequence (row of block_tables). Pad groups 0.
    draft_query_seqs: Annotated[np.ndarray, spec("G")]

    @property
    def rows(self) -> int:
        """Bucket width R; selects the compiled program."""
        return self.context_lens.shape[0]


def step_metadata_sizes(rows: int, seqs: int, dcp_size: int, max_blocks: int, offsets: int) -> dict[str, int]:
    """The sizes of StepMetadata's dims for a step of `rows` rows and `seqs` sequences, with `offsets` draft offsets
    (`draft_offsets`; 0: no chained passes)."""
    return dict(R=rows, M=seqs, G=seqs, W=dcp_size, P=max_blocks, O=offsets)


def draft_pass_view(md: StepMetadata, column) -> StepMetadata:
    """The metadata of one chained MTP pass, a rank's view inside the program or the host's (traced arrays work):
    each row field X replaced by draft_X's entries at `column` [G] of each sample group (a group a row;
    `StepMetadata`'s draft fields)."""
    groups = np.arange(md.draft_query_seqs.shape[0])

    def pick(name: str, field: arrays.Spec):
        value = getattr(md, name)
        return value[..., groups, column] if "O" in field.dims else value

    drafts = {name: field for name, field in arrays.fields(StepMetadata).items() if name.startswith("draft_")}
    return md._replace(**{name.removeprefix("draft_"): pick(name, field) for name, field in drafts.items()})


def _check_lengths(lens: np.ndarray, seqs: int, what: str) -> None:
    if lens.ndim != 1 or lens.shape[0] > seqs:
        raise ValueError(f"{lens.shape[0] if lens.ndim == 1 else lens.shape} scheduled sequences do not fit a step of "
                         f"{seqs} sequences")
    if (lens < 1).any():
        raise ValueError(f"{what} of scheduled sequences must be >= 1, got {lens.tolist()}")


def _padded_tables(lens: np.ndarray, block_tables, layout: DcpLayout, rows: int, max_blocks: int) -> np.ndarray:
    """[rows, max_blocks] int32 of the sequences' page ids, -1 past each table and on pad rows, after checking that
    each table covers its sequence's tokens. `block_tables` is a sequence of tables (arrays, `page_allocator.BlockTable`
    or lists; lists convert slowly when long) or one [n, m] int array, -1 past each row's ids (one copy)."""
    n = lens.shape[0]
    if len(block_tables) != n:
        raise ValueError(f"{len(block_tables)} block tables for {n} sequences")
    needed = layout.virtual_blocks(lens)
    if (needed > max_blocks).any():
        row = int(np.argmax(needed > max_blocks))
        raise ValueError(f"sequence {row}: a length of {lens[row]} needs {needed[row]} blocks > {max_blocks=}")
    tables = np.full((rows, max_blocks), -1, np.int32)
    if isinstance(block_tables, np.ndarray):
        if block_tables.ndim != 2:
            raise ValueError(f"block tables as one array must be [rows, blocks], got shape {block_tables.shape}")
        tables[:n, : block_tables.shape[1]] = block_tables[:, :max_blocks]
        # -1 past each row's ids: a row holds its needed blocks when the last one is set.
        is_short = tables[np.arange(n), np.maximum(needed - 1, 0)] < 0
    else:
        sizes = np.zeros(n, np.int64)
        for row, table in enumerate(block_tables):
            table = np.asarray(table, np.int32)[:max_blocks]
            tables[row, : len(table)] = table
            sizes[row] = len(table)
        is_short = sizes < needed
    if is_short.any():
        row = int(np.argmax(is_short))
        raise ValueError(f"sequence {row}: a length of {lens[row]} needs {needed[row]} blocks, its block table has "
                         f"{np.count_nonzero(tables[row] >= 0)} page ids")
    return tables


def build_step_metadata(context_lens: Sequence[int], num_queries: Sequence[int], block_tables, *, rows: int,
                        seqs: int, layout: DcpLayout, max_blocks: int) -> StepMetadata:
    """`StepMetadata` (numpy) of sequences that each compute their last `num_queries[i]` tokens (positions
    context_lens[i] - num_queries[i] .. context_lens[i] - 1), one row each, sequence after sequence; padded to
    `rows` inert rows and `seqs` empty sequences.

    context_lens[i]: global length of sequence i once this step's rows are in (>= num_queries[i] >= 1).
    block_tables[i]: its virtual-block page ids (at least ceil(context_len / (page_size * dcp_size)) of them).
    """
    lens = np.asarray(context_lens, dtype=np.int64).reshape(-1)
    queries = np.asarray(num_queries, dtype=np.int64).reshape(-1)
    _check_lengths(lens, seqs, "context_lens")
    if queries.shape != lens.shape or (queries < 1).any() or (queries > lens).any():
        raise ValueError(f"num_queries {queries.tolist()} must be in [1, context_len] for context_lens "
                         f"{lens.tolist()}")
    total = int(queries.sum())
    if total > rows:
        raise ValueError(f"{total} query rows do not fit bucket {rows}")
    tables = _padded_tables(lens, block_tables, layout, seqs, max_blocks)
    row_lens = np.zeros(rows, np.int32)
    query_seqs = np.zeros(rows, np.int32)
    n = lens.shape[0]
    if total == n:  # one row a sequence (a decode step)
        row_lens[:n] = lens
        query_seqs[:n] = np.arange(n)
    else:  # row j of the sequence whose rows end at `end` (exclusive) has length len - end + j + 1
        ends = np.cumsum(queries)
        row_lens[:total] = np.repeat(lens - ends, queries) + np.arange(1, total + 1)
        query_seqs[:total] = np.repeat(np.arange(n), queries)
    positions = np.maximum(row_lens - 1, 0)
    # No chained passes: `build_draft_metadata` fills the draft fields in.
    no_drafts = arrays.build(StepMetadata, step_metadata_sizes(rows, seqs, layout.dcp_size, max_blocks, 0),
                             np.zeros)
    return no_drafts._replace(
        positions=positions,
        context_lens=row_lens,
        local_context_lens=layout.local_context_lens(row_lens),
        slot_mapping=layout.slot_mapping(np.where(row_lens > 0, positions, -1), tables, query_seqs),
        block_tables=tables,
        query_seqs=query_seqs,
    )


def draft_offsets(num_speculative_tokens: int) -> int:
    """O, the offsets of `StepMetadata`'s draft_* fields: 2N - 1 for N >= 2 drafts, else 0 (no chained pass)."""
    return 2 * num_speculative_tokens - 1 if num_speculative_tokens >= 2 else 0


def build_draft_metadata(md: StepMetadata, context_lens, num_drafts, samples, *, layout: DcpLayout,
                         num_speculative_tokens: int) -> StepMetadata:
    """`md` (`build_step_metadata`'s, same sequences) with its draft_* fields: the MTP layer's chained-pass rows of
    each sampling sequence (`samples[i]`), whose group's first row is at position context_lens[i] - num_drafts[i]
    - 1; each row's lengths derived from its own position, a row past its sequence's pages a pad."""
    offsets = draft_offsets(num_speculative_tokens)
    groups = md.block_tables.shape[0]
    seqs = np.flatnonzero(np.asarray(samples, bool))
    first = (np.asarray(context_lens, np.int64) - np.asarray(num_drafts, np.int64) - 1)[seqs]
    positions = first[:, None] + np.arange(1, offsets + 1)  # [s, O]
    covered = np.count_nonzero(md.block_tables[seqs] >= 0, axis=1) * layout.tokens_per_block
    positions = np.where(positions < covered[:, None], positions, -1)  # -1: a pad
    padded = np.full((groups, offsets), -1, np.int64)
    padded[: len(seqs)] = positions
    lens = (padded + 1).astype(np.int32)
    draft_seqs = np.zeros(groups, np.int32)
    draft_seqs[: len(seqs)] = seqs
    return md._replace(
        draft_positions=np.maximum(padded, 0).astype(np.int32), draft_context_lens=lens,
        draft_local_context_lens=layout.local_context_lens(lens.reshape(-1)).reshape(-1, groups, offsets),
        draft_slot_mapping=layout.slot_mapping(padded, md.block_tables, draft_seqs), draft_query_seqs=draft_seqs)


def check_step_metadata(md, *, buckets: Mapping[int, int], layout: DcpLayout, max_blocks: int,
                        num_pages: int, offsets: int = 0) -> None:
    """TypeError/ValueError unless `md` is a complete, well-shaped StepMetadata of a known bucket (`buckets` maps
    its row width R to its sequence width M) whose sequences use pages of the pool, each page a row writes by that
    row's sequence alone (either fault would make a row read or overwrite another request's KV), and whose rows
    name sequences of the step. Runs on the host before anything is traced; the value checks need host (numpy)
    arrays."""
    is_step = isinstance(md, StepMetadata)
    rows = np.shape(md.context_lens)[0] if is_step and np.ndim(md.context_lens) == 1 else None
    if is_step and rows not in buckets:
        raise ValueError(f"context_lens shape {np.shape(md.context_lens)} is not [R] for a bucket R in "
                         f"{list(buckets)}")
    seqs = buckets.get(rows)
    arrays.check(md, StepMetadata, step_metadata_sizes(rows, seqs, layout.dcp_size, max_blocks, offsets))
    if not isinstance(md.block_tables, np.ndarray):
        return
    if (md.context_lens < 0).any():
        raise ValueError(f"context_lens must be >= 0, got {md.context_lens.tolist()}")
    if md.query_seqs.min() < 0 or md.query_seqs.max() >= seqs:
        raise ValueError(f"query_seqs must name sequences in [0, {seqs}), got {md.query_seqs.tolist()}")
    blocks = layout.virtual_blocks(md.context_lens)
    if rows == seqs and (md.query_seqs == np.arange(rows)).all():  # a row a sequence (a decode step)
        needed = blocks
    else:  # blocks each sequence uses: those of its longest row
        needed = np.zeros(seqs, np.int64)
        np.maximum.at(needed, md.query_seqs, blocks)
    slots = md.slot_mapping
    if offsets:
        if (md.draft_context_lens < 0).any() or md.draft_query_seqs.min() < 0 or md.draft_query_seqs.max() >= seqs:
            raise ValueError(f"draft_context_lens must be >= 0 and draft_query_seqs name sequences in [0, {seqs}), "
                             f"got {md.draft_context_lens.tolist()} and {md.draft_query_seqs.tolist()}")
        np.maximum.at(needed, md.draft_query_seqs, layout.virtual_blocks(md.draft_context_lens.max(axis=1)))
        slots = np.concatenate([slots.reshape(-1), md.draft_slot_mapping.reshape(-1)])
    _check_pages(needed, md.block_tables, slots, layout.page_size, num_pages)


def _check_pages(needed: np.ndarray, block_tables: np.ndarray, slot_mapping: np.ndarray, page_size: int,
                 num_pages: int) -> None:
    """ValueError unless every table names pages in [-1, num_pages), each sequence s holds a page for each of its
    first needed[s] blocks (its tables -1 past its pages only: the scheduler's, `PageAllocator.BlockTable`), and
    every page a row writes (`slot_mapping`) appears once in all the tables: sequences may share only the pages
    they read (a cached prefix). Reductions and one gather over the tables: this runs before every step (at B = 256
    and 32K contexts, 131K page ids)."""
    if block_tables.size and block_tables.max() >= num_pages:
        raise ValueError(f"block tables name pages past the pool's {num_pages}: {int(block_tables.max())}")
    if block_tables.size and block_tables.min() < -1:
        raise ValueError(f"block tables name a page below -1 (unallocated): {int(block_tables.min())}")
    last = block_tables[np.arange(len(needed)), np.maximum(needed - 1, 0)]
    is_short = (needed > 0) & (last < 0)
    if is_short.any():
        row = int(np.argmax(is_short))
        raise ValueError(f"sequence {row}: block table {block_tables[row, : needed[row]].tolist()} needs page ids "
                         f"in [0, num_pages={num_pages}) for its {int(needed[row])} blocks")
    # The pages written, sorted and distinct (a chunk's rows write one page several times).
    written = np.sort(slot_mapping[slot_mapping >= 0]) // page_size
    written = written[np.concatenate(([True], written[1:] != written[:-1]))] if written.size else written
    if written.size and written[-1] >= num_pages:
        raise ValueError(f"slot_mapping names slots past the pool's {num_pages * page_size}")
    is_written = np.zeros(num_pages + 1, np.bool_)  # the last entry is what -1 (no page) reads: never written
    is_written[written] = True
    # Each written page once in all the tables: the tables' written entries, sorted, are exactly `written`.
    found = np.sort(block_tables[np.take(is_written, block_tables)])  # take: 2.5x an index's speed here
    if found.shape != written.shape or (found != written).any():
        pages, uses = np.unique(found, return_counts=True)
        shared = np.setdiff1d(written, pages[uses == 1])[:16].tolist()
        raise ValueError(f"pages written this step are used by two blocks (one sequence or two), or by none: "
                         f"{shared}")
