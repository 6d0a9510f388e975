"""The decode benchmark (bench/bench_decode.py and bench/decode_results.py, `dcp-jax bench decode`) on simulated
CPU devices: a tiny grid end to end through the CLI, its asserted targets, and the stage-isolating variants
matching the real step.
No timing is asserted (benchmarks are scripts); the tests check what the script computes and reports."""

import contextlib
import dataclasses
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import bench_decode as decode_bench
from bench import decode_results as decode_bench_results
from dcp_jax import cli
from dcp_jax.config import ParallelConfig, preset
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.step_metadata import build_step_metadata
from dcp_jax.model import architecture
from dcp_jax.model.kv_cache import allocate_kv_cache
from dcp_jax.model.mesh import make_mesh
from dcp_jax.runtime.oracle import DETAILS
from dcp_jax.runtime.runner import state_allocator, step_context, step_program
from pallas_kernels import Fp8LatentCache

STAGED = [f"through_{s}" for s in decode_bench_results.STAGES[:-1]]  # through the last stage is the host step
# page 4, L = 64: 16 pages per row at DCP 1, 8 at DCP 2 (exactly half).
SMOKE = ["bench", "decode", "--preset", "tiny", "--num-layers", "1", "--dcp", "1,2,16", "--contexts", "64",
         "--batches", "2", "--breakdown-batches", "2", "--kernels", "reference", "--steps", "2", "--warmup", "1",
         "--page-size", "4", "--device-memory-gb", "0.05", "--img-dir", "none", "--tbo", "--profile",
         "--profile-steps", "2", "--copy-bytes", "1M", "--matmul-size", "128"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The tiny grid through the real `dcp-jax bench decode` entry point: (exit code, JSON rows, stdout)."""
    out = tmp_path_factory.mktemp("bench") / "decode.jsonl"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        rc = cli.main(SMOKE + ["--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return rc, rows, stdout.getvalue()


def test_the_grid_runs_and_meets_its_targets(smoke):
    rc, rows, text = smoke
    assert rc == 0, text
    assert rows[0]["kind"] == "run" and rows[0]["commit"] and rows[0]["device"]
    assert not [r for r in rows if r["kind"] in ("error", "skipped")]
    assert "dcp=16 skipped: 8 device(s)" in text
    points = {(r["dcp"], r["variant"]): r for r in rows if r["kind"] == "point"}
    assert set(points) == {(w, v) for w in (1, 2) for v in ["host", "tbo", "fallback"] + STAGED}
    for p in points.values():
        assert p["recompiles"] == 0 and p["steps"] == 2
        assert 0 < p["min_ms"] <= p["median_ms"] <= p["max_ms"]
        assert p["tokens_per_s"] == pytest.approx(2e3 / p["median_ms"])
        assert p["pipelined_ms"] > 0 and p["pipelined_tokens_per_s"] == pytest.approx(2e3 / p["pipelined_ms"])
        assert p["device_ms"] > 0
    assert "DCP scaling (host steps)" in text and "| reference | 2 | 2 | 64 | 0.50 |" in text
    assert "targets: zero length-derived ops in every host-length program, zero recompiles" in text
    assert "recompiles in every timed loop: MET" in text
    for header in ("| kernels | dcp | B | L | latency ms", "| rest | projections | indexer | topk | exchange",
                   "length-derived int ops host / fallback"):
        assert header in text


def test_profile_gives_each_host_step_its_roofline_and_no_device_trace_on_cpu(smoke):
    """`--profile` on CPU: each host point gets the roofline at the same-run rates and its ratio, and the trace
    has no GPU lines, so no kernel categories; the other variants get no profile."""
    _, rows, text = smoke
    points = [r for r in rows if r["kind"] == "point"]
    profiled = {r["dcp"]: r for r in points if "roofline_ms" in r}
    assert set(profiled) == {1, 2} and all(r["variant"] == "host" for r in profiled.values())
    weights = {r["dcp"]: r["weights_bytes_per_rank"] for r in rows if r["kind"] == "program" and r["variant"] == "host"}
    for w, r in profiled.items():
        assert r["copy_tbps"] > 0 and r["matmul_tflops"] > 0 and r["moe_layers"] == 0
        assert r["roofline_ms"] == max(r["bytes_ms"], r["flops_ms"]) > 0
        assert r["roofline_ratio"] == pytest.approx(r["device_ms"] / r["roofline_ms"])
        assert 0 < r["weight_bytes"] < weights[w]  # the embedding table is left out
        assert r["has_device_trace"] is False and "kernel_us" not in r
    # L = 64 over 2 ranks: half the index keys a rank reads; topk 16 of 64: half the selected latents
    assert 2 * profiled[2]["index_key_bytes"] == profiled[1]["index_key_bytes"]
    assert 2 * profiled[2]["latent_bytes"] == profiled[1]["latent_bytes"]
    assert text.count("| 1 layers (0 MoE), bf16 weights, exact/exact index/latent cache, dcp 1 | 2 | 64 |") == 2
    assert "no device trace |" in text  # the row as it came, and the report's table


def test_host_lengths_compile_no_fallback_ops_and_the_fallback_does(smoke):
    _, rows, _ = smoke
    programs = {(r["dcp"], r["variant"]): r for r in rows if r["kind"] == "program"}
    for w in (1, 2):
        host, fallback = programs[(w, "host")], programs[(w, "fallback")]
        assert host["length_derivations"] == 0
        assert fallback["length_derivations"] > 0
        assert {"div", "rem"} <= {name for name, _ in fallback["length_derivation_ops"]}
        assert fallback["hlo_int_arith_ops"] > host["hlo_int_arith_ops"]
        assert host["compile_s"] > 0 and host["temp_bytes"] is not None


def test_dcp_halves_per_rank_kv_and_doubles_capacity(smoke):
    _, rows, _ = smoke
    points = {r["dcp"]: r for r in rows if r["kind"] == "point" and r["variant"] == "host"}
    cfg = preset("tiny", num_layers=1)
    itemsize = 2  # bfloat16
    assert points[1]["kv_latent_bytes_per_rank"] == 2 * 64 * cfg.latent_dim * itemsize
    assert points[1]["kv_index_bytes_per_rank"] == 2 * 64 * cfg.indexer.head_dim * itemsize
    for key in ("kv_latent_bytes_per_rank", "kv_index_bytes_per_rank"):
        assert 2 * points[2][key] == points[1][key]
    programs = {r["dcp"]: r for r in rows if r["kind"] == "program" and r["variant"] == "host"}
    assert programs[1]["memory_source"] == "option"
    assert programs[2]["weights_bytes_per_rank"] < programs[1]["weights_bytes_per_rank"]  # heads split
    ratio = programs[2]["max_total_tokens"] / programs[1]["max_total_tokens"]
    assert 1.9 < ratio < 2.6, ratio
    assert programs[1]["max_context"] == programs[1]["max_total_tokens"] // 2


@pytest.mark.parametrize("index_cache", ["exact", "fp8"])
def test_the_staged_variant_of_the_whole_layer_is_the_real_step(index_cache):
    """Guards the breakdown against drift: the staged attention cut after its last stage (merge) must compute the
    real step exactly, so its truncations cut the real data flow (with either index cache, on a pool filled in its
    format); one stage earlier it differs."""
    cfg = preset("tiny", num_layers=1)
    parallel = ParallelConfig(tp=2, dcp=2, interleave=2)
    grid = decode_bench.Grid(preset="tiny", num_layers=1, dcp_sizes=(2,), contexts=(48,), batches=(4,),
                             page_size=4, interleave=2, dtype="float32", index_cache=index_cache)
    engine = grid.engine(2)
    mesh = make_mesh(parallel)
    params = architecture.of(cfg).model.init_params(cfg, 0)
    max_blocks = engine.max_blocks_per_seq(2)
    lens = [48, 5, 17, 30]
    tables = decode_bench.block_tables_for(4, 48, dcp=2, page_size=4, max_blocks=max_blocks)
    md = build_step_metadata(lens, [1] * 4, tables, rows=4, seqs=4, layout=DcpLayout(2, 2, 4), max_blocks=max_blocks)
    tokens = np.array([3, 7, 11, 500], np.int32)
    ctx = step_context(cfg, parallel, engine, "reference", dtype=jnp.float32)
    logits = {}
    for variant in ("host", "through_merge", "through_sparse_mla"):
        step = step_program(decode_bench.variant_context(ctx, variant), DETAILS, parallel, engine, mesh)
        placed = step.place_params(params)
        state = state_allocator(cfg, parallel, engine, mesh, jnp.float32)()
        state = dataclasses.replace(state, kv_cache=decode_bench.fill_random(state.kv_cache, jax.random.key(1)))
        index_k = state.kv_cache.pools["index_k"]
        assert index_k.scales.min() > 0 if index_cache == "fp8" else index_k.dtype == jax.numpy.float32
        step.compile(placed, state, 4)
        inputs = decode_bench.decode_inputs(tokens, lens, [0, 1, 2, 3], engine.max_num_seqs)
        (_, details), _ = step(placed, state, inputs, md)
        logits[variant] = np.asarray(details.logits)
    assert np.all(np.isfinite(logits["host"]))
    np.testing.assert_allclose(logits["through_merge"], logits["host"], rtol=1e-5, atol=1e-5)
    assert not np.allclose(logits["through_sparse_mla"], logits["host"], atol=1e-3)  # the attention is cut there


def test_fp8_index_cache_counts_index_head_dim_plus_4_bytes_a_token(smoke):
    _, rows, _ = smoke
    assert rows[0]["grid"]["index_cache"] == "exact"
    assert {r["index_cache"] for r in rows if r["kind"] in ("program", "point")} == {"exact"}
    cfg = preset("tiny", num_layers=1)
    used = {f: decode_bench.kv_bytes_used(cfg, batch=2, context=64, dcp=1, page_size=4, itemsize=2, index_cache=f,
                                          latent_cache="exact") for f in ("exact", "fp8")}
    assert used["fp8"] == (used["exact"][0], 2 * 64 * (cfg.indexer.head_dim + 4))
    capacity = {f: decode_bench.max_tokens(cfg, dcp=2, memory=2**30, weights=0, workspace=0, itemsize=2,
                                           index_cache=f, latent_cache="exact") for f in ("exact", "fp8")}
    assert capacity["fp8"] == 2 * 2**30 // (cfg.latent_dim * 2 + cfg.indexer.head_dim + 4)
    assert capacity["exact"] == 2 * 2**30 // ((cfg.latent_dim + cfg.indexer.head_dim) * 2)


def test_fp8_latent_cache_counts_its_bytes_and_fills_its_pool():
    """Latent bytes of the fp8 format (C e4m3 + 4 per 128-column scale + 2 per rope value) in the usage and
    capacity columns, and the random pool fill writes the format's own arrays."""
    cfg = preset("tiny", num_layers=1)
    latent_bytes = cfg.kv_lora_rank + 4 * (cfg.kv_lora_rank // 128) + 2 * cfg.qk_rope_head_dim
    used = decode_bench.kv_bytes_used(cfg, batch=2, context=64, dcp=1, page_size=4, itemsize=2, index_cache="fp8",
                                      latent_cache="fp8")
    assert used == (2 * 64 * latent_bytes, 2 * 64 * (cfg.indexer.head_dim + 4))
    capacity = decode_bench.max_tokens(cfg, dcp=2, memory=2**30, weights=0, workspace=0, itemsize=2,
                                       index_cache="fp8", latent_cache="fp8")
    assert capacity == 2 * 2**30 // (latent_bytes + cfg.indexer.head_dim + 4)
    grid = decode_bench.Grid(preset="tiny", num_layers=1, contexts=(64,), batches=(2,), page_size=4,
                             latent_cache="fp8", index_cache="fp8")
    cache = allocate_kv_cache(cfg, grid.engine(1), 1, make_mesh(ParallelConfig(tp=1, dcp=1)))
    filled = decode_bench.fill_random(cache, jax.random.key(0))
    pool = filled.pools["latent"]
    assert isinstance(pool, Fp8LatentCache) and pool.latent.dtype == jnp.float8_e4m3fn
    assert np.all(np.asarray(pool.scales) > 0) and np.any(np.asarray(pool.rope) != 0)


def test_failures_name_fallback_ops_recompiles_and_errors():
    base = dict(dcp=2, kernels="pallas", batch=8)
    rows = [
        dict(base, kind="program", variant="host", length_derivations=3),
        dict(base, kind="program", variant="fallback", length_derivations=12),  # expected, not a failure
        dict(base, kind="point", variant="host", context=4096, recompiles=1),
        dict(base, kind="error", variant="host", stage="compile", error="RESOURCE_EXHAUSTED"),
    ]
    bad = decode_bench_results.failures(rows)
    assert len(bad) == 3
    assert "3 integer ops derived from global lengths" in bad[0]
    assert "1 compiles during the timed steps" in bad[1]
    assert "RESOURCE_EXHAUSTED" in bad[2]


def test_breakdown_takes_differences_of_consecutive_variants():
    chain = STAGED + ["host"]
    rows = [dict(kind="point", dcp=1, kernels="reference", batch=4, context=64, variant=v, device_ms=float(i + 1))
            for i, v in enumerate(chain)]
    (key, stages), = decode_bench_results.breakdown(rows).items()
    assert key == (1, "reference", 4, 64)
    assert list(stages) == list(decode_bench_results.BREAKDOWN)
    assert stages == dict(zip(decode_bench_results.BREAKDOWN, [1.0] * len(chain)))
    assert decode_bench_results.breakdown(rows[1:]) == {}  # an incomplete chain gives no breakdown


def test_dcp_scaling_checks_the_two_gpu_target_at_long_context():
    def rows(ms2):
        out = []
        for w, ms, kv, cap in [(1, 10.0, 200, 1000), (2, ms2, 100, 2000)]:
            common = dict(dcp=w, kernels="pallas", batch=32, variant="host")
            out += [dict(common, kind="point", context=65536, median_ms=ms + 1, device_ms=ms,
                         kv_latent_bytes_per_rank=kv),
                    dict(common, kind="program", max_context=cap)]
        return out

    table, verdicts = decode_bench_results.dcp_scaling(rows(9.0))
    assert "| pallas | 2 | 32 | 64K | 0.50 | 2.00 | 10.000 -> 9.000 | 0.90 | 11.000 -> 10.000 |" in table
    assert verdicts == ["DCP=2 vs DCP=1 (pallas, L >= 64K, B >= 32, 1 points): per-rank KV <= 1/2, max context "
                        ">= 1.90x, step no slower: MET"]
    assert decode_bench_results.dcp_scaling(rows(10.5))[1][0].endswith("NOT MET")


def test_report_mode_merges_result_files(smoke, tmp_path):
    _, rows, _ = smoke
    halves = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for path, part in zip(halves, ([r for r in rows if r.get("dcp") != 2], [r for r in rows if r.get("dcp") == 2])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = cli.main(["bench", "decode", "--report", *map(str, halves), "--img-dir", "none"])
    text = stdout.getvalue()
    assert rc == 0, text
    assert "| reference | 1 | 2 | 64 |" in text and "| reference | 2 | 2 | 64 |" in text


def test_report_refuses_mixed_index_cache_formats(smoke, tmp_path):
    """Rows of an exact and an fp8 run share their keys: merging them is refused, not silently overwritten."""
    _, rows, _ = smoke
    fp8_rows = [dict(r, index_cache="fp8") if r["kind"] in ("point", "program") else r for r in rows]
    paths = [tmp_path / "exact.jsonl", tmp_path / "fp8.jsonl"]
    for path, part in zip(paths, (rows, fp8_rows)):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = cli.main(["bench", "decode", "--report", *map(str, paths), "--img-dir", "none"])
    assert rc == 2 and "mix (index, latent) cache formats [('exact', 'exact'), ('fp8', 'exact')]" in stdout.getvalue()


def test_plots_are_written(smoke, tmp_path):
    pytest.importorskip("matplotlib")
    _, rows, _ = smoke
    paths = decode_bench_results.plot(rows, str(tmp_path))
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["decode_latency_vs_context.png", "decode_capacity_vs_dcp.png"]


def test_fp8_weights_run_the_step_and_shrink_the_weight_bytes():
    """`--weight-format fp8`: the step runs with the block-fp8 linear layers (e4m3 values and f32 block scales), the
    rows say so, and a rank holds fewer weight bytes than with bf16 weights."""
    grids = {fmt: decode_bench.Grid(preset="tiny", num_layers=1, dcp_sizes=(1,), contexts=(64,), batches=(2,),
                                    kernels=("reference",), breakdown_batches=(), steps=1, warmup=1, page_size=4,
                                    fallback=False, weight_format=fmt) for fmt in ("plain", "fp8")}
    programs = {}
    for fmt, grid in grids.items():
        rows = list(decode_bench.run_grid(grid))
        assert not [r for r in rows if r["kind"] == "error"], rows
        assert {r["weight_format"] for r in rows if r["kind"] == "point"} == {fmt}
        programs[fmt] = next(r for r in rows if r["kind"] == "program")
    assert programs["fp8"]["weights_bytes_per_rank"] < 0.75 * programs["plain"]["weights_bytes_per_rank"]


def test_a_dense_mla_preset_runs_its_host_and_fallback_steps_and_its_roofline(tmp_path):
    """tiny-mla (DeepseekV3ForCausalLM): the host, TBO and fallback variants (no DSA stages to cut), no index-key
    bytes, every latent a rank holds in the roofline; the fallback derives lengths, the host step does not."""
    out = tmp_path / "dense.jsonl"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = cli.main(["bench", "decode", "--preset", "tiny-mla", "--num-layers", "1", "--dcp", "2", "--contexts",
                       "64", "--batches", "2", "--kernels", "reference", "--steps", "2", "--warmup", "1",
                       "--page-size", "4", "--img-dir", "none", "--tbo", "--profile", "--profile-steps", "2",
                       "--copy-bytes", "1M", "--matmul-size", "128", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rc == 0
    points = {r["variant"]: r for r in rows if r["kind"] == "point"}
    assert set(points) == {"host", "tbo", "fallback"}
    host = points["host"]
    assert host["kv_index_bytes_per_rank"] == 0 and host["index_key_bytes"] == 0
    assert host["latent_bytes"] == 1 * 2 * 32 * decode_bench._bytes_per_token(preset("tiny-mla"), 2, "exact",
                                                                                "exact")[0]
    programs = {r["variant"]: r for r in rows if r["kind"] == "program"}
    assert programs["host"]["length_derivations"] == 0 and programs["fallback"]["length_derivations"] > 0



def test_an_index_share_preset_counts_index_keys_of_its_full_layers_only(tmp_path):
    """tiny-glm cut to 2 layers (layer 0 full, layer 1 shared) in the seed's weight formats (MXFP4 routed experts,
    ptpc_fp8 elsewhere; expert parallel: 32-wide experts split over 2 ranks would cut MXFP4's scale blocks): host
    and fallback variants, no stage variants (they would cut the full layers' data flow), and the roofline and the
    pool count layer 0's index keys alone."""
    out = tmp_path / "glm.jsonl"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        rc = cli.main(["bench", "decode", "--preset", "tiny-glm", "--num-layers", "2", "--dcp", "2", "--contexts",
                       "64", "--batches", "2", "--breakdown-batches", "2", "--kernels", "reference", "--steps", "2",
                       "--warmup", "1", "--page-size", "4", "--img-dir", "none", "--profile", "--profile-steps", "2",
                       "--copy-bytes", "1M", "--matmul-size", "128", "--weight-format", "mxfp4", "--quantization",
                       "ptpc_fp8", "--enable-expert-parallel", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rc == 0
    points = {r["variant"]: r for r in rows if r["kind"] == "point"}
    assert set(points) == {"host", "fallback"}
    assert {(r["weight_format"], r["channel_fp8"]) for r in points.values()} == {("mxfp4", True)}
    assert "MXFP4 experts + ptpc_fp8 weights" in stdout.getvalue()
    latent, index = decode_bench._bytes_per_token(preset("tiny-glm"), 2, "exact", "exact")
    host = points["host"]
    assert host["kv_index_bytes_per_rank"] == 1 * 2 * 32 * index
    assert host["kv_latent_bytes_per_rank"] == 2 * 2 * 32 * latent
    assert host["index_key_bytes"] == 1 * 2 * 32 * index
