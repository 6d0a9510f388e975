"""bench/gpu_trace.py reads the events of a real profiler trace (on a CPU machine, the CPU's)."""

import jax
import jax.numpy as jnp

from bench.gpu_trace import Event, busy_fraction, trace_events


def test_reads_the_events_of_each_call(tmp_path):
    scale = jax.jit(lambda x: jnp.sin(x) * 2 + 1)
    x = jnp.ones((1000,))
    jax.block_until_ready(scale(x))
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            jax.block_until_ready(scale(x))

    events = [event for line in trace_events(str(tmp_path), "/host:CPU").values() for event in line]
    fusions = [event for event in events if event.name.endswith("fusion")]
    assert len(fusions) >= 3  # one XLA fusion per call
    assert all(event.start_ns > 0 and event.duration_ns >= 0 for event in fusions)
    if jax.default_backend() == "cpu":
        assert trace_events(str(tmp_path)) == {}  # no GPU planes


def test_busy_fraction_is_the_union_of_the_intervals_over_the_span():
    lines = {"Stream #1": [Event("a", 0, 10), Event("b", 30, 10)],  # busy 0-10 and 30-40
             "Stream #2": [Event("c", 5, 10)],  # overlaps a: busy 0-15
             "Other": [Event("d", 100, 50)]}  # not a stream line
    busy, span_ms, gap_ms = busy_fraction(lines)
    assert (busy, span_ms, gap_ms) == (25 / 40, 40e-6, 15e-6)
    assert busy_fraction({}) == (0.0, 0.0, 0.0)
