"""dcp_jax/host/metadata.py: the builders' padding and per-rank fields (re-derived from the layout here, the one
place that does it), and the structural check that runs before every step."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dcp_jax.config import EngineConfig
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.metadata import (DecodeMetadata, PrefillMetadata, SamplingMetadata, SamplingTable,
                                   build_decode_metadata, build_prefill_metadata, build_sampling_metadata,
                                   check_decode_metadata, check_prefill_metadata, field_names)
from dcp_jax.host.sampling import SamplingParams

BUCKETS = (1, 2, 4, 8)


def build(lens, tables, bucket=4, dcp=2, interleave=1, page_size=4, max_blocks=3):
    return build_decode_metadata(lens, tables, bucket=bucket, layout=DcpLayout(dcp, interleave, page_size),
                                 max_blocks=max_blocks)


def assert_is_the_layouts(md: DecodeMetadata, layout: DcpLayout) -> None:
    """Positions, local lengths and slots are exactly what the layout gives for md's context lengths and block
    tables (what the builder must produce; no step re-derives it)."""
    positions = np.where(md.context_lens > 0, md.context_lens - 1, 0)
    np.testing.assert_array_equal(md.positions, positions, err_msg="positions are not context_lens - 1")
    np.testing.assert_array_equal(md.local_context_lens, layout.local_context_lens(md.context_lens),
                                  err_msg="local_context_lens are not the layout's")
    slots = layout.slot_mapping(np.where(md.context_lens > 0, positions, -1), md.block_tables)
    np.testing.assert_array_equal(md.slot_mapping, slots, err_msg="slot_mapping is not the layout's")


@pytest.mark.parametrize("dcp, interleave", [(1, 1), (2, 1), (2, 2), (4, 2), (8, 1)])
def test_fields_and_inert_pad_rows(dcp, interleave):
    lens, tables = [5, 1, 17], [[3, 4], [0], [7, 2, 9, 10, 11]]
    md = build(lens, tables, bucket=8, dcp=dcp, interleave=interleave, page_size=4, max_blocks=5)
    fields = field_names(DecodeMetadata)
    assert set(fields) == {"positions", "context_lens", "local_context_lens", "slot_mapping", "block_tables"}
    for name in fields:
        assert getattr(md, name).dtype == np.int32
    np.testing.assert_array_equal(md.context_lens, [5, 1, 17, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(md.positions, [4, 0, 16, 0, 0, 0, 0, 0])
    # Local lengths are published for every dcp size, 1 included, and pad rows hold 0 tokens everywhere.
    assert_is_the_layouts(md, DcpLayout(dcp, interleave, 4))
    assert md.local_context_lens.shape == (dcp, 8)
    assert np.all(md.slot_mapping[:, 3:] == -1) and np.all(md.block_tables[3:] == -1)
    # Each real row is written by exactly its owner.
    assert np.all((md.slot_mapping[:, :3] >= 0).sum(axis=0) == 1)
    check(md, buckets=(8,), dcp=dcp, interleave=interleave, max_blocks=5, num_pages=12)


def test_builder_rejects_bad_schedules():
    with pytest.raises(ValueError, match="do not fit bucket"):
        build([1, 1, 1], [[0], [1], [2]], bucket=2)
    with pytest.raises(ValueError, match="needs 2 blocks"):
        build([9], [[0]])
    with pytest.raises(ValueError, match=">= 1"):
        build([0], [[0]])
    with pytest.raises(ValueError, match="max_blocks"):
        build([100], [[0, 1, 2]])


def test_block_tables_as_one_array_equal_the_tables():
    """The scheduler hands its rows' tables as one [n, m] array, -1 past each row's pages: the same metadata as
    the tables one by one, with the same errors."""
    lens, tables = [5, 1, 17], [[3, 4], [0], [7, 2, 9, 10, 11]]
    as_array = np.full((3, 6), -1, np.int32)
    for row, table in enumerate(tables):
        as_array[row, : len(table)] = table
    for a, b in zip(dataclasses.astuple(build(lens, tables, bucket=4, max_blocks=5)),
                    dataclasses.astuple(build(lens, as_array, bucket=4, max_blocks=5))):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="needs 2 blocks, its block table has 1"):
        build([9], np.array([[0, -1, -1]], np.int32))
    with pytest.raises(ValueError, match="max_blocks"):
        build([100], np.array([[0, 1, 2]], np.int32))
    with pytest.raises(ValueError, match="2 block tables for 1 rows"):
        build([1], np.zeros((2, 3), np.int32))


def test_sampling_table_gathers_what_the_builder_builds():
    """A slot set at its prefill samples with its params and seed; unset slots and the scratch slot of pad rows
    are greedy with seed 0, as `build_sampling_metadata` pads."""
    table = SamplingTable(5, scratch_slot=4)
    hot = SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, presence_penalty=0.5,
                         frequency_penalty=-0.25, repetition_penalty=1.2)
    cold = SamplingParams(temperature=0.0)
    table.set(2, hot, 2**40 + 7)
    table.set(0, cold, 3)
    got = table.gather([2, 0, 1], [9, 4, 6], rows=4)
    want = build_sampling_metadata([hot, cold, SamplingParams(temperature=0.0)], [2**40 + 7, 3, 0], [9, 4, 6],
                                   [2, 0, 1], rows=4, scratch_slot=4)
    for name in field_names(SamplingMetadata):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        assert getattr(got, name).dtype == getattr(want, name).dtype, name
    table.set(2, cold, 1)  # a slot taken by the next request samples with its params
    assert table.gather([2], [1], rows=1).temperature[0] == 0.0
    with pytest.raises(ValueError, match="bucket of 1 rows"):
        table.gather([0, 1], [1, 1], rows=1)


def check(md, dcp=2, interleave=1, **overrides):
    check_decode_metadata(md, **(dict(buckets=BUCKETS, layout=DcpLayout(dcp, interleave, 4), max_blocks=3,
                                      num_pages=8) | overrides))


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 60), min_size=1, max_size=8), dcp=st.sampled_from([1, 2, 3, 4, 8]),
       interleave=st.sampled_from([1, 2, 4]))
def test_the_builder_gives_the_layouts_values(lens, dcp, interleave):
    layout = DcpLayout(dcp, interleave, page_size=4)
    max_blocks = int(layout.virtual_blocks(60))
    tables = [list(range(i * max_blocks, (i + 1) * max_blocks)) for i in range(len(lens))]
    md = build_decode_metadata(lens, tables, bucket=8, layout=layout, max_blocks=max_blocks)
    assert_is_the_layouts(md, layout)
    check_decode_metadata(md, buckets=(8,), layout=layout, max_blocks=max_blocks, num_pages=8 * max_blocks)


def test_the_layout_oracle_catches_wrong_values():
    """The re-derivation the step no longer runs still catches what a wrong builder would publish."""
    layout = DcpLayout(2, 1, 4)
    good = build([5, 3], [[0, 1], [2]])
    assert_is_the_layouts(good, layout)
    with pytest.raises(AssertionError, match="not the layout's"):
        swapped = good.local_context_lens[::-1].copy()  # same sums, ranks swapped: still wrong
        assert_is_the_layouts(dataclasses.replace(good, local_context_lens=swapped), layout)
    with pytest.raises(AssertionError, match="slot_mapping"):
        assert_is_the_layouts(dataclasses.replace(good, slot_mapping=good.slot_mapping[::-1].copy()), layout)
    with pytest.raises(AssertionError, match="positions"):
        assert_is_the_layouts(dataclasses.replace(good, positions=good.positions + 1), layout)


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
        bad = dataclasses.replace(good, slot_mapping=good.slot_mapping.astype(np.int64))
        check(bad)
    with pytest.raises(TypeError, match="positions must be an array"):
        check(dataclasses.replace(good, positions=None))
    shared = good.block_tables.copy()
    shared[1, 0] = shared[0, 0]
    with pytest.raises(ValueError, match="used by two blocks"):
        check(dataclasses.replace(good, block_tables=shared))
    for row, page in [(0, -1), (1, 8)]:  # both rows need their first virtual block only (8 tokens a block)
        tables = good.block_tables.copy()
        tables[row, 0] = page
        with pytest.raises(ValueError, match=f"row {row}.*num_pages=8"):
            check(dataclasses.replace(good, block_tables=tables))
    tables = good.block_tables.copy()
    tables[1, 2] = 99  # past the blocks row 1 uses: never read, so allowed
    check(dataclasses.replace(good, block_tables=tables))
    with pytest.raises(TypeError, match="DecodeMetadata"):
        check({"context_lens": good.context_lens})


def test_every_field_is_required():
    with pytest.raises(TypeError):
        DecodeMetadata(positions=np.zeros(1, np.int32), context_lens=np.zeros(1, np.int32))
    with pytest.raises(TypeError):
        PrefillMetadata(positions=np.zeros((1, 4), np.int32), logits_indices=np.zeros(1, np.int32))


@pytest.mark.parametrize("dcp, interleave", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_prefill_metadata_writes_each_prompt_token_at_its_owner(dcp, interleave):
    layout = DcpLayout(dcp, interleave, page_size=4)
    lens, tables = [5, 13], [[3, 4], [7, 2, 9, 1]]
    md = build_prefill_metadata(lens, tables, rows=4, tokens=16, layout=layout, max_blocks=4, num_pages=10)
    assert md.bucket == (4, 16)
    np.testing.assert_array_equal(md.logits_indices, [4, 12, 0, 0])
    np.testing.assert_array_equal(md.positions[1], np.where(np.arange(16) < 13, np.arange(16), 0))
    assert np.all(md.slot_mapping[:, 2:] == -1) and np.all(md.slot_mapping[:, 0, 5:] == -1)
    for row, n in enumerate(lens):  # token t of row r: exactly its owner writes it, at the decode step's slot
        for t in range(n):
            decode_slots = layout.slot_mapping([t], [tables[row]])[:, 0]
            np.testing.assert_array_equal(md.slot_mapping[:, row, t], decode_slots)
    check_prefill_metadata(md, buckets=[(4, 16)], layout=layout, num_pages=10)
    with pytest.raises(ValueError, match="prefill bucket"):
        check_prefill_metadata(md, buckets=[(1, 16)], layout=layout, num_pages=10)
    with pytest.raises(ValueError, match="past the pool"):
        check_prefill_metadata(md, buckets=[(4, 16)], layout=layout, num_pages=5)
    with pytest.raises(ValueError, match="page ids in \\[0, num_pages=7\\)"):  # row 1's first page is 7
        build_prefill_metadata(lens, tables, rows=4, tokens=16, layout=layout, max_blocks=4, num_pages=7)
    with pytest.raises(ValueError, match="used by two blocks"):
        build_prefill_metadata(lens, [[3, 4], [3, 2, 9, 1]], rows=4, tokens=16, layout=layout, max_blocks=4,
                               num_pages=10)
    with pytest.raises(ValueError, match="does not fit a prefill of 8"):
        build_prefill_metadata(lens, tables, rows=4, tokens=8, layout=layout, max_blocks=4, num_pages=10)


def test_bucket_ladder_is_capped_by_max_num_seqs():
    assert EngineConfig(max_num_seqs=8).buckets == (1, 2, 4, 8)
    assert EngineConfig(max_num_seqs=6).buckets == (1, 2, 4, 6)
    assert EngineConfig(max_num_seqs=300).buckets == (1, 2, 4, 8, 16, 32, 64, 128, 256, 300)
    assert EngineConfig(max_num_seqs=6).bucket_for(3) == 4
    with pytest.raises(ValueError):
        EngineConfig(max_num_seqs=6).bucket_for(7)
    with pytest.raises(ValueError, match="bucket_ladder"):
        EngineConfig(bucket_ladder=(4, 2))
