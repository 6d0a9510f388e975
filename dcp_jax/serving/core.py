"""The serving core that `Engine` and `LLM` share: one step is schedule -> prefill / decode on the runner ->
sample -> scheduler update.

`ServingCore` owns the `Scheduler` and drives the `ModelRunner`. It validates requests (ValueError before anything
is queued), seeds each request's generator, and records each sampled token, its logprobs and the prompt logprobs on
the request itself, so its callers only read requests: `Engine` streams their deltas from a thread, `LLM` returns
them when all are done. A request that fails (sampling, its prefill) fails alone. The programs donate the KV
cache: when one raises after consuming it, the cache is reallocated and every running request (whose context it
held) fails; the waiting ones go on.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

import numpy as np

from dcp_jax.host.sampling import SamplingParams, TokenLogprob, log_softmax, sample
from dcp_jax.host.scheduler import Request, Scheduler
from dcp_jax.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)


class ServingCore:
    """One model's scheduler and runner; not thread-safe (one thread steps it)."""

    def __init__(self, runner, scheduler: Scheduler, *, vocab_size: int, seed: int, has_prompt_logprobs: bool,
                 metrics: ServingMetrics | None = None):
        self.runner, self.scheduler = runner, scheduler
        self.vocab_size, self.seed, self.has_prompt_logprobs = vocab_size, seed, has_prompt_logprobs
        self.metrics = metrics or ServingMetrics()
        self._numbers = itertools.count()

    # ---- requests ---------------------------------------------------------------------------------------
    def validate(self, prompt_ids: Sequence[int], params: SamplingParams, prompt_logprobs: int | None = None) -> None:
        """ValueError (TypeError for a wrong params type) for a request that can never run."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise ValueError(f"the prompt has token ids outside [0, {self.vocab_size})")
        if prompt_logprobs is not None and not self.has_prompt_logprobs:
            raise ValueError("this engine was started without prompt logprobs")
        self.scheduler.check_fits(len(prompt_ids), params.max_tokens)

    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
                     prompt_logprobs: int | None = None, id_prefix: str = "req") -> Request:
        """A validated request numbered in arrival order (its id defaults to `{id_prefix}-{number}`); its generator
        draws from its seed, else from (the engine's seed, its number)."""
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, params, prompt_logprobs)
        number = next(self._numbers)
        seed = params.seed if params.seed is not None else (self.seed, number)
        return Request(request_id or f"{id_prefix}-{number}", prompt_ids, params, rng=np.random.default_rng(seed),
                       num_prompt_logprobs=prompt_logprobs)

    def add(self, request: Request) -> None:
        self.scheduler.add(request)
        self.metrics.on_prompt(len(request.prompt_ids))

    def abort(self, request_id: str) -> Request | None:
        """Cancel a request wherever it is and free its pages; None when it is unknown or already done."""
        return self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- one step ---------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule, prefill the admitted requests (one program each), decode the batch, sample, update the
        scheduler. Returns the requests this step touched (admitted or decoded), in order."""
        sched = self.scheduler
        plan = sched.schedule()
        if plan.preempted:
            self.metrics.on_preempt(len(plan.preempted))
        for i, request in enumerate(plan.prefills):
            try:
                self._prefill(request)
            except Exception as e:  # this request only, unless the program consumed the KV cache
                log.exception("prefill of %s failed", request.request_id)
                self._after_device_fault([request], f"prefill failed: {e}", not_cached=plan.prefills[i + 1:])
        rows = sched.decode_rows(plan)
        if rows:
            try:
                logits, _ = self.runner.decode([r.output_ids[-1] for r in rows], [r.context_len for r in rows],
                                               [r.pages for r in rows])
            except Exception as e:
                log.exception("decode step failed")
                self._after_device_fault(rows, f"decode failed: {e}")
            else:
                for request, row in zip(rows, logits):
                    self._sample(request, row)
        return list(dict.fromkeys([*plan.prefills, *plan.decodes]))

    def fail_live(self, error: str) -> list[Request]:
        """Fail every queued and running request (the loop itself broke); returns them."""
        live = [*self.scheduler.running, *self.scheduler.waiting]
        for request in live:
            self.scheduler.fail(request, error)
        return live

    def _after_device_fault(self, failed: list[Request], error: str, not_cached: Sequence[Request] = ()) -> None:
        """A compiled call raised: fail `failed`. When the call consumed the donated KV cache, allocate a fresh
        one and fail every running request whose context it held too (all but `not_cached`: admitted this step,
        not prefilled yet); waiting requests hold no KV and go on."""
        lost = not self.runner.kv_cache_is_usable()
        if lost:
            log.error("the failed call consumed the KV cache: reallocating it, failing the running requests")
            error += " (the KV cache was lost)"
            self.runner.reset_kv_cache()
            self.metrics.on_kv_cache_reset()
        for request in failed:
            self.scheduler.fail(request, error)
        if lost:
            for request in [r for r in self.scheduler.running if r not in not_cached]:
                self.scheduler.fail(request, error)

    def _prefill(self, request: Request) -> None:
        want = request.num_prompt_logprobs is not None and not request.is_resumed
        logits, _ = self.runner.prefill([request.prefill_ids], [request.pages], all_logits=want)
        if request.is_resumed:
            return  # recompute after preemption: the next token is already sampled
        if want:
            prompt = request.prompt_ids
            lps = log_softmax(logits[0, : len(prompt) - 1])
            request.prompt_logprobs = [None] + [TokenLogprob.of(lps[pos - 1], prompt[pos], request.num_prompt_logprobs)
                                                for pos in range(1, len(prompt))]
            last = logits[0, len(prompt) - 1]
        else:
            last = logits[0]
        self._sample(request, last)

    def _sample(self, request: Request, logits: np.ndarray) -> None:
        try:
            token = sample(logits, request.params, request.rng)
            if request.params.logprobs is not None:
                request.logprobs.append(TokenLogprob.of(log_softmax(logits), token, request.params.logprobs,
                                                        text_offset=len(request.text)))
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
                self.metrics.on_first_token(request.first_token_time - request.arrival_time)
            self.scheduler.append_token(request, token)
            self.metrics.on_tokens(1)
        except Exception as e:
            log.exception("sampling %s failed", request.request_id)
            self.scheduler.fail(request, f"sampling failed: {e}")
