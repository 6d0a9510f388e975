"""Dense MLA under DCP (`attention/dense_dcp.py`, DeepSeek-V3's attention variant), through the runner: prefill logits
at every position (one-shot and chunked), then decode steps, equal at every DCP size and interleave to DCP 1's,
with two-batch overlap, and with the Pallas kernels (interpreted) as with the references; prompts shorter than a
virtual block leave ranks holding none of a row's tokens. f32 at the highest matmul precision (atol 1e-5; the
HF oracle of this architecture is `tests/model/test_deepseek_v3_oracle.py`)."""

import dataclasses

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from dcp_jax.config import TINY_MLA, EngineConfig, ParallelConfig
from dcp_jax.host.sampling import SamplingParams
from dcp_jax.model import architecture
from dcp_jax.model.architecture import config_from_hf
from dcp_jax.model.attention.dense_dcp import DENSE_MLA
from dcp_jax.model.attention.variant import CacheFormats
from dcp_jax.model.deepseek_v32 import init_mtp_params, init_params
from dcp_jax.model.mesh import make_mesh
from dcp_jax.model.weights import load_hf_params, save_hf
from dcp_jax.runtime.runner import ModelRunner
from dcp_jax.runtime import oracle
from dcp_jax.serving.llm import LLM

ENGINE = EngineConfig(page_size=4, num_pages=64, max_num_seqs=4, max_model_len=48, bucket_ladder=(3, 4),
                      max_num_batched_tokens=32)
# 3 tokens: fewer than a virtual block at DCP 2 and more (ranks with none of them at S = 4); 9 and 23 cross pages.
PROMPTS = [np.random.default_rng(i).integers(2, TINY_MLA.vocab_size, n).tolist() for i, n in enumerate([3, 9, 23])]
DECODES = 3


def outputs(dcp: int, interleave: int, *, kernels: str = "reference", enable_tbo: bool = False,
            chunk_size: int | None = None, latent_cache: str = "exact", cfg=TINY_MLA, params=None):
    """Prefill PROMPTS (chunks of `chunk_size`), then DECODES greedy decode steps of all of them: (prefill logits at
    every position, then each decode step's logits and tokens), host arrays."""
    parallel = ParallelConfig(tp=dcp, dcp=dcp, interleave=interleave)
    engine = dataclasses.replace(ENGINE, latent_cache=latent_cache)
    params = init_params(cfg, seed=4) if params is None else params
    runner = ModelRunner(cfg, params, parallel, engine, make_mesh(parallel), kernels, enable_tbo=enable_tbo)
    blocks = ENGINE.max_blocks_per_seq(dcp)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(PROMPTS))]
    logits, _, tokens = oracle.prefill(runner, PROMPTS, tables, chunk_size=chunk_size, all_logits=True)
    out = [logits]
    lens = [len(p) + 1 for p in PROMPTS]
    for _ in range(DECODES):
        step_logits, _, tokens = oracle.decode(runner, tokens, lens, tables)
        out += [step_logits, tokens]
        lens = [n + 1 for n in lens]
    return out


@pytest.fixture(scope="module")
def unsharded():
    return outputs(1, 1)


def assert_same(got, want):
    for a, b in zip(got, want, strict=True):
        if a.dtype.kind == "f":
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, equal_nan=True)
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dcp, interleave, kernels, enable_tbo, chunk_size", [
    pytest.param(2, 1, "reference", False, 5, marks=pytest.mark.slow),
    pytest.param(4, 2, "reference", False, None, marks=pytest.mark.slow),
    (8, 1, "reference", True, 7),
    # The Pallas kernels on the dense variant run every suite in the V3 oracle test (v3_kimi) against HF.
    pytest.param(2, 2, "pallas", False, 6, marks=pytest.mark.slow),
    pytest.param(2, 1, "pallas", True, None, marks=pytest.mark.slow),
    pytest.param(8, 2, "reference", False, 6, marks=pytest.mark.slow),
])
def test_every_dcp_size_equals_one_device(unsharded, dcp, interleave, kernels, enable_tbo, chunk_size):
    assert_same(outputs(dcp, interleave, kernels=kernels, enable_tbo=enable_tbo, chunk_size=chunk_size), unsharded)


@pytest.mark.slow  # the kernel's fp8 path: tests/kernels/test_mla_decode.py; the format's plumbing: the sparse tests
def test_the_fp8_latent_cache_by_the_kernel_equals_its_reference():
    """The fp8 latent cache (FlashMLA's 656-byte format) at DCP 2: the Pallas kernel (interpreted; it rounds the
    queries to bf16 where it multiplies) against the reference's f32 math on the same cache: logits within 2e-2."""
    got = outputs(2, 1, kernels="pallas", latent_cache="fp8", chunk_size=6)
    want = outputs(2, 1, latent_cache="fp8", chunk_size=6)
    logits = [(a, b) for a, b in zip(got, want, strict=True) if a.dtype.kind == "f"]  # tokens may part at near ties
    assert len(logits) == 1 + DECODES
    for a, b in logits:
        np.testing.assert_allclose(a, b, atol=2e-2, rtol=0, equal_nan=True)


def test_without_a_low_rank_query(tmp_path):
    """q_lora_rank null (HF's q_proj, as Moonlight's config.json has it): the weights go to HF's names and back, and
    DCP 2 equals one device."""
    cfg = dataclasses.replace(TINY_MLA, q_lora_rank=None)
    params = init_params(cfg, seed=4)
    save_hf(cfg, params, tmp_path)
    assert "model.layers.0.self_attn.q_proj.weight" in load_file(tmp_path / "model.safetensors")
    loaded = config_from_hf(tmp_path)
    assert loaded.q_lora_rank is None
    reloaded = load_hf_params(loaded, tmp_path)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reloaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_same(outputs(2, 1, cfg=cfg, params=reloaded, chunk_size=6), outputs(1, 1, cfg=cfg, params=reloaded))


def test_the_architecture_caches_latents_only():
    """DeepseekV3ForCausalLM runs the dense variant, whose only pool is the latent: no index keys are stored."""
    assert architecture.of(TINY_MLA).attention is DENSE_MLA
    assert [pool.name for pool in DENSE_MLA.cache_pools(TINY_MLA, CacheFormats())] == ["latent"]


def _llm(model="tiny-mla", **kwargs):
    return LLM(model, max_model_len=64, max_num_seqs=4, page_size=4, dtype="float32", kernels="reference",
               **kwargs)


def _token_ids(llm, prompts):
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompt_token_ids=prompts, sampling_params=greedy)]


def test_mtp_drafts_and_prefix_hits_keep_greedy_decoding(tmp_path):
    """A DeepseekV3ForCausalLM checkpoint with its MTP layer (HF layer num_hidden_layers): the layer drafting 3
    tokens (verify rows causal on global positions, built on the host) and prompts served from the prefix cache
    give plain decoding's greedy tokens, at DCP 2 with interleave 2; every page comes back."""
    save_hf(TINY_MLA, init_params(TINY_MLA, seed=0), tmp_path, mtp=init_mtp_params(TINY_MLA, seed=1))
    prompts = [np.random.default_rng(7).integers(2, TINY_MLA.vocab_size, n).tolist() for n in (5, 23, 40)]
    shared = prompts[2][:32] + [3, 4]  # 32 tokens (whole virtual blocks) cached by the 40-token prompt
    want = _token_ids(_llm(str(tmp_path), dcp=2, interleave=2), [*prompts, shared])
    drafted = _llm(str(tmp_path), dcp=2, interleave=2, enable_prefix_caching=True,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    assert _token_ids(drafted, prompts) == want[:3]
    hits = drafted.core.metrics.value("dcp_jax_prefix_cache_hits_total")
    assert _token_ids(drafted, [shared]) == want[3:]
    assert drafted.core.metrics.value("dcp_jax_prefix_cache_hits_total") > hits
    assert drafted.num_free_pages == drafted.engine_config.num_pages
