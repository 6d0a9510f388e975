"""Device events of a JAX profiler trace: the benches read kernel durations from them, without launch gaps."""

from __future__ import annotations

import glob
import os
from typing import NamedTuple

from jax.profiler import ProfileData


class Event(NamedTuple):
    name: str
    start_ns: float
    duration_ns: float


def trace_events(trace_dir: str, plane_prefix: str = "/device:GPU") -> dict[str, list[Event]]:
    """{line name: events} of the planes whose name starts with plane_prefix, over every trace file written
    under trace_dir (by `jax.profiler.trace`). Lines of the same name on several planes are concatenated."""
    lines: dict[str, list[Event]] = {}
    for path in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
        for plane in ProfileData.from_file(path).planes:
            if plane.name.startswith(plane_prefix):
                for line in plane.lines:
                    lines.setdefault(line.name, []).extend(
                        Event(event.name, event.start_ns, event.duration_ns) for event in line.events)
    return lines
