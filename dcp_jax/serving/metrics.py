"""Serving metrics through `prometheus_client` (no jax), in a registry of their own per engine.

The engine thread records events as they happen: admitted prompts, prefills (the prefix cache's queries and hits,
in tokens), generated tokens, first tokens, speculative decoding's drafted and kept tokens, preemptions,
KV cache resets, and each request's end (finished or aborted: its reason, end-to-end latency and time per output
token). The queue gauges are set after every change the loop makes; the KV pool and the compile counts are read
from a callback when /metrics is scraped. Every metric is named `dcp_jax_*`; counters get `_total` from the
exposition, and only counters have it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "dcp_jax"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# What the engine's `live()` callback reports at scrape time: these counters and gauges.
_LIVE_COUNTERS = {"compiles": "XLA compiles since the engine's warm-up began.",
                  "compiles_after_warmup": "XLA compiles while serving (0: every program was compiled at start)."}
_LIVE_GAUGES = {"kv_pages_used": "KV pages held by requests.", "kv_pages_free": "KV pages free.",
                "kv_pages_capacity": "KV pages in the pool.", "programs_compiled": "Programs compiled at start-up."}


class _LiveCollector:
    """The engine's scrape-time values as metric families."""

    def __init__(self, live: Callable[[], dict[str, float]], rate: Callable[[], float]):
        self._live, self._rate = live, rate

    def collect(self):
        values = self._live()
        for name, help_text in _LIVE_GAUGES.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=values[name])
        for name, help_text in _LIVE_COUNTERS.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=values[name])
        yield GaugeMetricFamily(f"{PREFIX}_generation_tokens_per_second",
                                "Generated tokens per second over the last window.", value=self._rate())


class ServingMetrics:
    """The serving loop's metrics; `render()` is the Prometheus text exposition. Thread-safe."""

    def __init__(self, live: Callable[[], dict[str, float]] | None = None, window_s: float = 10.0):
        self.registry = registry = CollectorRegistry()
        p = PREFIX
        self._ttft = Histogram(f"{p}_time_to_first_token_seconds", "Time from arrival to the first token.",
                               buckets=LATENCY_BUCKETS, registry=registry)
        self._tpot = Histogram(f"{p}_time_per_output_token_seconds",
                               "Mean time between output tokens of a request.", buckets=LATENCY_BUCKETS,
                               registry=registry)
        self._e2e = Histogram(f"{p}_e2e_request_latency_seconds", "Time from arrival to the end of a request.",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self._prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens of admitted requests.",
                                      registry=registry)
        self._generation_tokens = Counter(f"{p}_generation_tokens", "Generated tokens.", registry=registry)
        self._prefix_cache_queries = Counter(f"{p}_prefix_cache_queries", "Prompt tokens (and a resumed request's "
                                             "generated ones) looked up in the prefix cache.", registry=registry)
        self._prefix_cache_hits = Counter(f"{p}_prefix_cache_hits", "Of those, tokens found cached (not "
                                          "computed).", registry=registry)
        self._preemptions = Counter(f"{p}_preemptions", "Requests preempted for lack of KV pages.",
                                    registry=registry)
        self._kv_cache_resets = Counter(f"{p}_kv_cache_resets", "KV caches reallocated after a failed step "
                                        "consumed the donated cache (the running requests failed).",
                                        registry=registry)
        self._finished = Counter(f"{p}_requests_finished", "Ended requests by finish reason (abort: cancelled).",
                                 ["finish_reason"], registry=registry)
        for reason in FINISH_REASONS:
            self._finished.labels(reason)
        self._spec_drafts = Counter(f"{p}_spec_decode_num_drafts", "Verify groups of requests with drafted tokens "
                                    "(speculative decoding).", registry=registry)
        self._spec_draft_tokens = Counter(f"{p}_spec_decode_num_draft_tokens", "Drafted tokens verified.",
                                          registry=registry)
        self._spec_accepted_tokens = Counter(f"{p}_spec_decode_num_accepted_tokens", "Drafted tokens kept.",
                                             registry=registry)
        self._spec_acceptance = Gauge(f"{p}_spec_decode_acceptance_rate", "Drafted tokens kept per drafted token, "
                                      "since start.", registry=registry)
        self._spec_mean_length = Gauge(f"{p}_spec_decode_mean_accepted_length", "Tokens a verify group emits on "
                                       "average (its kept drafts and the token after them), since start.",
                                       registry=registry)
        self._running = Gauge(f"{p}_running_requests", "Requests in the running batch.", registry=registry)
        self._waiting = Gauge(f"{p}_waiting_requests", "Requests waiting for admission.", registry=registry)
        self._lock = threading.Lock()
        self._spec_totals = [0, 0, 0]  # verify groups, drafted tokens, kept ones
        self._window_s = window_s
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens)
        if live is not None:
            registry.register(_LiveCollector(live, self.tokens_per_second))

    # ---- events (the engine thread) -----------------------------------------------------------------------
    def on_prompt(self, tokens: int) -> None:
        self._prompt_tokens.inc(tokens)

    def on_prefill(self, tokens: int, cached: int) -> None:
        """A request's prefill began: `tokens` to hold, `cached` of them found in the prefix cache."""
        self._prefix_cache_queries.inc(tokens)
        self._prefix_cache_hits.inc(cached)

    def on_tokens(self, count: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._generation_tokens.inc(count)
        with self._lock:
            self._recent.append((now, count))
            self._trim(now)

    def on_first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s)

    def on_finish(self, reason: str, *, e2e_s: float, decode_s: float, output_tokens: int) -> None:
        """A request ended (finished, failed or aborted). decode_s: first token to last; TPOT is its mean over the
        tokens after the first."""
        self._finished.labels(reason).inc()
        self._e2e.observe(e2e_s)
        if output_tokens > 1:
            self._tpot.observe(decode_s / (output_tokens - 1))

    def on_drafts(self, groups: int, draft_tokens: int, accepted: int) -> None:
        """A step verified `draft_tokens` drafted tokens in `groups` verify groups and kept `accepted`."""
        self._spec_drafts.inc(groups)
        self._spec_draft_tokens.inc(draft_tokens)
        self._spec_accepted_tokens.inc(accepted)
        with self._lock:
            self._spec_totals = [t + n for t, n in zip(self._spec_totals, (groups, draft_tokens, accepted))]
            verified, drafted, kept = self._spec_totals
        self._spec_acceptance.set(kept / drafted)
        self._spec_mean_length.set(1 + kept / verified)

    def on_preempt(self, count: int) -> None:
        self._preemptions.inc(count)

    def on_kv_cache_reset(self) -> None:
        self._kv_cache_resets.inc()

    def set_queue(self, *, running: int, waiting: int) -> None:
        self._running.set(running)
        self._waiting.set(waiting)

    # ---- reading ------------------------------------------------------------------------------------------
    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            return sum(c for _, c in self._recent) / self._window_s

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self._window_s:
            self._recent.popleft()

    def value(self, name: str, **labels: str) -> float:
        """One sample's current value, by its exposed name (`dcp_jax_preemptions_total`)."""
        value = self.registry.get_sample_value(name, labels)
        if value is None:
            raise KeyError(f"no sample {name}{labels or ''}")
        return value

    @property
    def preemptions(self) -> int:
        return int(self.value(f"{PREFIX}_preemptions_total"))

    @property
    def kv_cache_resets(self) -> int:
        return int(self.value(f"{PREFIX}_kv_cache_resets_total"))

    def requests_finished(self, reason: str) -> int:
        return int(self.value(f"{PREFIX}_requests_finished_total", finish_reason=reason))

    def render(self) -> str:
        """The Prometheus text exposition (`CONTENT_TYPE`)."""
        return generate_latest(self.registry).decode()
