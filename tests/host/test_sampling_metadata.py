"""dcp_jax/host/sampling_metadata.py: the sampling table gathers what the builder builds."""

import numpy as np
import pytest

from dcp_jax.host.sampling import SamplingParams
from dcp_jax.host.sampling_metadata import SamplingMetadata, SamplingTable, build_sampling_metadata


def test_sampling_table_gathers_what_the_builder_builds():
    """A slot set at its prefill samples with its params and seed; unset slots and the scratch slot of pad rows
    are greedy with seed 0, as `build_sampling_metadata` pads."""
    table = SamplingTable(5, scratch_slot=4, eos_token_id=1)
    hot = SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, presence_penalty=0.5,
                         frequency_penalty=-0.25, repetition_penalty=1.2, min_tokens=3, stop_token_ids=[7, 9])
    cold = SamplingParams(temperature=0.0)
    table.set(2, hot, 2**40 + 7, 6)
    table.set(0, cold, 3, 2)
    got = table.gather([2, 0, 1], [9, 4, 6], rows=4)
    want = build_sampling_metadata([hot, cold, SamplingParams(temperature=0.0)], [2**40 + 7, 3, 0], [9, 4, 6],
                                   [2, 0, 1], [6, 2, 0], rows=4, scratch_slot=4, eos_token_id=1)
    assert got.stop_ids[0, :3].tolist() == [1, 7, 9] and (got.stop_ids[0, 3:] == -1).all()  # EOS, then its ids
    assert got.stops_from.tolist() == [9, 0, 0, 0]  # prompt 6 + min_tokens 3; no min_tokens: nothing held
    for name in SamplingMetadata._fields:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        assert getattr(got, name).dtype == getattr(want, name).dtype, name
    table.set(2, cold, 1, 4)  # a slot taken by the next request samples with its params
    assert table.gather([2], [1], rows=1).temperature[0] == 0.0
    with pytest.raises(ValueError, match="bucket of 1 rows"):
        table.gather([0, 1], [1, 1], rows=1)
