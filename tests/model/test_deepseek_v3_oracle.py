"""The whole model equals HF transformers' DeepseekV3ForCausalLM (dense MLA, DeepSeek MoE, YaRN): golden fixtures of
`tests/oracle/` (`v3_*.npz`), recorded by HF in fp32 on CPU (eager attention, DynamicCache decode).

The checkpoint HF read is rebuilt here from its seed (numpy only; the sha256 proves the bytes are the same), read
with `config_from_hf`, loaded through `load_hf_params` and run through `runtime/runner.py` in fp32 with
`jax_default_matmul_precision="highest"` (conftest.py) at DCP 1, 2, 4 and 8, interleave 1 and 2: four prompts of
9, 16, 23 and 40 tokens on non-contiguous pages, prefilled in one step or in chunks of 5, 6 or 7 tokens (each chunk
attending to the cached prefix, chunks splitting virtual blocks of 4 x dcp tokens), then 9 decode steps fed HF's
greedy tokens. Tolerance: log-softmax within 2e-3 (absolute) of HF's at every prompt position and decode step,
greedy tokens equal (the fixtures' seeds keep every greedy top-1/top-2 margin >= 1e-3 and every MoE routing gap
>= 3e-4, tests/oracle/README.md). Configurations: default RoPE; YaRN with mscale != mscale_all_dim (both the cos/sin
factor and the softmax scale change); Kimi-K2's shape (model_type kimi_k2, one expert group, routed_scaling_factor
2.827, rope_theta 50000, YaRN factor 32 with beta_fast = beta_slow = 1); q_lora_rank null (HF's direct q_proj, as
Moonlight's) with YaRN factor 8 spelled without mscale, mscale_all_dim, beta_fast and beta_slow (cos/sin x
0.1 ln 8 + 1, softmax scale unchanged); the Pallas kernels (interpreted on CPU) instead of the references in two
cases.
"""

import json
import math

import pytest

from dcp_jax.config import EngineConfig
from dcp_jax.model.architecture import config_from_hf

from tests.oracle import golden, hf_tiny

TOL = 2e-3  # log-softmax agreement (fp32, highest matmul precision), as for DeepSeek-V3.2
ENGINE = EngineConfig(page_size=4, num_pages=64, max_num_seqs=4, max_model_len=64, bucket_ladder=(4,),
                      max_num_batched_tokens=64)
ONE_SHOT = 64  # the longest prompt in one step

NAMES = ("v3_default_rope", "v3_yarn_mscale", "v3_kimi", "v3_no_q_lora")
# (config, dcp, interleave, kernels, prefill chunk): every DCP size and both interleaves with default RoPE, each YaRN
# configuration at a sharded size with interleave 2, the Pallas kernels at DCP 2 (at tp 4 the tiny experts' 8
# intermediate columns per rank are below what the grouped matmul kernel takes, and the engine refuses them); one-shot
# and chunked prefills. The slow ones (`-m slow`) repeat a configuration at another DCP size or with the other prefill.
CASES = [
    ("v3_default_rope", 1, 1, "reference", 5),
    pytest.param(*("v3_default_rope", 2, 2, "reference", ONE_SHOT), marks=pytest.mark.slow),
    ("v3_default_rope", 4, 1, "reference", 7),
    pytest.param(*("v3_default_rope", 8, 1, "reference", ONE_SHOT), marks=pytest.mark.slow),
    ("v3_yarn_mscale", 4, 2, "reference", 6),
    pytest.param(*("v3_kimi", 2, 2, "reference", 5), marks=pytest.mark.slow),
    ("v3_kimi", 2, 1, "pallas", 7),
    ("v3_no_q_lora", 2, 2, "reference", 6),
    pytest.param(*("v3_default_rope", 1, 1, "reference", ONE_SHOT), marks=pytest.mark.slow),
    pytest.param(*("v3_default_rope", 8, 2, "reference", 6), marks=pytest.mark.slow),
    pytest.param(*("v3_yarn_mscale", 1, 1, "reference", ONE_SHOT), marks=pytest.mark.slow),
    pytest.param(*("v3_yarn_mscale", 8, 1, "reference", 5), marks=pytest.mark.slow),
    pytest.param(*("v3_kimi", 1, 1, "reference", ONE_SHOT), marks=pytest.mark.slow),
    pytest.param(*("v3_kimi", 4, 2, "reference", 7), marks=pytest.mark.slow),
    pytest.param(*("v3_yarn_mscale", 2, 2, "pallas", ONE_SHOT), marks=pytest.mark.slow),
    pytest.param(*("v3_no_q_lora", 1, 1, "reference", ONE_SHOT), marks=pytest.mark.slow),
]
CASE_IDS = golden.case_ids(CASES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return golden.write_checkpoints(tmp_path_factory, NAMES)


def run_case(checkpoints, name, dcp, interleave, kernels, chunk):
    return golden.run_case(checkpoints[name][0], name, ENGINE, dcp, interleave, kernels, chunk)


def test_checkpoint_is_the_one_hf_read(checkpoints):
    for name, (path, sha) in checkpoints.items():
        fx = golden.fixture(name)
        assert sha == str(fx["checkpoint_sha256"])
        assert json.loads((path / "config.json").read_text()) == json.loads(str(fx["config_json"]))
        assert str(fx["hf_class"]) == "transformers.models.deepseek_v3.DeepseekV3ForCausalLM"


@pytest.mark.parametrize("name", NAMES)
def test_config_matches_hf_constants(checkpoints, name):
    """config.json reads as a dense DeepseekV3 model (no indexer), with HF's rope frequencies, cos/sin factor and
    softmax scale (YaRN: legacy `rope_scaling` spelling, mscale != mscale_all_dim, beta_fast = beta_slow)."""
    fx = golden.fixture(name)
    cfg = config_from_hf(checkpoints[name][0])
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.indexer is None
    assert cfg.q_lora_rank == json.loads(str(fx["config_json"]))["q_lora_rank"]  # null: v3_no_q_lora
    assert bool(fx["hf_rope_interleave"])  # HF's default when config.json leaves rope_interleave out
    golden.assert_rope_constants(fx, cfg)


@pytest.mark.parametrize("name, dcp, interleave, kernels, chunk", CASES, ids=CASE_IDS)
def test_prefill_logits_equal_hf(checkpoints, name, dcp, interleave, kernels, chunk):
    result = run_case(checkpoints, name, dcp, interleave, kernels, chunk)
    golden.assert_prefill_equal(golden.fixture(name), result["prefill_logits"], TOL)


@pytest.mark.parametrize("name, dcp, interleave, kernels, chunk", CASES, ids=CASE_IDS)
def test_greedy_decode_equals_hf(checkpoints, name, dcp, interleave, kernels, chunk):
    """The first token from the prefill, then 9 sharded decode steps: tokens equal (the argmax of our logits and
    the device sampler's greedy token), logprobs within 2e-3."""
    result = run_case(checkpoints, name, dcp, interleave, kernels, chunk)
    golden.assert_greedy_equal(golden.fixture(name), result, TOL)


def test_yarn_without_mscale_keys_is_hf_rule(checkpoints):
    """v3_no_q_lora's rope_scaling has no mscale / mscale_all_dim: HF scales cos/sin by 0.1 ln(factor) + 1 and leaves
    the softmax scale at qk_head_dim^-0.5 (the fixture's recorded constants), and the checkpoint HF read has q_proj
    in place of q_a_proj, q_a_layernorm and q_b_proj."""
    fx = golden.fixture("v3_no_q_lora")
    rope_scaling = json.loads(str(fx["config_json"]))["rope_scaling"]
    assert not {"mscale", "mscale_all_dim"} & set(rope_scaling) and rope_scaling["factor"] == 8
    assert float(fx["hf_rope_attention_scaling"]) == pytest.approx(0.1 * math.log(8) + 1, rel=1e-12)
    assert float(fx["hf_softmax_scale"]) == pytest.approx(48**-0.5, rel=1e-12)
    names = set(hf_tiny.read_safetensors(checkpoints["v3_no_q_lora"][0] / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight" in names and not any(".q_a_" in n or ".q_b_" in n for n in names)
