"""bench/step_profile.py: the kernel categories of realistic GPU trace names, the per-step kernel time, the roofline
arithmetic against hand computations, and the step-efficiency table. `bench decode --profile` end to end is in
test_bench_decode.py's smoke run."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from bench import step_profile
from dcp_jax.config import TINY, preset
from dcp_jax.model import architecture, fp8_linear, mxfp4

# Names as H100 traces of the decode and prefill steps show them (docs/data/prefill/profile_32k_h100.jsonl), and the
# project's kernels by their pallas_call names (Mosaic: the body function + "_mosaic_gpu_kernel").
NAMES = {
    "nvjet_sm90_tst_320x128_64x3_2x1_v_ssched_bx_coopB_NNT": "GEMM",
    "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize32x32x8_stage3": "GEMM",
    "gemm_fusion_dot_12": "GEMM",
    "cutlass3x_sm90_tensorop_s64x128x16gemm_bf16_bf16_f32_bf16_bf16_128x128x64_1x1x1_0_tnn_align8": "GEMM",
    "sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_segment_k_off": "fp8 GEMM",
    "fp8_gemm_mosaic_mosaic_gpu_kernel": "fp8 GEMM",
    "grouped_matmul_fp8_block_m_16_block_n_128_block_k_128": "grouped MoE",
    "grouped_matmul_block_m_64_block_n_128_block_k_64": "grouped MoE",
    "indexer_logits_block_t_512_chunk_t_64": "indexer",
    "indexer_logits_mosaic_mosaic_gpu_kernel": "indexer",
    "topk_select_k_2048_groups_4096_tile_4096_capacity_4096_split": "top-k",
    "topk_maxima_k_2048_groups_4096_tile_4096_capacity_4096_split": "top-k",
    "entry_mosaic_gpu_kernel": "sparse MLA",
    "sparse_mla_decode_fp8_block_h_64_block_s_64_num_splits_4": "sparse MLA",
    "mla_decode_block_r=64_block_t=64_splits=1": "dense MLA",
    "merge_splits_num_splits_4_block_h_64_block_c_128": "merge",
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collectives",
    "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL": "collectives",
    "all-reduce-start": "collectives",
    "memcpy128": "copies",
    "memcpy32_post": "copies",
    "MemcpyD2D": "copies",
    "Memset 0": "copies",
    "input_concatenate_fusion": "other fusions",
    "loop_convert_fusion": "other fusions",
    "input_scatter_fusion_2": "other fusions",
    "wrapped_slice_4": "other fusions",
    "fusion_101": "other fusions",
    "sort_10_1": "sort",
    "sort_1_1__2": "sort",
    "void cub::CUB_200200_900_NS::DeviceSegmentedRadixSortKernel<cub::DeviceRadixSortPolicy>": "sort",
    "void cub::DeviceReduceSingleTileKernel<float>": "other",
}


@pytest.mark.parametrize("name", NAMES)
def test_realistic_kernel_names_fall_in_their_categories(name):
    assert step_profile.kernel_category(name) == NAMES[name]


def test_the_names_cover_every_category():
    assert {step_profile.kernel_category(n) for n in NAMES} == set(step_profile.CATEGORIES)


def test_kernel_time_is_per_step_and_rank_with_the_top_kernels():
    """Names are classified whole; the top list merges names equal in their first `NAME_CHARS` characters."""
    long = "x" * step_profile.NAME_CHARS
    durations = {"nvjet_a": [100.0] * 4, "gemm_fusion_dot": [20.0] * 4, "sort_10_1": [400.0] * 4,
                 "memcpy128": [8.0] * 4, long + "_memcpy": [30.0] * 4, long + "_sort": [200.0] * 4}
    categories, top = step_profile.kernel_time(durations, calls=2, ranks=2, top=2)
    assert categories == {"GEMM": 120.0, "copies": 38.0, "sort": 600.0}  # 2 steps x 2 ranks each
    assert list(categories) == ["GEMM", "copies", "sort"]  # CATEGORIES order, empty ones left out
    assert top == [("sort_10_1", 400.0), (long, 230.0)]


def test_weight_traffic_skips_the_embedding_and_touches_a_share_of_the_experts():
    """A hand-made pytree: bf16 wo [8, 16] (256 B, 128 elements), a block-fp8 [128, 256] weight (32768 B of e4m3
    values + 2 f32 scales), routed experts_up [4, 8, 2] bf16 (128 B, 64 elements) and MXFP4 experts_gate of 4 x
    [out 2, in 32] (128 B of codes, two a byte, + 8 B of scales: 256 elements), 1 of 4 experts a row; B = 2 rows
    touch 1 - (3/4)^2 = 7/16 of the experts and each multiplies 1/4 of their elements."""
    cfg = dataclasses.replace(TINY, n_routed_experts=4, num_experts_per_tok=1)
    params = {"embed": jnp.zeros((100, 8), jnp.bfloat16),
              "attention": {"wo": jnp.zeros((8, 16), jnp.bfloat16),
                            "w8": fp8_linear.quantize(jnp.ones((128, 256)), (128, 128), (0,), (1,))},
              "mlp": {"experts_up": jnp.zeros((4, 8, 2), jnp.bfloat16),
                      "experts_gate": mxfp4.from_checkpoint(jnp.zeros((4, 2, 16), jnp.uint8),
                                                            jnp.zeros((4, 2, 1), jnp.uint8), mxfp4.ExpertsFormat())}}
    assert step_profile.routed_expert_share(cfg, 2) == 7 / 16
    assert step_profile.weight_traffic(params, cfg, 2) == (256 + 32768 + 8 + (128 + 136) * 7 / 16,
                                                           128 + 32768 + (64 + 256) / 4)


def test_weight_traffic_of_the_tiny_model_matches_its_leaves():
    """The real parameter names: the embedding is left out and the routed experts scale with the batch."""
    cfg = preset("tiny")  # one dense layer, one MoE layer
    bf16 = architecture.of(cfg).model.init_params(cfg, 0, jnp.bfloat16)
    experts = [bf16["moe_layers"]["mlp"][f"experts_{n}"] for n in ("gate", "up", "down")]

    def rest(attribute):  # of every leaf but the embedding and the routed experts
        return sum(getattr(leaf, attribute) for leaf in jax.tree.leaves(bf16)) - getattr(bf16["embed"], attribute) \
            - sum(getattr(w, attribute) for w in experts)

    share = 1 - (1 - 2 / 8) ** 3  # 2 of 8 experts a row, 3 rows
    nbytes, elements = step_profile.weight_traffic(bf16, cfg, 3)
    assert nbytes == pytest.approx(rest("nbytes") + share * sum(w.nbytes for w in experts))
    assert elements == pytest.approx(rest("size") + 2 / 8 * sum(w.size for w in experts))


def test_roofline_terms_by_hand():
    """Tiny: 2 layers, H = 8, C = 128, E = 16, I = 8, J = 32, topk 16. B = 2, L = 64, W = 2: a rank holds 32 tokens
    of a row and attends 8 of its 16 selected ones."""
    cfg = preset("tiny")
    params = {"wo": jnp.zeros((8, 16), jnp.bfloat16)}  # 256 B, 128 elements
    r = step_profile.roofline(cfg, params, batch=2, context=64, dcp=2, latent_token_bytes=288, index_token_bytes=64,
                              copy_tbps=2.0, matmul_tflops=1.0)
    assert r.weight_bytes == 256 and r.gemm_flops == 2 * 2 * 128
    assert r.index_key_bytes == 2 * 2 * 32 * 64  # layers x B x tokens x bytes
    assert r.latent_bytes == 2 * 2 * 8 * 288
    assert r.indexer_flops == 2 * 2 * 2 * 32 * 8 * 32  # layers x 2 B tokens I J
    assert r.sparse_mla_flops == 2 * 2 * 2 * 8 * 8 * (128 + 16 + 128)  # layers x 2 B H K' (C + E + C)
    assert r.bytes_ms == pytest.approx((256 + 8192 + 9216) / 2e12 * 1e3)
    assert r.flops_ms == pytest.approx((512 + 65536 + 139264) / 1e12 * 1e3)
    assert r.ms == max(r.bytes_ms, r.flops_ms) == r.flops_ms
    assert r.as_row()["roofline_ms"] == r.ms
    short = step_profile.roofline(cfg, params, batch=2, context=8, dcp=1, latent_token_bytes=288,
                                  index_token_bytes=64, copy_tbps=2.0, matmul_tflops=1.0)
    assert short.latent_bytes == 2 * 2 * 8 * 288  # a row of 8 < topk tokens attends all 8


def test_the_dense_roofline_reads_every_latent_and_no_index_key():
    """tiny-mla (dense MLA): B = 2, L = 64, W = 2: a rank attends all 32 tokens it holds of a row, scores none."""
    params = {"wo": jnp.zeros((8, 16), jnp.bfloat16)}
    r = step_profile.roofline(preset("tiny-mla"), params, batch=2, context=64, dcp=2, latent_token_bytes=288,
                              index_token_bytes=0, copy_tbps=2.0, matmul_tflops=1.0)
    assert r.index_key_bytes == 0 and r.indexer_flops == 0
    assert r.latent_bytes == 2 * 2 * 32 * 288
    assert r.sparse_mla_flops == 2 * 2 * 2 * 8 * 32 * (128 + 16 + 128)


def test_the_table_names_each_config_and_its_top_categories():
    point = dict(kind="point", layers=4, moe_layers=1, weight_format="fp8", dtype="bfloat16", index_cache="fp8",
                 latent_cache="fp8", dcp=1, batch=64, context=4096, device_ms=3.0, roofline_ms=1.5, bytes_ms=1.5,
                 flops_ms=0.7, roofline_ratio=2.0, weight_bytes=4e9, index_key_bytes=1e8, latent_bytes=3e8,
                 copy_tbps=2.98, matmul_tflops=660.0, has_device_trace=True, kernel_busy_us=2500.0,
                 kernel_us={"GEMM": 1000.0, "sort": 900.0, "copies": 300.0, "indexer": 200.0, "merge": 100.0},
                 top_kernels=[["sort_10_1", 900.0], ["nvjet_a", 600.0]])
    text = step_profile.report([dict(kind="run"), point, dict(point, batch=1, has_device_trace=False)])
    assert ("| 4 layers (1 MoE), block-fp8 weights, fp8/fp8 index/latent cache, dcp 1 | 64 | 4K | 3.000 | 1.500 "
            "(1.500 / 0.700) | 2.00x | 4.00 + 0.10 + 0.30 | 2.98, 660 | busy 2500: GEMM 1000, sort 900, copies 300, "
            "indexer 200 |") in text
    assert "| 1 | 4K | 3.000 | 1.500 (1.500 / 0.700) | 2.00x | 4.00 + 0.10 + 0.30 | 2.98, 660 | no device trace |" \
        in text
    assert "B=64 L=4K: sort_10_1 900; nvjet_a 600" in text and "B=1 L=4K:" not in text
    assert step_profile.report([dict(kind="point")]) == ""
