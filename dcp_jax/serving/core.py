"""The serving core that `Engine` and `LLM` share: one step is schedule -> dispatch the prefills and the decode step
(sampling runs on the device) -> read the tokens of the previous step -> scheduler update.

`ServingCore` owns the `Scheduler` and drives the `ModelRunner`. It validates requests (ValueError before anything
is queued), gives each its seed, and records each token, its logprobs and the prompt logprobs on the request itself,
so its callers only read requests: `Engine` streams their deltas from a thread, `LLM` returns them when all are
done.
Asynchronous scheduling (the default): a step dispatches its programs, then reads what the previous step sampled
while the device runs them; the new decode rows feed the previous step's tokens on the device (each request's
sampler slot keeps its last one), so nothing waits for the host. A stop found one step late (EOS, a stop string)
drops the extra token the request sampled meanwhile; stops by length are known ahead and cost nothing. Outputs
equal the synchronous core's (`async_scheduling=False`, which reads each step's tokens before returning): every
draw depends only on its request's seed and position.
A request that fails while its tokens are applied fails alone. The programs donate the device state: when one
raises after consuming it, the state is reallocated and every running request (whose context it held) fails; the
waiting ones go on.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence

import jax

from dcp_jax.host.sampling import SamplingParams, TokenLogprob, request_seed
from dcp_jax.runtime import sampler
from dcp_jax.host.scheduler import Request, Scheduler
from dcp_jax.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Dispatched:
    """A dispatched program whose tokens the host has not read: its outputs on the device, and the request of each
    row (None: a row whose token is not used, the prefill of a resumed request)."""

    requests: list[Request | None]
    outputs: object  # SampledTokens, or (SampledTokens, PromptLogprobs)
    with_prompt_logprobs: bool = False


class ServingCore:
    """One model's scheduler and runner; not thread-safe (one thread steps it)."""

    def __init__(self, runner, scheduler: Scheduler, *, vocab_size: int, seed: int, has_prompt_logprobs: bool,
                 metrics: ServingMetrics | None = None, async_scheduling: bool = True):
        self.runner, self.scheduler = runner, scheduler
        self.vocab_size, self.seed, self.has_prompt_logprobs = vocab_size, seed, has_prompt_logprobs
        self.async_scheduling = async_scheduling
        self.metrics = metrics or ServingMetrics()
        self._numbers = itertools.count()
        self._in_flight: list[_Dispatched] = []

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
        """A validated request numbered in arrival order (its id defaults to `{id_prefix}-{number}`); it draws from
        its seed, else from one made of the engine's seed and its number (`sampling.request_seed`)."""
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, params, prompt_logprobs)
        number = next(self._numbers)
        return Request(request_id or f"{id_prefix}-{number}", prompt_ids, params,
                       seed=request_seed(params, self.seed, number), num_prompt_logprobs=prompt_logprobs)

    def add(self, request: Request) -> None:
        self.scheduler.add(request)
        self.metrics.on_prompt(len(request.prompt_ids))

    def abort(self, request_id: str) -> Request | None:
        """Cancel a request wherever it is and free its pages; None when it is unknown or already done."""
        return self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._in_flight)

    # ---- one step ---------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule; dispatch the admitted requests' prefills (one program each) and the batch's decode step; read
        the tokens of the previous step (asynchronous) or of this one. Returns the requests this step touched
        (admitted, decoded or given tokens), in order."""
        sched = self.scheduler
        plan = sched.schedule()
        if plan.preempted:
            self.metrics.on_preempt(len(plan.preempted))
        dispatched = []
        for i, request in enumerate(plan.prefills):
            try:
                dispatched.append(self._dispatch_prefill(request))
            except Exception as e:  # this request only, unless the program consumed the device state
                log.exception("prefill of %s failed", request.request_id)
                self._after_device_fault([request], f"prefill failed: {e}", not_cached=plan.prefills[i + 1:])
        rows = sched.decode_rows(plan)
        if rows:
            try:
                dispatched.append(self._dispatch_decode(rows))
            except Exception as e:
                log.exception("decode step failed")
                self._after_device_fault(rows, f"decode failed: {e}")
        touched = [*plan.prefills, *plan.decodes]
        if self.async_scheduling:
            previous, self._in_flight = self._in_flight, dispatched
            touched += self._read(previous)
        else:
            touched += self._read(dispatched)
        return list(dict.fromkeys(touched))

    def fail_live(self, error: str) -> list[Request]:
        """Fail every queued and running request (the loop itself broke); returns them."""
        live = [*self.scheduler.running, *self.scheduler.waiting]
        for request in live:
            self.scheduler.fail(request, error)
        self._forget_in_flight()
        return live

    def _forget_in_flight(self) -> None:
        """Drop the dispatched programs not read yet (their outputs are lost): their requests expect no token from
        them (a preempted one resamples it, at the same position and so the same draw, when readmitted)."""
        for d in self._in_flight:
            for request in d.requests:
                if request is not None:
                    request.num_pending = 0
        self._in_flight = []

    def _dispatch_prefill(self, request: Request) -> _Dispatched:
        resumed = request.is_resumed
        want = request.num_prompt_logprobs is not None and not resumed
        outputs = self.runner.dispatch_prefill(
            request.prefill_ids, len(request.prompt_ids), request.pages, request.params, request.seed, request.slot,
            resume_token=request.output_ids[-1] if resumed else -1, prompt_logprobs=want)
        if resumed:  # recompute after preemption: its next token is already known
            return _Dispatched([None], outputs)
        self.scheduler.mark_dispatched(request)
        return _Dispatched([request], outputs, with_prompt_logprobs=want)

    def _dispatch_decode(self, rows: list[Request]) -> _Dispatched:
        outputs = self.runner.dispatch_decode([r.context_len for r in rows], self.scheduler.decode_block_tables(rows),
                                              [r.slot for r in rows])
        for request in rows:
            self.scheduler.mark_dispatched(request)
        return _Dispatched(list(rows), outputs)

    def _read(self, dispatched: list[_Dispatched]) -> list[Request]:
        """Wait for the tokens of `dispatched` and apply them in dispatch order; returns their requests."""
        applied = []
        for d in dispatched:
            try:
                host = jax.device_get(d.outputs)
            except Exception as e:  # an asynchronous failure of the program surfaces here
                log.exception("a dispatched program failed")
                self._after_device_fault([r for r in d.requests if r is not None and not r.is_finished],
                                         f"step failed: {e}")
                continue
            packed, prompt_lps = host if d.with_prompt_logprobs else (host, None)
            sampled = sampler.unpack(packed)
            tokens = sampled.tokens.tolist()
            counted = 0
            for row, request in enumerate(d.requests):
                if request is None:
                    continue
                try:
                    counted += self._apply(request, tokens[row], sampled, row, prompt_lps)
                except Exception as e:
                    log.exception("applying the token of %s failed", request.request_id)
                    self.scheduler.fail(request, f"token handling failed: {e}")
                applied.append(request)
            if counted:
                self.metrics.on_tokens(counted)
        return applied

    def _apply(self, request: Request, token: int, sampled, row: int, prompt_lps) -> bool:
        """Record `token`, row `row`'s, for `request`: logprobs, prompt logprobs, the first token's time, then the
        scheduler. False for a token sampled past the request's end (it stopped at the step before)."""
        if request.is_finished:
            self.scheduler.append_token(request, token)
            return False
        if request.params.logprobs is not None:
            request.logprobs.append(TokenLogprob.of(token, sampled.logprobs[row], sampled.top_ids[row],
                                                    sampled.top_logprobs[row], request.params.logprobs,
                                                    text_offset=len(request.text)))
        if prompt_lps is not None:
            prompt, n = request.prompt_ids, request.num_prompt_logprobs
            request.prompt_logprobs = [None] + [
                TokenLogprob.of(prompt[p], prompt_lps.logprobs[row, p - 1], prompt_lps.top_ids[row, p - 1],
                                prompt_lps.top_logprobs[row, p - 1], n) for p in range(1, len(prompt))]
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
            self.metrics.on_first_token(request.first_token_time - request.arrival_time)
        self.scheduler.append_token(request, token)
        return True

    def _after_device_fault(self, failed: list[Request], error: str, not_cached: Sequence[Request] = ()) -> None:
        """A compiled call raised: fail `failed`. When the call consumed the donated device state, allocate a fresh
        one and fail every running request whose context it held too (all but `not_cached`: admitted this step,
        not prefilled yet), and forget what was in flight (its outputs died with the state); waiting requests hold
        no KV and go on."""
        lost = not self.runner.kv_cache_is_usable()
        if lost:
            log.error("the failed call consumed the device state: reallocating it, failing the running requests")
            error += " (the KV cache was lost)"
            self.runner.reset_state()
            self.metrics.on_kv_cache_reset()
        for request in failed:
            self.scheduler.fail(request, error)
        if lost:
            for request in [r for r in self.scheduler.running if r not in not_cached]:
                self.scheduler.fail(request, error)
            self._forget_in_flight()
