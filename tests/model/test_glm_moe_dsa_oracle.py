"""The whole model equals HF transformers' GlmMoeDsaForCausalLM (GLM-5 / 5.1 / 5.2): golden fixtures of
`tests/oracle/` (`glm5.npz`: every layer runs its indexer; `glm52_index_share.npz`: IndexShare, layers 1 and 3
shared), recorded by HF in fp32 on CPU (eager attention, DynamicCache decode).

The checkpoint HF read is rebuilt from its seed (numpy only; the sha256 proves the bytes are the same), read with
`config_from_hf` (GLM's RoPE interleaved in the indexer, its `index_topk_freq` / `index_skip_topk_offset` schedule),
loaded through `load_hf_params` (shared layers have no indexer tensors) and run through `runtime/runner.py` in fp32
with `jax_default_matmul_precision="highest"` (conftest.py) at DCP 1, 2, 4 and 8, interleave 1 and 2: four prompts
of 9, 16, 23 and 40 tokens (index_topk 16) on non-contiguous pages, prefilled in one step or in chunks of 5, 6 or 7
tokens, then 9 decode steps fed HF's greedy tokens. Tolerance: log-softmax within 2e-3 (absolute) of HF's at every
prompt position and decode step, greedy tokens equal, and every layer's selected set equal to HF's (a shared layer's
is the full layer's before it) on rows whose top-k boundary is not tie-fragile (the fixtures' seeds keep every
boundary's relative gap >= 3e-4 and every greedy margin >= 1e-3, tests/oracle/README.md).
"""

import json

import numpy as np
import pytest

from dcp_jax.config import EngineConfig
from dcp_jax.model.architecture import config_from_hf

from tests.oracle import golden, hf_tiny

TOL = 2e-3  # log-softmax agreement (fp32, highest matmul precision), as for DeepSeek-V3.2
MIN_REL_GAP = 3e-4  # rows with a closer top-k boundary are tie-fragile (none in these fixtures)
ENGINE = EngineConfig(page_size=4, num_pages=96, max_num_seqs=4, max_model_len=64, bucket_ladder=(4,),
                      max_num_batched_tokens=64)
ONE_SHOT = 64  # the longest prompt in one step

NAMES = ("glm5", "glm52_index_share")
# (config, dcp, interleave, kernels, prefill chunk): IndexShare at every DCP size and both interleaves, GLM-5 at a
# sharded size; the Pallas kernels (interpreted) on IndexShare. The slow ones (`-m slow`) repeat a configuration at
# another DCP size or with the other prefill.
CASES = [
    ("glm52_index_share", 1, 1, "reference", 5),
    ("glm52_index_share", 2, 2, "reference", 6),
    ("glm52_index_share", 8, 1, "reference", 7),
    ("glm5", 4, 2, "reference", ONE_SHOT),
    # IndexShare under the Pallas kernels runs every suite in test_glm_mxfp4.py (with MXFP4 experts).
    pytest.param(*("glm52_index_share", 2, 1, "pallas", 7), marks=pytest.mark.slow),
    pytest.param(*("glm52_index_share", 4, 1, "reference", ONE_SHOT), marks=pytest.mark.slow),
    pytest.param(*("glm52_index_share", 4, 2, "reference", 5), marks=pytest.mark.slow),
    pytest.param(*("glm5", 1, 1, "reference", 6), marks=pytest.mark.slow),
    pytest.param(*("glm5", 2, 1, "reference", 7), marks=pytest.mark.slow),
    pytest.param(*("glm5", 8, 2, "reference", 5), marks=pytest.mark.slow),
    pytest.param(*("glm5", 2, 2, "pallas", ONE_SHOT), marks=pytest.mark.slow),
]
CASE_IDS = golden.case_ids(CASES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return golden.write_checkpoints(tmp_path_factory, NAMES)


def run_case(checkpoints, name, dcp, interleave, kernels, chunk):
    return golden.run_case(checkpoints[name][0], name, ENGINE, dcp, interleave, kernels, chunk, selected=True)


def test_checkpoint_is_the_one_hf_read(checkpoints):
    for name, (path, sha) in checkpoints.items():
        fx = golden.fixture(name)
        assert sha == str(fx["checkpoint_sha256"])
        assert json.loads((path / "config.json").read_text()) == json.loads(str(fx["config_json"]))
        assert str(fx["hf_class"]).endswith("GlmMoeDsaForCausalLM")


@pytest.mark.parametrize("name", NAMES)
def test_config_reads_glms_indexer_and_hf_constants(checkpoints, name):
    """config.json reads as GLM's DSA: RoPE interleaved in the indexer, the layer kinds HF derived (recorded in the
    fixture), one expert group, rms eps 1e-5, HF's rope frequencies and softmax scale; the shared layers' tensors
    have no indexer."""
    fx = golden.fixture(name)
    path = checkpoints[name][0]
    cfg = config_from_hf(path)
    assert cfg.architecture == "GlmMoeDsaForCausalLM" and cfg.indexer.rope_interleave
    types = [str(t) for t in fx["indexer_types"]]
    assert [("shared" if cfg.shares_index_selection(i) else "full") for i in range(cfg.num_hidden_layers)] == types
    assert (cfg.n_group, cfg.topk_group, cfg.rms_norm_eps) == (1, 1, 1e-5)
    golden.assert_rope_constants(fx, cfg)
    names = set(hf_tiny.read_safetensors(path / "model.safetensors"))
    for layer, kind in enumerate(types):
        has_indexer = any(n.startswith(f"model.layers.{layer}.self_attn.indexer.") for n in names)
        assert has_indexer == (kind == "full")


def test_index_share_fixture_has_shared_layers():
    assert [str(t) for t in golden.fixture("glm52_index_share")["indexer_types"]] == [
        "full", "shared", "full", "shared", "full"]


@pytest.mark.parametrize("name, dcp, interleave, kernels, chunk", CASES, ids=CASE_IDS)
def test_prefill_logits_equal_hf(checkpoints, name, dcp, interleave, kernels, chunk):
    result = run_case(checkpoints, name, dcp, interleave, kernels, chunk)
    golden.assert_prefill_equal(golden.fixture(name), result["prefill_logits"], TOL)


@pytest.mark.parametrize("name, dcp, interleave, kernels, chunk", CASES, ids=CASE_IDS)
def test_greedy_decode_equals_hf(checkpoints, name, dcp, interleave, kernels, chunk):
    result = run_case(checkpoints, name, dcp, interleave, kernels, chunk)
    golden.assert_greedy_equal(golden.fixture(name), result, TOL)


@pytest.mark.parametrize("name, dcp, interleave, kernels, chunk", CASES, ids=CASE_IDS)
def test_every_layers_selection_equals_hf(checkpoints, name, dcp, interleave, kernels, chunk):
    """Per layer and row, the set attended equals HF's: a full layer's own top-k, a shared layer's the full layer's
    before it (prefill rows and decode steps)."""
    fx = golden.fixture(name)
    result = run_case(checkpoints, name, dcp, interleave, kernels, chunk)
    lmax = fx["prefill_topk"].shape[2]
    prefill = np.moveaxis(result["prefill_selected"][:, :, :lmax], 0, 1)  # [P, layers, Lmax, K]
    compared, bad = golden.mismatching_sets(prefill, fx["prefill_topk"], fx["prefill_topk_rel_gap"], MIN_REL_GAP)
    assert compared == int(fx["prompt_lens"].sum()) * prefill.shape[1]
    assert not bad, f"prefill sets differ: {bad[:5]}"
    decode = np.moveaxis(np.stack(result["decode_selected"], axis=2), 0, 1)  # [P, layers, N-1, K]
    compared, bad = golden.mismatching_sets(decode, fx["decode_topk"], fx["decode_topk_rel_gap"], MIN_REL_GAP)
    assert compared == decode.shape[0] * decode.shape[1] * decode.shape[2]
    assert not bad, f"decode sets differ: {bad[:5]}"
