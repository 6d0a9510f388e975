"""dcp_jax/serving/loading.py: max_model_len from the model, capped by the pool, and refused when it cannot fit."""

import json
import logging

import pytest

from dcp_jax.config import TINY
from dcp_jax.host.layout import DcpLayout
from dcp_jax.serving.loading import load_model, resolve_max_model_len
from tests.oracle import hf_tiny

LAYOUT = DcpLayout(dcp_size=2, interleave=1, page_size=4)  # 8 tokens a page id


def test_the_default_is_the_models_max_position_embeddings():
    assert resolve_max_model_len(TINY, LAYOUT, None, None) == TINY.max_position_embeddings


def test_a_pool_too_small_for_the_model_caps_the_default_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="dcp_jax.serving.loading"):
        assert resolve_max_model_len(TINY, LAYOUT, None, num_pages=10) == 80
    assert "capped to 80" in caplog.text and "10 KV pages" in caplog.text


@pytest.mark.parametrize("max_model_len, num_pages, message", [
    (TINY.max_position_embeddings + 1, None, "exceeds the model's max_position_embeddings=4096"),
    (81, 10, "does not fit the KV pool: num_pages=10 pages of 8 tokens"),
    (0, None, "must be >= 1"),
])
def test_an_impossible_max_model_len_is_refused(max_model_len, num_pages, message):
    with pytest.raises(ValueError, match=message):
        resolve_max_model_len(TINY, LAYOUT, max_model_len, num_pages)


def test_a_checkpoint_with_a_short_context_loads_with_its_own_length(tmp_path):
    """A valid checkpoint whose max_position_embeddings is below the old fixed default of 512 loads, and serves
    that length (vLLM derives the default from the model too)."""
    config = hf_tiny.tiny_configs()["yarn"]  # max_position_embeddings 128
    hf_tiny.write_random_checkpoint(config, 0, tmp_path)
    loaded = load_model(str(tmp_path), dcp=2, page_size=4, max_num_seqs=2)
    assert loaded.engine.max_model_len == json.loads((tmp_path / "config.json").read_text())[
        "max_position_embeddings"] == 128
    assert loaded.engine.num_pages == 2 * 128 // 8  # two full-length requests
