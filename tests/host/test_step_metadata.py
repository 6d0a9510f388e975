"""dcp_jax/host/step_metadata.py: the builder's padding and per-row fields (re-derived from the layout here, the one
place that does it) for decode rows, prefill chunks, MTP verify rows and chained draft rows, and the structural check
that runs before every step."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.sampling_metadata import SamplingTable
from dcp_jax.host.step_metadata import StepMetadata, build_step_metadata, check_step_metadata
from dcp_jax.host.step_plan import ScheduledRows, build_step

BUCKETS = {1: 1, 2: 2, 4: 4, 8: 8}  # row width -> sequence width


def build(lens, tables, bucket=4, dcp=2, interleave=1, page_size=4, max_blocks=3, queries=None):
    """Decode rows (one query a sequence) unless `queries` says how many each sequence computes."""
    return build_step_metadata(lens, queries or [1] * len(lens), tables, rows=bucket, seqs=bucket,
                               layout=DcpLayout(dcp, interleave, page_size), max_blocks=max_blocks)


def assert_is_the_layouts(md: StepMetadata, layout: DcpLayout) -> None:
    """Positions, local lengths and slots are exactly what the layout gives for md's context lengths, sequences and
    block tables (what the builder must produce; no step re-derives it)."""
    positions = np.where(md.context_lens > 0, md.context_lens - 1, 0)
    np.testing.assert_array_equal(md.positions, positions, err_msg="positions are not context_lens - 1")
    np.testing.assert_array_equal(md.local_context_lens, layout.local_context_lens(md.context_lens),
                                  err_msg="local_context_lens are not the layout's")
    for row in range(md.rows):  # one position at a time, through the row's own sequence's table
        want = (layout.slot_mapping([positions[row] if md.context_lens[row] > 0 else -1],
                                    md.block_tables[md.query_seqs[row]][None]) if md.context_lens[row] > 0
                else np.full((layout.dcp_size, 1), -1))
        np.testing.assert_array_equal(md.slot_mapping[:, row], want[:, 0], err_msg="slot_mapping is not the layout's")


@pytest.mark.parametrize("dcp, interleave", [(1, 1), (2, 1), (2, 2), (4, 2), (8, 1)])
def test_fields_and_inert_pad_rows(dcp, interleave):
    lens, tables = [5, 1, 17], [[3, 4], [0], [7, 2, 9, 10, 11]]
    md = build(lens, tables, bucket=8, dcp=dcp, interleave=interleave, page_size=4, max_blocks=5)
    fields = StepMetadata._fields
    assert set(fields) == {"positions", "context_lens", "local_context_lens", "slot_mapping", "block_tables",
                           "query_seqs", "draft_positions", "draft_context_lens", "draft_local_context_lens",
                           "draft_slot_mapping", "draft_query_seqs"}
    for name in fields:
        assert getattr(md, name).dtype == np.int32
    assert md.draft_positions.shape == (8, 0) and md.draft_slot_mapping.shape == (dcp, 8, 0)  # no chained passes
    np.testing.assert_array_equal(md.context_lens, [5, 1, 17, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(md.positions, [4, 0, 16, 0, 0, 0, 0, 0])
    # Local lengths are published for every dcp size, 1 included, and pad rows hold 0 tokens everywhere.
    assert_is_the_layouts(md, DcpLayout(dcp, interleave, 4))
    assert md.local_context_lens.shape == (dcp, 8)
    assert np.all(md.slot_mapping[:, 3:] == -1) and np.all(md.block_tables[3:] == -1)
    np.testing.assert_array_equal(md.query_seqs, [0, 1, 2, 0, 0, 0, 0, 0])
    # Each real row is written by exactly its owner.
    assert np.all((md.slot_mapping[:, :3] >= 0).sum(axis=0) == 1)
    check(md, buckets={8: 8}, dcp=dcp, interleave=interleave, max_blocks=5, num_pages=12)


@pytest.mark.parametrize("dcp, interleave", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_prefill_chunks_are_runs_of_rows_each_at_its_own_position(dcp, interleave):
    """A chunk of n tokens ending at context L is n consecutive rows of its sequence at positions L - n .. L - 1,
    each with the causal length of its own position: the example of `StepMetadata`, padded, at every layout."""
    layout = DcpLayout(dcp, interleave, 4)
    md = build_step_metadata([5, 9, 3], [1, 3, 3], [[3, 4], [7, 2, 9], [1]], rows=8, seqs=4, layout=layout,
                             max_blocks=3)
    np.testing.assert_array_equal(md.context_lens, [5, 7, 8, 9, 1, 2, 3, 0])
    np.testing.assert_array_equal(md.positions, [4, 6, 7, 8, 0, 1, 2, 0])
    np.testing.assert_array_equal(md.query_seqs, [0, 1, 1, 1, 2, 2, 2, 0])
    assert md.block_tables.shape == (4, 3) and np.all(md.block_tables[3] == -1)
    assert_is_the_layouts(md, layout)
    assert np.all((md.slot_mapping[:, :7] >= 0).sum(axis=0) == 1) and np.all(md.slot_mapping[:, 7] == -1)
    check_step_metadata(md, buckets={8: 4}, layout=layout, max_blocks=3, num_pages=12)


def test_builder_rejects_bad_schedules():
    with pytest.raises(ValueError, match="do not fit a step of 2 sequences"):
        build([1, 1, 1], [[0], [1], [2]], bucket=2)
    with pytest.raises(ValueError, match="needs 2 blocks"):
        build([9], [[0]])
    with pytest.raises(ValueError, match=">= 1"):
        build([0], [[0]])
    with pytest.raises(ValueError, match="max_blocks"):
        build([100], [[0, 1, 2]])
    with pytest.raises(ValueError, match="5 query rows do not fit bucket 4"):
        build([5, 3], [[0, 1], [2]], queries=[3, 2])
    with pytest.raises(ValueError, match="num_queries"):
        build([5, 3], [[0, 1], [2]], queries=[6, 1])  # more queries than tokens
    with pytest.raises(ValueError, match="num_queries"):
        build([5, 3], [[0, 1], [2]], queries=[0, 1])


def test_block_tables_as_one_array_equal_the_tables():
    """The scheduler hands its rows' tables as one [n, m] array, -1 past each row's pages: the same metadata as
    the tables one by one, with the same errors."""
    lens, tables = [5, 1, 17], [[3, 4], [0], [7, 2, 9, 10, 11]]
    as_array = np.full((3, 6), -1, np.int32)
    for row, table in enumerate(tables):
        as_array[row, : len(table)] = table
    for a, b in zip(tuple(build(lens, tables, bucket=4, max_blocks=5)),
                    tuple(build(lens, as_array, bucket=4, max_blocks=5))):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="sequence 0: a length of 9 needs 2 blocks, its block table has 1"):
        build([9], np.array([[0, -1, -1]], np.int32))
    with pytest.raises(ValueError, match="max_blocks"):
        build([100], np.array([[0, 1, 2]], np.int32))
    with pytest.raises(ValueError, match="2 block tables for 1 sequences"):
        build([1], np.zeros((2, 3), np.int32))


def check(md, dcp=2, interleave=1, **overrides):
    check_step_metadata(md, **(dict(buckets=BUCKETS, layout=DcpLayout(dcp, interleave, 4), max_blocks=3,
                                    num_pages=8) | overrides))


@settings(max_examples=40, deadline=None)
@given(sequences=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 8)), min_size=1, max_size=4),
       dcp=st.sampled_from([1, 2, 3, 4, 8]), interleave=st.sampled_from([1, 2, 4]))
def test_the_builder_gives_the_layouts_values(sequences, dcp, interleave):
    """Random decode rows and chunks (a sequence of context L computing its last min(n, L) tokens)."""
    layout = DcpLayout(dcp, interleave, page_size=4)
    max_blocks = int(layout.virtual_blocks(60))
    lens = [length for length, _ in sequences]
    queries = [min(n, length) for length, n in sequences]
    tables = [list(range(i * max_blocks, (i + 1) * max_blocks)) for i in range(len(lens))]
    md = build_step_metadata(lens, queries, tables, rows=32, seqs=4, layout=layout, max_blocks=max_blocks)
    assert_is_the_layouts(md, layout)
    want_seqs = np.repeat(np.arange(len(lens)), queries)
    np.testing.assert_array_equal(md.query_seqs[: len(want_seqs)], want_seqs)
    ends = np.cumsum(queries) - 1  # each sequence's last row reaches its whole context
    np.testing.assert_array_equal(md.context_lens[ends], lens)
    check_step_metadata(md, buckets={32: 4}, layout=layout, max_blocks=max_blocks, num_pages=4 * max_blocks)


def test_verify_rows_take_their_local_lengths_from_their_own_global_lengths():
    """MTP verify rows are a run of rows of one request, as a prefill chunk: a vLLM review's example (DCP 2, rank 1,
    context 10, 3 query tokens) must give local lengths 4, 4, 5, not the first row's advanced by the offset."""
    layout = DcpLayout(2, 1, page_size=4)
    md = build_step_metadata([10], [3], [[0, 1]], rows=4, seqs=1, layout=layout, max_blocks=2)
    assert md.context_lens[:3].tolist() == [8, 9, 10]
    assert md.local_context_lens[1, :3].tolist() == [4, 4, 5] and md.local_context_lens[0, :3].tolist() == [4, 5, 5]
    assert_is_the_layouts(md, layout)


def brute_local_len(length: int, rank: int, layout: DcpLayout) -> int:
    """Tokens of the first `length` held by `rank`, counted one by one."""
    return sum((t // layout.interleave) % layout.dcp_size == rank for t in range(length))


@settings(max_examples=40, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 3)), min_size=1, max_size=3),
       n=st.integers(2, 3), dcp=st.sampled_from([1, 2, 3, 4, 8]), interleave=st.sampled_from([1, 2, 4]),
       spare_blocks=st.integers(0, 1))
def test_chained_draft_rows_take_their_local_lengths_from_their_own_positions(groups, n, dcp, interleave,
                                                                              spare_blocks):
    """The MTP layer's chained-pass rows (N >= 2 drafts): for each verify group (its decode row at L - 1, d <= N
    drafts after it) and each offset o = 1..2N-1, the row at position L - 1 + o has the local lengths and slot a
    one-by-one count gives, or is a pad past the sequence's pages."""
    layout = DcpLayout(dcp, interleave, page_size=4)
    size = layout.tokens_per_block
    max_blocks = int(layout.virtual_blocks(40 + 2 * n)) + 1
    lens = [length for length, _ in groups]
    drafts = [min(d, n) for _, d in groups]
    tables = [list(range(i * max_blocks, i * max_blocks + int(layout.virtual_blocks(length + d)) + spare_blocks))
              for i, (length, d) in enumerate(zip(lens, drafts))]
    rows = ScheduledRows.verify(list(range(len(lens))), lens, drafts, np.full((len(lens), max_blocks), -1, np.int32))
    rows = dataclasses.replace(rows, block_tables=tables)
    table = SamplingTable(4, scratch_slot=3, eos_token_id=1)
    _, md = build_step(rows, bucket=16, seqs=4, layout=layout, max_blocks=max_blocks, table=table, group=n + 1)
    for g, (length, d) in enumerate(zip(lens, drafts)):
        assert md.draft_query_seqs[g] == g
        for o in range(1, 2 * n):
            q = length - 1 + o
            if q >= len(tables[g]) * size:  # past its pages: a pad
                assert md.draft_context_lens[g, o - 1] == 0 and (md.draft_slot_mapping[:, g, o - 1] == -1).all()
                continue
            assert (md.draft_positions[g, o - 1], md.draft_context_lens[g, o - 1]) == (q, q + 1)
            for w in range(dcp):
                assert md.draft_local_context_lens[w, g, o - 1] == brute_local_len(q + 1, w, layout)
                owner = (q // interleave) % dcp
                local = (q // (interleave * dcp)) * interleave + q % interleave
                want = tables[g][local // 4] * 4 + local % 4 if w == owner else -1
                assert md.draft_slot_mapping[w, g, o - 1] == want
    assert (md.draft_context_lens[len(lens):] == 0).all() and (md.draft_slot_mapping[:, len(lens):] == -1).all()
    check_step_metadata(md, buckets={16: 4}, layout=layout, max_blocks=max_blocks, num_pages=4 * max_blocks,
                        offsets=2 * n - 1)
    with pytest.raises(ValueError, match="draft_slot_mapping.*expected|shape"):
        check_step_metadata(md, buckets={16: 4}, layout=layout, max_blocks=max_blocks, num_pages=4 * max_blocks,
                            offsets=2 * n + 1)


def test_the_layout_oracle_catches_wrong_values():
    """The re-derivation the step no longer runs still catches what a wrong builder would publish."""
    layout = DcpLayout(2, 1, 4)
    good = build([5, 3], [[0, 1], [2]])
    assert_is_the_layouts(good, layout)
    with pytest.raises(AssertionError, match="not the layout's"):
        swapped = good.local_context_lens[::-1].copy()  # same sums, ranks swapped: still wrong
        assert_is_the_layouts(good._replace(local_context_lens=swapped), layout)
    with pytest.raises(AssertionError, match="slot_mapping"):
        assert_is_the_layouts(good._replace(slot_mapping=good.slot_mapping[::-1].copy()), layout)
    with pytest.raises(AssertionError, match="positions"):
        assert_is_the_layouts(good._replace(positions=good.positions + 1), layout)


def test_validator_names_the_bad_field():
    good = build([5, 3], [[0, 1], [2]])
    check(good)
    with pytest.raises(ValueError, match="bucket"):
        check(build([5, 3], [[0, 1], [2]], bucket=3))
    with pytest.raises(ValueError, match="local_context_lens has shape"):
        check(good, dcp=4)
    with pytest.raises(ValueError, match="block_tables has shape"):
        check(good, max_blocks=5)
    with pytest.raises(TypeError, match="slot_mapping has dtype"):
        bad = good._replace(slot_mapping=good.slot_mapping.astype(np.int64))
        check(bad)
    with pytest.raises(TypeError, match="positions must be an array"):
        check(good._replace(positions=None))
    shared = good.block_tables.copy()
    shared[1, 0] = shared[0, 0]
    with pytest.raises(ValueError, match="written this step are used by two blocks"):
        check(good._replace(block_tables=shared))
    tables = good.block_tables.copy()
    tables[0, 0] = -1  # both sequences need their first virtual block only (8 tokens a block)
    with pytest.raises(ValueError, match="sequence 0.*num_pages=8"):
        check(good._replace(block_tables=tables))
    tables = good.block_tables.copy()
    tables[1, 2] = 8
    with pytest.raises(ValueError, match="pages past the pool's 8"):  # a page id no table may name, read or not
        check(good._replace(block_tables=tables))
    tables[1, 2] = -2
    with pytest.raises(ValueError, match="below -1"):
        check(good._replace(block_tables=tables))
    tables[1, 2] = 7  # past the blocks sequence 1 uses: never read, so allowed
    check(good._replace(block_tables=tables))
    tables[1, 2] = good.block_tables[0, 0]  # but a page written this step may appear nowhere else
    with pytest.raises(ValueError, match="written this step are used by two blocks"):
        check(good._replace(block_tables=tables))
    with pytest.raises(ValueError, match="query_seqs"):
        check(good._replace(query_seqs=good.query_seqs + 4))
    with pytest.raises(TypeError, match="StepMetadata"):
        check({"context_lens": good.context_lens})


def test_the_page_check_covers_each_sequence_up_to_its_longest_row():
    """A chunk's rows share their sequence's pages: the check needs the blocks of its last row, and catches a page
    of that sequence that another one holds too."""
    md = build([9, 3], [[0, 1, 2], [3]], queries=[3, 1], max_blocks=3)  # rows at 7, 8, 9 tokens: 2 and 2 blocks (+1)
    check(md)
    tables = md.block_tables.copy()
    tables[0, 2] = 5  # past the 2 blocks sequence 0 uses: never read
    check(md._replace(block_tables=tables))
    tables[0, 1] = 3  # sequence 1's page in sequence 0's second block
    with pytest.raises(ValueError, match="written this step are used by two blocks"):
        check(md._replace(block_tables=tables))


def test_sequences_may_share_the_pages_they_only_read():
    """A cached prefix: two sequences read the same first page and each writes into its own; a row writing into a
    page another sequence reads is refused."""
    check(build([12, 10], [[0, 1], [0, 2]]))  # 8 tokens a block: rows at positions 11 and 9 write block 1
    with pytest.raises(ValueError, match="written this step are used by two blocks"):
        check(build([12, 3], [[0, 1], [0]]))  # the second sequence writes position 2: into the shared page 0


def test_every_field_is_required():
    with pytest.raises(TypeError):
        StepMetadata(positions=np.zeros(1, np.int32), context_lens=np.zeros(1, np.int32))
