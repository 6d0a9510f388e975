"""dcp_jax/host/step_inputs.py: each sequence's rows and samples placed by the builder."""

import numpy as np
import pytest

from dcp_jax.host.sampling import SamplingParams
from dcp_jax.host.sampling_metadata import SamplingTable
from dcp_jax.host.step_inputs import FED_BACK, GENERATED, PAD, PROMPT, build_step_inputs


def test_step_inputs_place_each_sequences_rows_and_its_sample():
    """Rows carry their tokens, roles, slots and next tokens in order; the sampled rows are each sequence's last
    (for those that sample), with the slot's parameters at the position after it; pads are inert."""
    table = SamplingTable(5, scratch_slot=4, eos_token_id=1)
    hot = SamplingParams(temperature=0.7, seed=3)
    table.set(1, hot, 3, 2)
    inputs = build_step_inputs([2, 1, 0], [1, 3, 2], [-1, 5, 6, 7, 8, 9], [FED_BACK, PROMPT, PROMPT, GENERATED,
                                                                          PROMPT, PROMPT],
                               [-1, 6, 7, -1, 9, 10], [False, True, False], [True, True, False],
                               context_lens=[12, 3, 5], rows=8, seqs=4, table=table)
    np.testing.assert_array_equal(inputs.tokens, [-1, 5, 6, 7, 8, 9, 0, 0])
    np.testing.assert_array_equal(inputs.roles, [FED_BACK, PROMPT, PROMPT, GENERATED, PROMPT, PROMPT, PAD, PAD])
    np.testing.assert_array_equal(inputs.row_slots, [2, 1, 1, 1, 0, 0, 4, 4])
    np.testing.assert_array_equal(inputs.next_tokens, [-1, 6, 7, -1, 9, 10, -1, -1])
    # Sequence 1's rows are positions 0-2; sequence 2's are 3-4.
    np.testing.assert_array_equal(inputs.is_position_zero, [0, 1, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(inputs.fresh_slots, [1, 5, 5, 5])  # pads name no slot
    np.testing.assert_array_equal(inputs.sample_rows, [0, 3, 8, 8])  # pads: one past the rows
    np.testing.assert_array_equal(inputs.sampling.slots, [2, 1, 4, 4])
    np.testing.assert_array_equal(inputs.sampling.positions, [12, 3, 0, 0])
    np.testing.assert_array_equal(inputs.sampling.temperature, np.float32([0.0, 0.7, 0.0, 0.0]))
    with pytest.raises(ValueError, match="do not fit"):
        build_step_inputs([0], [3], [1, 2], [PROMPT] * 2, [-1] * 2, [True], [True], context_lens=[3], rows=4,
                          seqs=1, table=table)
