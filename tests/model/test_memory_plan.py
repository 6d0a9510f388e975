"""The memory plan (`dcp_jax/model/memory_plan.py`, `dcp-jax plan`): its weight bytes per rank are what placing the
weights puts on a device, its cache bytes what the pools hold, and the CLI prints it or refuses bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dcp_jax import cli
from dcp_jax.config import DEEPSEEK_V32, TINY, EngineConfig, ParallelConfig
from dcp_jax.model.deepseek_v32 import abstract_model, init_params, param_specs
from dcp_jax.model.attention.variant import CacheFormats
from dcp_jax.model.kv_cache import allocate_kv_cache
from tests.kv_pools import bytes_per_rank as kv_bytes_per_rank
from dcp_jax.model.memory_plan import (BLOCK_FP8_LEAVES, kv_bytes_per_token, make_plan, pool_pages,
                                       weight_bytes_per_rank)
from dcp_jax.model.mesh import make_mesh, sharding


@pytest.mark.parametrize("tp,dcp,expert_parallel", [(1, 1, False), (2, 2, False), (4, 2, True), (8, 4, False),
                                                    (8, 4, True)])
def test_weight_bytes_per_rank_are_those_placed_on_a_device(tp, dcp, expert_parallel):
    parallel = ParallelConfig(tp=tp, dcp=dcp, enable_expert_parallel=expert_parallel)
    mesh = make_mesh(parallel)
    abstract = nnx.to_pure_dict(abstract_model(TINY, jnp.bfloat16)[1])
    specs = param_specs(TINY, abstract, expert_parallel=expert_parallel)
    placed = jax.device_put(init_params(TINY, 0, jnp.bfloat16), jax.tree.map(lambda s: sharding(mesh, s), specs))
    on_device_0 = sum(shard.data.nbytes for leaf in jax.tree.leaves(placed) for shard in leaf.addressable_shards
                      if shard.device == mesh.devices.flat[0])
    assert weight_bytes_per_rank(abstract, specs, parallel, "model_dtype") == on_device_0


def test_fp8_weights_take_a_byte_and_a_scale_per_block_for_the_linear_layers_only():
    abstract = nnx.to_pure_dict(abstract_model(TINY, jnp.bfloat16)[1])
    specs = param_specs(TINY, abstract, expert_parallel=False)
    one = ParallelConfig()
    fp8 = weight_bytes_per_rank(abstract, specs, one, "fp8")
    leaves = jax.tree_util.tree_leaves_with_path(abstract)
    linear = sum(np.prod(leaf.shape) for path, leaf in leaves if path[-1].key in BLOCK_FP8_LEAVES)
    rest = sum(leaf.size * leaf.dtype.itemsize for path, leaf in leaves if path[-1].key not in BLOCK_FP8_LEAVES)
    assert fp8 == int(linear * (1 + 4 / 128**2) + rest)
    assert {"lm_head", "embed", "router", "index_weights"}.isdisjoint(BLOCK_FP8_LEAVES)
    with pytest.raises(ValueError, match="weight_format"):
        weight_bytes_per_rank(abstract, specs, one, "int4")


@pytest.mark.parametrize("tp,expert_parallel", [(2, False), (4, True)])
def test_mxfp4_weight_bytes_per_rank_are_those_placed_on_a_device(tp, expert_parallel):
    """The "mxfp4" plan of the plain model equals the bytes a device holds of the model whose routed experts are
    `mxfp4.Mxfp4Experts` (codes and scales, placed by their own specs); the rest in bf16. Experts 64 wide, so tp 2
    leaves down_proj 32 inputs (one scale block) a rank."""
    from dcp_jax.model import mxfp4
    from pallas_kernels.formats import quantize_mxfp4

    cfg = dataclasses.replace(TINY, moe_intermediate_size=64)
    parallel = ParallelConfig(tp=tp, dcp=2, enable_expert_parallel=expert_parallel)
    mesh = make_mesh(parallel)
    abstract = nnx.to_pure_dict(abstract_model(cfg, jnp.bfloat16)[1])
    specs = param_specs(cfg, abstract, expert_parallel=expert_parallel)

    def kept(path, x):
        if path[-1].key not in mxfp4.EXPERT_LEAVES:
            return x
        return mxfp4.from_checkpoint(*quantize_mxfp4(np.swapaxes(np.asarray(x, np.float32), -1, -2)),
                                     mxfp4.ExpertsFormat())

    params = jax.tree_util.tree_map_with_path(kept, init_params(cfg, 0, jnp.bfloat16))
    mxfp4_abstract = mxfp4.with_mxfp4_experts(abstract, mxfp4.ExpertsFormat())
    placed = jax.device_put(params, jax.tree.map(lambda s: sharding(mesh, s),
                                                 param_specs(cfg, mxfp4_abstract, expert_parallel=expert_parallel)))
    on_device_0 = sum(shard.data.nbytes for leaf in jax.tree.leaves(placed) for shard in leaf.addressable_shards
                      if shard.device == mesh.devices.flat[0])
    assert weight_bytes_per_rank(abstract, specs, parallel, "mxfp4") == on_device_0
    assert on_device_0 < weight_bytes_per_rank(abstract, specs, parallel, "model_dtype")


def test_ptpc_weight_bytes_per_rank_are_those_placed_on_a_device(tp=4, dcp=2):
    """`--quantization ptpc_fp8` on tiny-glm's first two layers (a dense full layer, an MoE shared one with a shared
    expert): a byte a quantized weight and a scale an output channel, as the quantized model placed by its own specs
    puts them on a device (row-parallel leaves keep every channel's scale on each rank); experts and the rest in
    bf16. Block fp8 does not compose."""
    from dcp_jax.config import preset
    from dcp_jax.model import fp8_linear

    cfg = preset("tiny-glm", num_layers=2)
    parallel = ParallelConfig(tp=tp, dcp=dcp)
    mesh = make_mesh(parallel)
    abstract = nnx.to_pure_dict(abstract_model(cfg, jnp.bfloat16)[1])
    specs = param_specs(cfg, abstract, expert_parallel=False)
    quantized = fp8_linear.quantize_channels_params(init_params(cfg, 0, jnp.bfloat16))
    quantized_specs = param_specs(cfg, jax.eval_shape(lambda: quantized), expert_parallel=False)
    placed = jax.device_put(quantized, jax.tree.map(lambda s: sharding(mesh, s), quantized_specs))
    on_device_0 = sum(shard.data.nbytes for leaf in jax.tree.leaves(placed) for shard in leaf.addressable_shards
                      if shard.device == mesh.devices.flat[0])
    assert weight_bytes_per_rank(abstract, specs, parallel, "model_dtype", channel_fp8=True) == on_device_0
    with pytest.raises(ValueError, match="block fp8 already"):
        weight_bytes_per_rank(abstract, specs, parallel, "fp8", channel_fp8=True)


@pytest.mark.parametrize("latent,index", [("exact", "exact"), ("fp8", "fp8")])
def test_bytes_per_token_are_the_pools_bytes(latent, index):
    parallel = ParallelConfig(tp=2, dcp=2)
    engine = EngineConfig(page_size=4, num_pages=8, latent_cache=latent, index_cache=index)
    pools = kv_bytes_per_rank(allocate_kv_cache(TINY, engine, 2, make_mesh(parallel), jnp.bfloat16))
    per_token = kv_bytes_per_token(TINY, CacheFormats(latent, index), itemsize=2)
    tokens_per_rank = engine.num_pages * engine.page_size
    assert {"latent": pools["latent"] // tokens_per_rank, "index_k": pools["index_k"] // tokens_per_rank} == per_token


def test_pool_pages_leave_the_workspace_the_sampler_and_a_layer_free():
    cfg = dataclasses.replace(TINY, num_hidden_layers=4)
    per_token = sum(kv_bytes_per_token(cfg, CacheFormats(), itemsize=2).values())
    free = 10 * 2**20
    pages = pool_pages(free, cfg, CacheFormats(), page_size=16, itemsize=2, max_num_seqs=8)
    sampler = 9 * cfg.vocab_size * 5
    assert pages == int((0.9 * free - sampler) * 4 / 5 // (per_token * 16))
    assert pool_pages(1000, cfg, CacheFormats(), page_size=16, itemsize=2, max_num_seqs=8) <= 0


def test_deepseek_v32_in_fp8_on_eight_h200s_at_dcp_8():
    """The plan docs/performance.md records: fp8 weights fit with millions of tokens of context left."""
    plan = make_plan(DEEPSEEK_V32, ParallelConfig(tp=8, dcp=8), dtype="bfloat16", weight_format="fp8",
                     device_bytes=143771 * 2**20, gpu_memory_utilization=0.9)
    assert 80 * 2**30 < plan.weight_bytes < 86 * 2**30  # 671B parameters in e4m3 over 8, embeddings in bf16
    assert plan.kv_bytes_per_token["fp8", "fp8"] == {"latent": 61 * 656, "index_k": 61 * 132}
    assert plan.pool_tokens["fp8", "fp8"] > 6_000_000
    bf16 = make_plan(DEEPSEEK_V32, ParallelConfig(tp=8, dcp=8), dtype="bfloat16", weight_format="model_dtype",
                     device_bytes=143771 * 2**20, gpu_memory_utilization=0.9)
    assert bf16.weight_bytes > 150 * 2**30 and set(bf16.pool_tokens.values()) == {0}  # bf16 does not fit


def test_drafting_with_the_mtp_layer_counts_its_weights_and_its_layer_of_kv(capsys):
    """speculative_config: the MTP layer's weights (a MoE decoder layer, split as the others) and a 62nd layer of
    KV a token; a model without an MTP layer is refused."""
    kw = dict(dtype="bfloat16", weight_format="fp8", device_bytes=143771 * 2**20, gpu_memory_utilization=0.9)
    plain = make_plan(DEEPSEEK_V32, ParallelConfig(tp=8, dcp=8), **kw)
    drafting = make_plan(DEEPSEEK_V32, ParallelConfig(tp=8, dcp=8), mtp=True, **kw)
    assert 1 * 2**30 < drafting.weight_bytes - plain.weight_bytes < 2 * 2**30  # ~11.5B parameters in e4m3 over 8
    assert drafting.kv_bytes_per_token["fp8", "fp8"] == {"latent": 62 * 656, "index_k": 62 * 132}
    assert 0 < drafting.pool_tokens["fp8", "fp8"] < plain.pool_tokens["fp8", "fp8"]
    with pytest.raises(ValueError, match="no MTP layer"):
        make_plan(dataclasses.replace(DEEPSEEK_V32, num_nextn_predict_layers=0), ParallelConfig(tp=8, dcp=8),
                  mtp=True, **kw)
    mtp = '{"method": "mtp", "num_speculative_tokens": 2}'
    assert cli.main(["plan", "--model", "deepseek-v3.2", "--tp", "8", "--dcp", "8", "--speculative-config", mtp]) == 0
    assert "with the MTP layer (drafting)" in capsys.readouterr().out


def test_plan_command_prints_the_plan_and_refuses_bad_input(capsys):
    assert cli.main(["plan", "--model", "deepseek-v3.2", "--tp", "8", "--dcp", "8", "--weight-format", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "weights per rank: 83." in out and "fp8/fp8" in out
    assert cli.main(["plan", "--model", "nope"]) == 2
    assert "neither a directory, a shipped checkpoint" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "tiny", "--tp", "3", "--dcp", "3"]) == 2
    assert "tp=3 must divide" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "tiny", "--gpu-memory-utilization", "1.5"]) == 2
    assert cli.main(["plan", "--model", "deepseek-v3.2", "--tp", "8", "--enable-expert-parallel"]) == 0
    assert "tp=8 (expert parallel)" in capsys.readouterr().out
