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


def busy_fraction(lines: dict[str, list[Event]], line_prefix: str = "Stream") -> tuple[float, float, float]:
    """(busy fraction, span ms, longest gap ms) of the device over the lines whose name starts with `line_prefix`:
    the union of their events' intervals over the span from the first event's start to the last one's end, and
    the longest stretch with no event running."""
    intervals = sorted((e.start_ns, e.start_ns + e.duration_ns) for name, events in lines.items()
                       if name.startswith(line_prefix) for e in events)
    if not intervals:
        return 0.0, 0.0, 0.0
    busy, gap, (start, end) = 0.0, 0.0, intervals[0]
    first = start
    for begin, finish in intervals[1:]:
        if begin > end:
            busy += end - start
            gap = max(gap, begin - end)
            start = begin
        end = max(end, finish)
    busy += end - start
    span = end - first
    return busy / span if span else 1.0, span / 1e6, gap / 1e6
