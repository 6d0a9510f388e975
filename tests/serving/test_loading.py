"""dcp_jax/serving/loading.py: max_model_len from the model, capped by the pool, and refused when it cannot fit."""

import json
import logging

import pytest

from dcp_jax.config import TINY
from dcp_jax.host.layout import DcpLayout
from dcp_jax.serving.engine_args import EngineArgs
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
    loaded = load_model(EngineArgs(model=str(tmp_path), dcp=2, page_size=4, max_num_seqs=2))
    assert loaded.engine.max_model_len == json.loads((tmp_path / "config.json").read_text())[
        "max_position_embeddings"] == 128
    assert loaded.engine.num_pages == 2 * 128 // 8  # two full-length requests


def test_presets_load_in_bfloat16_end_to_end_and_checkpoints_in_their_own_dtype(tmp_path):
    import jax
    import jax.numpy as jnp

    loaded = load_model(EngineArgs(model="tiny", dcp=2, page_size=4, max_num_seqs=2, max_model_len=32,
                                   kernels="reference"))
    assert loaded.dtype == "bfloat16"
    leaves = jax.tree_util.tree_leaves_with_path(loaded.runner.params)
    f32_kept = {"router", "router_bias", "index_weights"}  # HF keeps these in fp32
    for path, leaf in leaves:
        names = {getattr(k, "key", None) for k in path}
        assert leaf.dtype == (jnp.float32 if names & f32_kept else jnp.bfloat16), path
    kv = loaded.runner.kv_cache
    # The exact caches take the model dtype.
    assert kv.pools["latent"].dtype == kv.pools["index_k"].dtype == jnp.bfloat16
    config = hf_tiny.tiny_configs()["default_rope"]  # torch_dtype float32
    hf_tiny.write_random_checkpoint(config, 0, tmp_path)
    assert load_model(EngineArgs(model=str(tmp_path), page_size=4, max_num_seqs=1, max_model_len=32)).dtype == "float32"
    assert load_model(EngineArgs(model=str(tmp_path), page_size=4, max_num_seqs=1, max_model_len=32,
                                 dtype="bfloat16")).dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype='float16' must be one of"):
        load_model(EngineArgs(model="tiny", dtype="float16"))


class _FakeDevice:
    def __init__(self, limit, in_use):
        self.stats = dict(bytes_limit=limit, bytes_in_use=in_use)

    def memory_stats(self):
        return self.stats


def test_the_pool_takes_what_the_memory_leaves(monkeypatch):
    """gpu_memory_utilization of the whole memory (bytes_limit over JAX's allocator share), at most bytes_limit,
    less what is in use (the weights), a tenth for the workspace and the sampler state and one layer's pools, in
    pages of this model's per-token bytes; none on a device without memory statistics."""
    import jax

    from dcp_jax.model.attention.variant import CacheFormats
    from dcp_jax.serving.loading import MEM_FRACTION, pool_pages_from_memory

    kw = dict(dtype="bfloat16", max_num_seqs=4)
    per_token = TINY.num_hidden_layers * (TINY.latent_dim + TINY.indexer.head_dim) * 2  # bf16
    monkeypatch.setattr(jax, "local_devices", lambda *a: [_FakeDevice(limit=2**30, in_use=2**28)])
    monkeypatch.setenv(MEM_FRACTION, "0.75")  # the allocator holds 3/4 of a memory of 4/3 GiB
    layers = TINY.num_hidden_layers  # and one layer's pools besides the pool

    def expected_pages(budget):
        free = 0.9 * budget - 5 * TINY.vocab_size * 5
        return int(free * layers / (layers + 1) // (per_token * LAYOUT.page_size))

    pages = pool_pages_from_memory(TINY, LAYOUT, CacheFormats(), gpu_memory_utilization=0.5, **kw)
    assert pages == expected_pages(0.5 * 2**30 / 0.75 - 2**28)
    assert pool_pages_from_memory(TINY, LAYOUT, CacheFormats(), gpu_memory_utilization=0.9,
                                  **kw) == expected_pages(2**30 - 2**28)
    with pytest.raises(ValueError, match="no KV page fits"):
        pool_pages_from_memory(TINY, LAYOUT, CacheFormats(), gpu_memory_utilization=0.15, **kw)
    monkeypatch.setattr(jax, "local_devices", lambda *a: [type("Cpu", (), {"memory_stats": lambda self: None})()])
    assert pool_pages_from_memory(TINY, LAYOUT, CacheFormats(), gpu_memory_utilization=0.9, **kw) is None


def test_the_gpu_options_are_compile_options_whenever_jax_started(monkeypatch):
    """The scan's GPU options go to each compile of the step programs, not to XLA_FLAGS read when the backend starts:
    they hold in a process that started JAX before loading (this one); one set in XLA_FLAGS stays as the user set
    it; each is an option XLA knows (a CPU compile takes them, refusing unknown names)."""
    import jax
    import jax.numpy as jnp

    from dcp_jax.runtime.xla_flags import GPU_OPTIONS, step_compiler_options

    jax.devices()  # the backend starts
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert step_compiler_options() == GPU_OPTIONS
    assert float(jax.jit(lambda x: x @ x, compiler_options=step_compiler_options())(jnp.ones((2, 2)))[0, 0]) == 2
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert step_compiler_options() == {"xla_gpu_enable_dynamic_slice_fusion": True,
                                       "xla_disable_hlo_passes": "dot-merger"}


def test_hf_overrides_replace_config_fields_and_bad_ones_are_refused_before_loading():
    from dcp_jax.model.architecture import with_hf_overrides as apply_hf_overrides

    dense = apply_hf_overrides(TINY, {"index_topk": 4096, "rope_theta": 5e5})
    assert (dense.indexer.topk, dense.rope_theta, dense.hidden_size) == (4096, 5e5, TINY.hidden_size)
    assert apply_hf_overrides(TINY, {"rope_theta": 50000}).rope_theta == 50000  # an int where a float goes
    assert apply_hf_overrides(TINY, None) is TINY
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    for name in ("rope_scaling", "rope_parameters"):
        scaled = apply_hf_overrides(TINY, {name: yarn})
        assert scaled.rope["rope_type"] == "yarn" and scaled.rope["factor"] == 4.0 and scaled.rope_theta == 1e4
    loaded = load_model(EngineArgs(model="tiny", dcp=2, page_size=4, max_num_seqs=2, max_model_len=64,
                        hf_overrides={"index_topk": 64}))
    assert loaded.cfg.indexer.topk == 64 and loaded.runner.cfg.indexer.topk == 64
    for bad, message in (({"index_top_k": 8}, "unknown config fields \\['index_top_k'\\]"),
                         ({"index_topk": "8"}, "index_topk must be a int"), ([1], "must be a JSON object"),
                         ("", "must be a JSON object")):
        with pytest.raises(ValueError, match=message):
            load_model(EngineArgs(model="tiny", hf_overrides=bad))


def test_quantization_fp8_serves_a_preset_in_block_fp8_and_refuses_slices_of_partial_blocks():
    """A preset's random weights, its MTP layer's too, quantized to block fp8 on load; at tp 2 the tiny preset's
    head slices are not whole blocks of 128: refused, naming the leaf, before any weight is drawn."""
    from dcp_jax.config import ONLINE_FP8_BLOCK
    from dcp_jax.model import fp8_linear
    from dcp_jax.serving.llm import LLM

    kw = dict(max_model_len=64, max_num_seqs=2, page_size=4, dtype="float32", kernels="reference")
    llm = LLM("tiny", quantization="fp8", speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **kw)
    model, mtp = llm.runner.params
    assert fp8_linear.weight_block(model) == fp8_linear.weight_block(mtp) == ONLINE_FP8_BLOCK
    assert len(llm.generate(prompt_token_ids=[[5, 9, 17]])[0].outputs[0].token_ids) > 0
    with pytest.raises(ValueError, match="wq_b'\\]: a rank's output slice of 192 is not a whole number of fp8 blocks"):
        load_model(EngineArgs(model="tiny", dcp=2, quantization="fp8", **kw))


def test_quantization_fp8_loads_an_unquantized_checkpoint_in_block_fp8(tmp_path):
    """The checkpoint branch: an f32 checkpoint of the tiny preset served under "fp8" holds block-fp8 weights whose
    greedy tokens follow the f32 model's closely (fp8 weights and activations)."""
    from dcp_jax.config import ONLINE_FP8_BLOCK
    from dcp_jax.host.sampling import SamplingParams
    from dcp_jax.model import fp8_linear
    from dcp_jax.model.deepseek_v32 import init_params
    from dcp_jax.model.weights import save_hf
    from dcp_jax.serving.llm import LLM

    save_hf(TINY, init_params(TINY, seed=0), tmp_path)
    kw = dict(max_model_len=64, max_num_seqs=2, page_size=4, dtype="float32", kernels="reference")
    online = LLM(str(tmp_path), quantization="fp8", **kw)
    assert fp8_linear.weight_block(online.runner.params) == ONLINE_FP8_BLOCK
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    prompts = [[5, 9, 17, 3, 88], [300, 12, 6]]
    for got, want in zip(*(llm.generate(prompt_token_ids=prompts, sampling_params=params)
                           for llm in (online, LLM(str(tmp_path), **kw)))):
        assert got.outputs[0].token_ids[0] in want.outputs[0].logprobs[0]  # within the f32 model's top 5
