"""dcp_jax/metadata.py: the builder's padding and per-rank fields, and the host validator."""

import dataclasses

import numpy as np
import pytest

from dcp_jax import layout
from dcp_jax.config import EngineConfig
from dcp_jax.metadata import FIELDS, DecodeMetadata, build_decode_metadata, check_decode_metadata

BUCKETS = (1, 2, 4, 8)


def build(lens, tables, bucket=4, dcp=2, interleave=1, page_size=4, max_blocks=3):
    return build_decode_metadata(lens, tables, bucket=bucket, dcp=dcp, interleave=interleave,
                                 page_size=page_size, max_blocks=max_blocks)


@pytest.mark.parametrize("dcp, interleave", [(1, 1), (2, 1), (2, 2), (4, 2), (8, 1)])
def test_fields_and_inert_pad_rows(dcp, interleave):
    lens, tables = [5, 1, 17], [[3, 4], [0], [7, 2, 9, 10, 11]]
    md = build(lens, tables, bucket=8, dcp=dcp, interleave=interleave, page_size=4, max_blocks=5)
    assert set(FIELDS) == {"positions", "context_lens", "local_context_lens", "slot_mapping", "block_tables"}
    for name in FIELDS:
        assert getattr(md, name).dtype == np.int32
    np.testing.assert_array_equal(md.context_lens, [5, 1, 17, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(md.positions, [4, 0, 16, 0, 0, 0, 0, 0])
    # Local lengths are published for every dcp size, 1 included, and pad rows hold 0 tokens everywhere.
    np.testing.assert_array_equal(md.local_context_lens, layout.local_context_lens(md.context_lens, dcp, interleave))
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


def check(md, **overrides):
    check_decode_metadata(md, **(dict(buckets=BUCKETS, dcp=2, interleave=1, max_blocks=3, page_size=4, num_pages=8) | overrides))


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
    with pytest.raises(ValueError, match="not the layout's"):
        swapped = good.local_context_lens[::-1].copy()  # same sums, ranks swapped: still wrong
        check(dataclasses.replace(good, local_context_lens=swapped))
    with pytest.raises(ValueError, match="slot_mapping"):
        check(dataclasses.replace(good, slot_mapping=good.slot_mapping[::-1].copy()))
    with pytest.raises(ValueError, match="positions"):
        check(dataclasses.replace(good, positions=good.positions + 1))
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


def test_bucket_ladder_is_capped_by_max_num_seqs():
    assert EngineConfig(max_num_seqs=8).buckets == (1, 2, 4, 8)
    assert EngineConfig(max_num_seqs=6).buckets == (1, 2, 4, 6)
    assert EngineConfig(max_num_seqs=300).buckets == (1, 2, 4, 8, 16, 32, 64, 128, 256, 300)
    assert EngineConfig(max_num_seqs=6).bucket_for(3) == 4
    with pytest.raises(ValueError):
        EngineConfig(max_num_seqs=6).bucket_for(7)
    with pytest.raises(ValueError, match="bucket_ladder"):
        EngineConfig(bucket_ladder=(4, 2))
