"""The prefill benchmark (bench/bench_prefill.py, `dcp-jax bench prefill`) on simulated CPU devices: a tiny run end
to end through the CLI with fp8 caches (TTFT rows with their roofline, the mixed load's ITL rows), and the roofline's
FLOP count. No timing is asserted."""

import contextlib
import io
import json

import pytest

from bench.bench_prefill import prefill_flops
from dcp_jax import cli
from dcp_jax.config import DEEPSEEK_V32, preset


def test_prefill_bench_reports_ttft_against_its_roofline_and_the_mixed_load(tmp_path):
    out = tmp_path / "prefill.jsonl"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        rc = cli.main(["bench", "prefill", "--preset", "tiny", "--num-layers", "1", "--contexts", "40,70",
                       "--repeats", "1", "--max-num-batched-tokens", "32", "--buckets", "1,4", "--decodes", "2",
                       "--mixed-context", "150", "--itl-tokens", "5", "--dtype", "float32", "--kernels",
                       "reference", "--page-size", "4", "--matmul-size", "256", "--profile", "5",
                       "--index-cache", "fp8", "--latent-cache", "fp8", "--out", str(out)])
    assert rc == 0, stdout.getvalue()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["run", "ceiling", "ttft", "ttft", "profile", "mixed"]
    profile = rows[4]  # a traced TTFT of the last context; off the GPU the trace has no kernels
    assert profile["context"] == 70 and profile["ttft_ms"] > 0 and profile["kernels"] == []
    for row, context in zip(rows[2:4], (40, 70)):
        assert row["context"] == context and row["ttft_ms"] > 0 and row["roofline_ms"] > 0
        assert row["flops"] == prefill_flops(preset("tiny", num_layers=1), context)
        assert row["compiles_after_warmup"] == 0
        assert row["index_cache"] == row["latent_cache"] == "fp8"
    mixed = rows[5]
    assert mixed["context"] == 150 and mixed["budget"] == 32 and mixed["prefill_s"] > 0  # 5 steps or more
    assert mixed["itl_alone"]["n"] > 0 and mixed["itl_during_prefill"]["n"] > 0
    assert mixed["compiles_after_warmup"] == 0


def test_prefill_flops_count_each_part():
    """Dense: 2 FLOPs per weight per token; indexer: every causal pair; attention: min(K, position + 1) keys."""
    cfg = preset("deepseek-v3.2", num_layers=2)  # two dense-MLP layers
    one, two = prefill_flops(cfg, 1), prefill_flops(cfg, 2)
    assert two["dense"] == 2 * one["dense"]
    per_pair = 2 * cfg.indexer.heads * cfg.indexer.head_dim * 2
    assert one["indexer"] == per_pair and two["indexer"] == 3 * per_pair  # pairs (0,0), (1,0), (1,1)
    long = prefill_flops(cfg, cfg.indexer.topk + 10)
    per_key = 2 * cfg.num_attention_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    k = cfg.indexer.topk
    assert long["attention"] == per_key * (k * (k + 1) / 2 + 10 * k)  # past K, every query attends to K keys
    # A DeepSeek-V3.2 dense layer: ~600M weights applied per token.
    assert one["dense"] / 2 / 2 == pytest.approx(597e6, rel=0.02)
    assert DEEPSEEK_V32.is_moe_layer(3) and not cfg.is_moe_layer(1)
