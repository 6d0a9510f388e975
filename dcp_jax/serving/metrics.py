"""Serving metrics in the Prometheus text format (no jax, no client library).

The engine thread records events (first token, generated tokens, finished requests); gauges (running and waiting
requests, KV pages, compiles) are read from a callback at render time. Thread-safe.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from collections.abc import Callable, Sequence

PREFIX = "dcp_jax"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS):
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip([*map(repr, self.bounds), "+Inf"], self.counts):
            running += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {running}')
        lines += [f"{name}_sum {self.total!r}", f"{name}_count {self.count}"]
        return lines


class ServingMetrics:
    """Counters and histograms of the serving loop; `gauges()` supplies the live values."""

    def __init__(self, gauges: Callable[[], dict[str, float]] | None = None, window_s: float = 10.0):
        self._lock = threading.Lock()
        self._gauges = gauges or dict
        self.ttft = Histogram()
        self.tpot = Histogram()
        self.e2e = Histogram()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: collections.Counter[str] = collections.Counter()
        self.preemptions = 0
        self.kv_cache_resets = 0
        self._window_s = window_s
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens)

    def on_prompt(self, tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += tokens

    def on_tokens(self, count: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.generation_tokens += count
            self._recent.append((now, count))
            self._trim(now)

    def on_first_token(self, ttft_s: float) -> None:
        with self._lock:
            self.ttft.observe(ttft_s)

    def on_finish(self, reason: str, *, e2e_s: float, decode_s: float, output_tokens: int) -> None:
        """decode_s: first token to last; TPOT is its mean over the tokens after the first."""
        with self._lock:
            self.finished[reason] += 1
            self.e2e.observe(e2e_s)
            if output_tokens > 1:
                self.tpot.observe(decode_s / (output_tokens - 1))

    def on_preempt(self, count: int) -> None:
        with self._lock:
            self.preemptions += count

    def on_kv_cache_reset(self) -> None:
        with self._lock:
            self.kv_cache_resets += 1

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            return sum(c for _, c in self._recent) / self._window_s

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self._window_s:
            self._recent.popleft()

    def render(self) -> str:
        """The Prometheus text exposition (version 0.0.4)."""
        p = PREFIX
        gauges = dict(self._gauges())
        gauges["generation_tokens_per_second"] = self.tokens_per_second()
        with self._lock:
            lines = []
            lines += self.ttft.render(f"{p}_time_to_first_token_seconds", "Time from arrival to the first token.")
            lines += self.tpot.render(f"{p}_time_per_output_token_seconds",
                                      "Mean time between output tokens of a request.")
            lines += self.e2e.render(f"{p}_e2e_request_latency_seconds", "Time from arrival to the last token.")
            counters = {
                "prompt_tokens_total": ("Prompt tokens of admitted requests.", self.prompt_tokens),
                "generation_tokens_total": ("Generated tokens.", self.generation_tokens),
                "preemptions_total": ("Requests preempted for lack of KV pages.", self.preemptions),
                "kv_cache_resets_total": ("KV caches reallocated after a failed step consumed the donated cache "
                                          "(the running requests failed).", self.kv_cache_resets),
            }
            for name, (help_text, value) in counters.items():
                lines += [f"# HELP {p}_{name} {help_text}", f"# TYPE {p}_{name} counter", f"{p}_{name} {value}"]
            lines += [f"# HELP {p}_requests_finished_total Finished requests by finish reason.",
                      f"# TYPE {p}_requests_finished_total counter"]
            for reason in sorted(set(self.finished) | {"stop", "length", "abort", "error"}):
                lines.append(f'{p}_requests_finished_total{{finish_reason="{reason}"}} {self.finished[reason]}')
        for name, value in sorted(gauges.items()):
            lines += [f"# TYPE {p}_{name} gauge", f"{p}_{name} {float(value)!r}"]
        return "\n".join(lines) + "\n"
