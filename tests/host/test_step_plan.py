"""dcp_jax/host/step_plan.py: a plan's rows built into a padded step, and the steady state's decode rows written into
a step of pads equal to the built one."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.sampling import SamplingParams
from dcp_jax.host.sampling_metadata import SamplingMetadata, SamplingTable
from dcp_jax.host.step_inputs import GENERATED, PROMPT
from dcp_jax.host.step_metadata import check_step_metadata
from dcp_jax.host.step_plan import ScheduledRows, build_step, fill_decode_rows


def test_scheduled_rows_concat_and_build_step():
    """Decode rows and a chunk built part by part equal the one step built from all of them."""
    table = SamplingTable(4, scratch_slot=3, eos_token_id=1)
    layout = DcpLayout(2, 1, 4)
    decode = ScheduledRows.decode([0, 1], [6, 9], np.array([[0, -1, -1], [1, 2, -1]], np.int32))
    chunk = ScheduledRows(np.array([2], np.int32), np.array([4], np.int32), np.array([4], np.int32),
                          np.array([[5, -1, -1]], np.int32), np.array([1, 2, 3, 4], np.int32),
                          np.full(4, PROMPT, np.int32), np.array([2, 3, 4, -1], np.int32), np.array([True]),
                          np.array([True]))
    both = ScheduledRows.concat([decode, chunk])
    assert both.num_rows == 6
    inputs, md = build_step(both, bucket=8, seqs=4, layout=layout, max_blocks=3, table=table)
    np.testing.assert_array_equal(md.context_lens, [6, 9, 1, 2, 3, 4, 0, 0])
    np.testing.assert_array_equal(md.query_seqs, [0, 1, 2, 2, 2, 2, 0, 0])
    np.testing.assert_array_equal(inputs.sample_rows, [0, 1, 5, 8])
    np.testing.assert_array_equal(inputs.tokens[:6], [-1, -1, 1, 2, 3, 4])
    check_step_metadata(md, buckets={8: 4}, layout=layout, max_blocks=3, num_pages=8)


def empty_step(table, layout, bucket, seqs, max_blocks):
    """`build_step` of no rows: every row a pad (what `fill_decode_rows` writes into)."""
    return build_step(ScheduledRows.decode([], [], np.zeros((0, max_blocks), np.int32)), bucket=bucket, seqs=seqs,
                      layout=layout, max_blocks=max_blocks, table=table)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=6), extra_rows=st.integers(0, 3),
       dcp=st.sampled_from([1, 2, 3, 4, 8]), interleave=st.sampled_from([1, 2, 4]), fed_back=st.booleans(),
       seed=st.integers(0, 2**16))
def test_decode_rows_written_into_an_empty_step_equal_the_built_step(lens, extra_rows, dcp, interleave, fed_back,
                                                                     seed):
    """The engine's steady state: decode rows written into the bucket's step of pads equal the step `build_step`
    builds for them, field by field, pads included (random lengths, slots, pages, sampling parameters)."""
    rng = np.random.default_rng(seed)
    layout, n = DcpLayout(dcp, interleave, 4), len(lens)
    needed = layout.virtual_blocks(np.asarray(lens))
    max_blocks = int(needed.max()) + 1
    bucket = seqs = n + extra_rows
    table = SamplingTable(9, scratch_slot=8, eos_token_id=1)
    slots = rng.permutation(8)[:n]
    for slot in slots:
        table.set(int(slot), SamplingParams(temperature=float(rng.uniform(0, 1)), top_k=int(rng.integers(0, 9)),
                                            min_tokens=int(rng.integers(0, 3))), int(rng.integers(2**40)), 3)
    width = int(rng.integers(needed.max(), max_blocks + 1))  # the scheduler's tables may be narrower
    pages = rng.permutation(n * width).astype(np.int32).reshape(n, width)
    tables = np.where(np.arange(width)[None] < needed[:, None], pages, -1).astype(np.int32)
    tokens = None if fed_back else rng.integers(0, 50, n)
    rows = ScheduledRows.decode(slots, lens, tables, tokens=tokens)
    if not fed_back:  # a resumed request's generated tokens fed again
        rows = dataclasses.replace(rows, roles=np.full(n, GENERATED, np.int32))
    assert rows.is_decode
    want = build_step(rows, bucket=bucket, seqs=seqs, layout=layout, max_blocks=max_blocks, table=table)
    got = empty_step(table, layout, bucket, seqs, max_blocks)
    fill_decode_rows(*got, rows, layout=layout, table=table)
    for got_part, want_part in zip(got, want):
        for name, value in got_part._asdict().items():
            if name == "sampling":
                for field in SamplingMetadata._fields:
                    np.testing.assert_array_equal(getattr(value, field), getattr(want_part.sampling, field), field)
            else:
                np.testing.assert_array_equal(value, getattr(want_part, name), err_msg=name)


def test_decode_rows_are_refused_where_the_builder_refuses_them():
    layout, table = DcpLayout(2, 1, 4), SamplingTable(5, scratch_slot=4, eos_token_id=1)
    tables = np.array([[0, 1, -1], [2, -1, -1]], np.int32)
    with pytest.raises(ValueError, match="do not fit a step of 1 sequences"):
        fill_decode_rows(*empty_step(table, layout, 1, 1, 3), ScheduledRows.decode([0, 1], [9, 3], tables),
                         layout=layout, table=table)
    with pytest.raises(ValueError, match="unallocated virtual block"):  # 17 tokens need 3 blocks of 8, not 2
        fill_decode_rows(*empty_step(table, layout, 2, 2, 3), ScheduledRows.decode([0, 1], [17, 3], tables),
                         layout=layout, table=table)
    with pytest.raises(ValueError, match="block tables as one"):
        fill_decode_rows(*empty_step(table, layout, 2, 2, 3), ScheduledRows.decode([0, 1], [9, 3], tables[:1]),
                         layout=layout, table=table)
    with pytest.raises(ValueError, match="one context length, token, role and next token each"):
        fill_decode_rows(*empty_step(table, layout, 2, 2, 3), ScheduledRows.decode([0, 1], [9], tables),
                         layout=layout, table=table)
    # Tables wider than the step's are cut, as the builder cuts them.
    wide = ScheduledRows.decode([0, 1], [9, 3], tables)
    got = empty_step(table, layout, 2, 2, 2)
    fill_decode_rows(*got, wide, layout=layout, table=table)
    want = build_step(wide, bucket=2, seqs=2, layout=layout, max_blocks=2, table=table)
    np.testing.assert_array_equal(got[1].block_tables, want[1].block_tables)
    chunk = ScheduledRows(np.array([2], np.int32), np.array([4], np.int32), np.array([4], np.int32), tables[:1],
                          np.arange(4, dtype=np.int32), np.full(4, PROMPT, np.int32), np.full(4, -1, np.int32),
                          np.array([True]), np.array([True]))
    assert not chunk.is_decode and ScheduledRows.decode([0], [3], tables[1:]).is_decode
    assert not ScheduledRows.decode([0], [3], [[2]]).is_decode  # tables one by one: the builder's
