"""dcp_jax/config.py: the step programs' buckets."""

import pytest

from dcp_jax.config import EngineConfig


def test_buckets_are_the_capped_ladder_then_chunk_widths_up_to_the_budget():
    assert EngineConfig(max_num_seqs=8, max_num_batched_tokens=8).buckets == (1, 2, 4, 8)
    assert EngineConfig(max_num_seqs=6, max_num_batched_tokens=6).buckets == (1, 2, 4, 6)
    assert EngineConfig(max_num_seqs=6, max_num_batched_tokens=40).buckets == (1, 2, 4, 6, 8, 16, 32, 40)
    assert EngineConfig(max_num_seqs=300, max_num_batched_tokens=512).buckets == (1, 2, 4, 8, 16, 32, 64, 128, 256,
                                                                                  300, 512)
    engine = EngineConfig(max_num_seqs=6, max_num_batched_tokens=40)
    assert engine.bucket_for(3) == 4 and engine.bucket_for(7) == 8 and engine.bucket_for(33) == 40
    assert engine.seqs_for(4) == 4 and engine.seqs_for(32) == 6
    with pytest.raises(ValueError):
        engine.bucket_for(41)
    with pytest.raises(ValueError, match="bucket_ladder"):
        EngineConfig(bucket_ladder=(4, 2))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=4)
