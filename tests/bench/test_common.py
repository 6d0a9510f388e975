"""bench/common.py: what the benchmarks share."""

import jax
import jax.numpy as jnp
import pytest

from bench import common
from bench.gpu_trace import Event


def test_hlo_op_counts_counts_integer_arithmetic():
    text = """
  %add.1 = s32[4]{0} add(s32[4]{0} %a, s32[4]{0} %b)
  %add.2 = f32[4,8]{1,0} add(f32[4,8]{1,0} %c, f32[4,8]{1,0} %d)
  %clamp.3 = s32[4]{0} clamp(s32[] %lo, s32[4]{0} %add.1, s32[] %hi)
  %convert.4 = f8e4m3fn[4]{0} convert(f32[4]{0} %e)
  ROOT %tuple.5 = (f32[4,8]{1,0}) tuple(f32[4,8]{1,0} %add.2)
"""
    counts = common.hlo_op_counts(text)
    assert counts["add"] == 2 and counts["clamp"] == 1 and counts["convert"] == 1
    assert counts["int:add"] == 1 and counts["int:clamp"] == 1 and "int:convert" not in counts


def test_run_info_names_the_run():
    info = common.run_info()
    assert info["commit"] and info["device"] and info["jax"] and info["num_devices"] >= 1


def test_median_seconds_times_each_call_after_its_untimed_setup(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])
    calls, flushes = [], []

    def advance(seconds):  # a call that takes `seconds` on the fake clock
        calls.append(seconds)
        clock[0] += seconds

    def flush():  # untimed: it moves the clock too
        flushes.append(clock[0])
        clock[0] += 100.0

    median = common.median_seconds(advance, [(1.0,), (5.0,), (3.0,)], 4, warmup=2, before_each=flush, sync=None)
    assert calls == [1.0, 1.0, 1.0, 5.0, 3.0, 1.0]  # two warm-ups on the first set, then the sets in turn
    assert len(flushes) == 4
    assert median == 2.0  # median of 1, 5, 3, 1


def test_log_prints_keeps_and_writes_every_line(tmp_path, capsys):
    log = common.Log()
    log("before", 1)
    path = tmp_path / "bench.log"
    log.write_to(str(path))
    log()
    log("after")
    assert capsys.readouterr().out == "before 1\n\nafter\n"
    assert log.lines == ["before 1", "", "after"]
    assert path.read_text() == "before 1\n\nafter\n"
    assert log.elapsed() >= 0
    again = common.Log()
    again.write_to(str(path), append=True)
    again("next run")
    assert path.read_text() == "before 1\n\nafter\nnext run\n"


def test_json_round_trip_writes_what_json_cannot_hold_as_str(tmp_path):
    path = str(tmp_path / "report.json")
    common.write_json(path, dict(rows=[dict(B=1, us=2.5)], dtype=jnp.dtype("bfloat16")))
    assert common.read_json(path) == dict(rows=[dict(B=1, us=2.5)], dtype="bfloat16")


def test_kernel_durations_us_keeps_the_named_lines_and_merges_cut_names():
    lines = {"Stream #1": [Event("fusion_long_a", 0, 2000), Event("fusion_long_b", 5, 4000), Event("topk", 9, 500)],
             "XLA Ops": [Event("fusion_long_a", 0, 2000)]}
    assert common.kernel_durations_us(lines, line_prefix="Stream", name_chars=11) == {"fusion_long": [2.0, 4.0],
                                                                                     "topk": [0.5]}
    assert common.kernel_durations_us(lines)["fusion_long_a"] == [2.0, 2.0]


def test_traced_device_events_reads_the_calls_of_a_cpu_trace():
    scale = jax.jit(lambda x: jnp.sin(x) * 2 + 1)
    x = jnp.ones((1000,))
    jax.block_until_ready(scale(x))
    durations = common.kernel_durations_us(common.traced_device_events(scale, (x,), 3, "/host:CPU"))
    assert sum(len(us) for name, us in durations.items() if name.endswith("fusion")) >= 3  # one fusion a call


def _indexer_args():
    q, weights = jnp.ones((1, 4, 16), jnp.float32), jnp.ones((1, 4), jnp.float32)
    return q, weights, jnp.ones((2, 4, 16), jnp.float32), jnp.zeros((1, 2), jnp.int32), jnp.full((1,), 8, jnp.int32)


def test_knobs_with_backend_names_the_implementation_that_has_the_knobs():
    args = _indexer_args()
    assert common.knobs_with_backend("indexer_logits", {}, *args) == {}
    assert common.knobs_with_backend("indexer_logits", dict(backend="mosaic"), *args) == dict(backend="mosaic")
    assert common.knobs_with_backend("indexer_logits", dict(chunk_t=32), *args) == dict(chunk_t=32, backend="triton")
    # Only Mosaic has pages_per_cta: named even where it cannot run (the op then says why).
    assert common.knobs_with_backend("indexer_logits", dict(pages_per_cta=8), *args)["backend"] == "mosaic"


def test_knobs_with_backend_takes_the_first_that_runs_when_several_have_the_knobs():
    q, cache = jnp.ones((2, 16, 576), jnp.float32), jnp.ones((4, 64, 576), jnp.float32)
    slots, counts = jnp.zeros((2, 64), jnp.int32), jnp.full((2,), 64, jnp.int32)
    # Both have num_splits; the Mosaic kernel takes no f32 cache.
    knobs = common.knobs_with_backend("sparse_mla_decode", dict(num_splits=2), q, cache, slots, counts, 0.1)
    assert knobs == dict(num_splits=2, backend="triton")


def test_knobs_with_backend_refuses_knobs_no_implementation_has():
    with pytest.raises(ValueError, match="no indexer_logits implementation has every knob of"):
        common.knobs_with_backend("indexer_logits", dict(chunk_t=32, pages_per_cta=8), *_indexer_args())
