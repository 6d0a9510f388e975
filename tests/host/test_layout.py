"""dcp_jax/host/layout.py against brute-force ownership counting."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dcp_jax.host.layout import DcpLayout

dcp_sizes = st.sampled_from([1, 2, 3, 4, 8])
interleaves = st.sampled_from([1, 2, 4])


def brute_force_placement(length, dcp, interleave):
    """Deal the tokens like cards: the next `interleave` tokens go to the current rank, then the turn passes
    to the next rank (wrapping); a token's local index is its arrival order on its rank."""
    owners, locals_, counts = [], [], [0] * dcp
    rank, dealt_to_rank = 0, 0
    for _ in range(length):
        owners.append(rank)
        locals_.append(counts[rank])
        counts[rank] += 1
        dealt_to_rank += 1
        if dealt_to_rank == interleave:
            rank, dealt_to_rank = (rank + 1) % dcp, 0
    return np.array(owners, np.int64), np.array(locals_, np.int64), np.array(counts)


@settings(max_examples=60, deadline=None)
@given(length=st.integers(0, 300), dcp=dcp_sizes, interleave=interleaves)
def test_owner_local_index_and_lengths_match_brute_force(length, dcp, interleave):
    owners, locals_, counts = brute_force_placement(length, dcp, interleave)
    pos = np.arange(length)
    layout = DcpLayout(dcp, interleave, page_size=interleave)
    np.testing.assert_array_equal(layout.owner(pos), owners)
    np.testing.assert_array_equal(layout.local_index(pos), locals_)
    np.testing.assert_array_equal(layout.local_context_lens([length])[:, 0], counts)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 200), min_size=1, max_size=9), dcp=dcp_sizes, interleave=interleaves)
def test_local_context_lens_is_vectorized_over_rows(lengths, dcp, interleave):
    got = DcpLayout(dcp, interleave, page_size=interleave).local_context_lens(lengths)
    assert got.shape == (dcp, len(lengths)) and got.dtype == np.int32
    for row, length in enumerate(lengths):
        np.testing.assert_array_equal(got[:, row], brute_force_placement(length, dcp, interleave)[2])
    np.testing.assert_array_equal(got.sum(axis=0), lengths)


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 300), dcp=dcp_sizes, interleave=interleaves)
def test_global_index_inverts_owner_and_local_index(length, dcp, interleave):
    pos = np.arange(length)
    layout = DcpLayout(dcp, interleave, page_size=interleave)
    np.testing.assert_array_equal(layout.global_index(layout.local_index(pos), layout.owner(pos)), pos)


def test_worked_example_from_the_spec():
    layout = DcpLayout(dcp_size=2, interleave=2, page_size=2)
    np.testing.assert_array_equal(layout.owner(np.arange(7)), [0, 0, 1, 1, 0, 0, 1])
    np.testing.assert_array_equal(layout.local_context_lens([7])[:, 0], [4, 3])


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 120), min_size=1, max_size=5),
    dcp=dcp_sizes,
    interleave=interleaves,
    page_mult=st.sampled_from([1, 2, 4]),
)
def test_slot_mapping_writes_each_token_once_at_its_owner(lengths, dcp, interleave, page_mult):
    page_size = interleave * page_mult
    per_block = page_size * dcp
    rng = np.random.default_rng(sum(lengths))
    max_blocks = max(-(-n // per_block) for n in lengths)
    pages = rng.permutation(len(lengths) * max_blocks).reshape(len(lengths), max_blocks).astype(np.int32)
    owners, local_indices, _ = brute_force_placement(max(lengths), dcp, interleave)
    layout = DcpLayout(dcp, interleave, page_size)
    seen = set()
    for step in range(max(lengths)):
        positions = np.array([step if step < n else -1 for n in lengths])
        slots = layout.slot_mapping(positions, pages)
        assert slots.shape == (dcp, len(lengths))
        for row, p in enumerate(positions):
            col = slots[:, row]
            if p < 0:
                assert np.all(col == -1)
                continue
            owner = owners[p]
            assert np.all(np.delete(col, owner) == -1)
            li = local_indices[p]
            assert col[owner] == pages[row, li // page_size] * page_size + li % page_size
            assert (owner, int(col[owner])) not in seen  # no two tokens share a rank's slot
            seen.add((owner, int(col[owner])))


def test_slot_mapping_of_a_prompt_is_the_slots_of_its_positions_one_by_one():
    """Positions [R, T] (prefill) map as each position [R] (decode) does; -1 pads write nothing."""
    layout = DcpLayout(dcp_size=2, interleave=2, page_size=4)
    tables = np.array([[5, 2], [7, -1]], np.int32)
    positions = np.array([[0, 1, 2, 3, 9, 15], [0, 1, 2, -1, -1, -1]])
    slots = layout.slot_mapping(positions, tables)
    assert slots.shape == (2, 2, 6)
    for t in range(positions.shape[1]):
        np.testing.assert_array_equal(slots[:, :, t], layout.slot_mapping(positions[:, t], tables))
    assert np.all(slots[:, 1, 3:] == -1)


def test_slot_mapping_rejects_missing_blocks():
    layout = DcpLayout(dcp_size=2, interleave=1, page_size=4)
    with pytest.raises(ValueError, match="virtual block"):
        layout.slot_mapping([8], np.zeros((1, 1), np.int32))
    with pytest.raises(ValueError, match="unallocated"):
        layout.slot_mapping([0], -np.ones((1, 1), np.int32))


@pytest.mark.parametrize(
    "dcp, interleave, page_size, message",
    [(0, 1, 4, "dcp_size"), (2, 0, 4, "interleave"), (2, 8, 4, "interleave"), (2, 3, 4, "interleave"),
     (2, 1, 0, "page_size")],
)
def test_bad_layout_is_a_clear_error(dcp, interleave, page_size, message):
    with pytest.raises(ValueError, match=message):
        DcpLayout(dcp, interleave, page_size)


def test_negative_lengths_are_rejected():
    with pytest.raises(ValueError, match="context_lens"):
        DcpLayout(2, 1, 1).local_context_lens([3, -1])


def test_virtual_blocks_hold_page_size_times_dcp_tokens():
    np.testing.assert_array_equal(DcpLayout(2, 1, 4).virtual_blocks([0, 1, 8, 9, 16]), [0, 1, 1, 2, 2])
