"""bench/gpu_trace.py reads the events of a real profiler trace (on a CPU machine, the CPU's)."""

import jax
import jax.numpy as jnp

from bench.gpu_trace import trace_events


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
