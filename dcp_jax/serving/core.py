"""The serving core that `Engine` and `LLM` share: one step is schedule -> dispatch the step's program (decode rows
and prefill chunks together; sampling runs on the device) -> read the tokens of the previous step -> scheduler
update.

`ServingCore` owns the `Scheduler` and drives the `ModelRunner`. It validates requests (ValueError before anything
is queued), gives each its seed, and records each token, its logprobs and the prompt logprobs on the request itself,
so its callers only read requests: `Engine` streams their deltas from a thread, `LLM` returns them when all are
done.
Asynchronous scheduling (the default): a step dispatches its program, then reads what the previous step sampled
while the device runs it; decode rows feed the previous step's tokens on the device (each request's sampler slot
keeps its last one), so nothing waits for the host. A stop found one step late (EOS, a stop string) drops the
extra token the request sampled meanwhile; stops by length are known ahead and cost nothing. Outputs equal the
synchronous core's (`async_scheduling=False`, which reads each step's tokens before returning): every draw depends
only on its request's seed and position.
A request that fails while its tokens are applied fails alone. The program donates the device state: when it
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
import numpy as np

from dcp_jax.host.sampling_metadata import MIN_TOKENS_STOP_IDS
from dcp_jax.host.step_inputs import GENERATED, PROMPT
from dcp_jax.host.step_plan import ScheduledRows
from dcp_jax.host.sampling import SamplingParams, TokenLogprob, request_seed
from dcp_jax.host.scheduler import Request, Scheduler
from dcp_jax.runtime import sampler
from dcp_jax.runtime.runner import step_kind
from dcp_jax.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Dispatched:
    """A dispatched step whose tokens the host has not read: its outputs on the device, the request of each
    sampled token in order, and the prefill chunks whose prompt logprobs it computed: (request, the chunk's first
    position, its rows, its first row)."""

    samplers: list[Request]
    outputs: object  # SampledTokens packed, or (that, PromptLogprobs)
    logprob_chunks: list[tuple[Request, int, int, int]]
    drafts: list[int] = dataclasses.field(default_factory=list)  # drafted tokens of each verify group with some


class ServingCore:
    """One model's scheduler and runner; not thread-safe (one thread steps it)."""

    def __init__(self, runner, scheduler: Scheduler, *, vocab_size: int, seed: int, has_prompt_logprobs: bool,
                 metrics: ServingMetrics | None = None, async_scheduling: bool = True):
        self.runner, self.scheduler = runner, scheduler
        self.vocab_size, self.seed, self.has_prompt_logprobs = vocab_size, seed, has_prompt_logprobs
        # Speculative decoding (the MTP layer drafts) schedules synchronously: a step's rows depend on how many
        # drafts the step before kept.
        self.drafting = bool(runner.engine.num_speculative_tokens)
        self.async_scheduling = async_scheduling and not self.drafting
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
        self.scheduler.check_fits(len(prompt_ids), params.max_tokens)  # first: a huge prompt is never scanned
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise ValueError(f"the prompt has token ids outside [0, {self.vocab_size})")
        if prompt_logprobs is not None and not self.has_prompt_logprobs:
            raise ValueError("this engine was started without prompt logprobs")
        held = len(params.stop_token_ids) + (not params.ignore_eos)
        if params.min_tokens and held > MIN_TOKENS_STOP_IDS:
            raise ValueError(f"min_tokens holds back at most {MIN_TOKENS_STOP_IDS} stop tokens (EOS included), got "
                             f"{held}")

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
        """Schedule; dispatch the step's decode rows and prefill chunks (one program); read the tokens of the
        previous step (asynchronous) or of this one. Returns the requests this step touched (scheduled, or given
        tokens), in order."""
        plan = self.scheduler.schedule()
        if plan.preempted:
            self.metrics.on_preempt(len(plan.preempted))
        dispatched = []
        if plan.scheduled:
            try:
                step = self._dispatch(plan.scheduled)
                if step is not None:
                    dispatched.append(step)
            except Exception as e:  # the step's requests, and every running one if the program consumed the state
                log.exception("step failed")
                self._after_device_fault([r for r, _ in plan.scheduled], f"step failed: {e}")
        touched = [r for r, _ in plan.scheduled]
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
        """Drop the dispatched steps not read yet (their outputs are lost): their requests expect no token from
        them (a preempted one resamples it, at the same position and so the same draw, when readmitted)."""
        for d in self._in_flight:
            for request in d.samplers:
                request.num_pending = 0
        self._in_flight = []

    def _dispatch(self, scheduled: Sequence[tuple[Request, int]]) -> _Dispatched | None:
        """One step: decode rows (one numpy gather of their tables) then prefill chunks; marks them dispatched. A
        request whose chunk fails to build fails alone and stays out of the step (None: nothing left to run)."""
        sched, runner = self.scheduler, self.runner
        decodes = [(r, n) for r, n in scheduled if not r.is_prefilling]
        parts = []
        if decodes:
            requests = [r for r, _ in decodes]
            slots, lens, tables = [r.slot for r in requests], [r.context_len for r in requests], \
                sched.block_tables_of(requests)
            parts.append(ScheduledRows.verify(slots, lens, [n - 1 for _, n in decodes], tables) if self.drafting
                         else ScheduledRows.decode(slots, lens, tables))
        samplers, logprob_chunks, row = [r for r, _ in decodes], [], sum(n for _, n in decodes)
        chunks = []
        for request, n in scheduled:
            if not request.is_prefilling:
                continue
            try:
                parts.append(self._chunk_rows(request, n))
            except Exception as e:
                log.exception("building the prefill chunk of %s failed", request.request_id)
                self.scheduler.fail(request, f"prefill failed: {e}")
                continue
            chunks.append((request, n))
            if sched.samples(request, n):
                samplers.append(request)
            first = request.num_computed
            if (request.num_prompt_logprobs is not None and not request.output_ids  # a resumed one has them
                    and first < len(request.prompt_ids) - 1):
                logprob_chunks.append((request, first, n, row))
            row += n
        if not parts:
            return None
        kind = step_kind([r.params for r in samplers], prompt_logprobs=bool(logprob_chunks))
        outputs = runner.dispatch(ScheduledRows.concat(parts), kind)
        for request, n in [*decodes, *chunks]:
            sched.mark_dispatched(request, n)
        return _Dispatched(samplers, outputs, logprob_chunks, [n - 1 for _, n in decodes if n > 1])

    def _chunk_rows(self, request: Request, n: int) -> ScheduledRows:
        """The rows of the next prefill chunk of `request`, [first, first + n): prompt tokens, then (resumed)
        generated ones. Its first chunk sets its slot's sampling parameters and counts the prefix cache's part."""
        first = request.num_computed
        if first == request.num_cached_tokens:  # its first rows: the tokens before them came from the prefix cache
            self.runner.set_sampling(request.slot, request.params, request.seed, len(request.prompt_ids))
            self.metrics.on_prefill(request.prefill_len, request.num_cached_tokens)
        ids = request.prefill_ids
        prompt_len = len(request.prompt_ids)
        positions = np.arange(first, first + n)
        end = first + n
        return ScheduledRows(
            slots=np.array([request.slot], np.int32), context_lens=np.array([end], np.int32),
            num_queries=np.array([n], np.int32), block_tables=self.scheduler.block_tables_of([request]),
            tokens=np.asarray(ids[first:end], np.int32),
            roles=np.where(positions < prompt_len, PROMPT, GENERATED).astype(np.int32),
            next_tokens=np.asarray(ids[first + 1:end + 1] + [-1] * (end == len(ids)), np.int32),
            is_fresh=np.array([first == request.num_cached_tokens]), samples=np.array([end == request.prefill_len]))

    def _read(self, dispatched: list[_Dispatched]) -> list[Request]:
        """Wait for the tokens of `dispatched` and apply them in dispatch order; returns their requests."""
        applied = []
        for d in dispatched:
            try:
                host = jax.device_get(d.outputs)
            except Exception as e:  # an asynchronous failure of the program surfaces here
                log.exception("a dispatched step failed")
                self._after_device_fault([r for r in d.samplers if not r.is_finished], f"step failed: {e}")
                continue
            packed, prompt_lps = host if d.logprob_chunks else (host, None)
            for request, first, n, row in d.logprob_chunks:
                self._record_prompt_logprobs(request, prompt_lps, first, n, row)
            sampled = sampler.unpack(packed)
            tokens = sampled.tokens.tolist()
            counted, group = 0, self.runner.engine.sample_group
            for index, request in enumerate(d.samplers):
                first = index * group
                try:  # a verify group emits its kept drafts and the token after them (-1 past them)
                    for row in range(first, first + group):
                        if tokens[row] < 0 or (row > first and request.is_finished):
                            break
                        counted += self._apply(request, tokens[row], sampled, row)
                except Exception as e:
                    log.exception("applying the token of %s failed", request.request_id)
                    self.scheduler.fail(request, f"token handling failed: {e}")
                applied.append(request)
            if counted:
                self.metrics.on_tokens(counted)
            if d.drafts:
                emitted = sum(tokens[row] >= 0 for row in range(len(d.samplers) * group))
                self.metrics.on_drafts(len(d.drafts), sum(d.drafts), accepted=emitted - len(d.samplers))
        return applied

    @staticmethod
    def _record_prompt_logprobs(request: Request, lps, first: int, n: int, row: int) -> None:
        """The prompt logprobs of chunk [first, first + n) of `request`, whose rows start at `row`: the row at
        position p gives prompt token p + 1's (position 0's is None: nothing precedes it)."""
        if request.is_finished:
            return
        if first == 0:
            request.prompt_logprobs = [None]
        prompt, top_n = request.prompt_ids, request.num_prompt_logprobs
        for p in range(first, min(first + n, len(prompt) - 1)):
            r = row + p - first
            request.prompt_logprobs.append(TokenLogprob.of(prompt[p + 1], lps.logprobs[r], lps.top_ids[r],
                                                           lps.top_logprobs[r], top_n))

    def _apply(self, request: Request, token: int, sampled, row: int) -> bool:
        """Record `token`, row `row`'s, for `request`: logprobs, the first token's time, then the scheduler. False
        for a token sampled past the request's end (it stopped at the step before)."""
        if request.is_finished:
            self.scheduler.append_token(request, token)
            return False
        if request.params.logprobs is not None:
            request.logprobs.append(TokenLogprob.of(token, sampled.logprobs[row], sampled.top_ids[row],
                                                    sampled.top_logprobs[row], request.params.logprobs,
                                                    text_offset=len(request.text)))
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
            self.metrics.on_first_token(request.first_token_time - request.arrival_time)
        self.scheduler.append_token(request, token)
        return True

    def _after_device_fault(self, failed: list[Request], error: str) -> None:
        """A compiled call raised: fail `failed`. When the call consumed the donated device state, allocate a fresh
        one and fail every running request whose context it held too, and forget what was in flight (its outputs
        died with the state); waiting requests hold no KV and go on."""
        lost = not self.runner.kv_cache_is_usable()
        if lost:
            log.error("the failed call consumed the device state: reallocating it, failing the running requests")
            error += " (the KV cache was lost)"
            self.runner.reset_state()
            self.metrics.on_kv_cache_reset()
        for request in failed:
            self.scheduler.fail(request, error)
        if lost:
            for request in list(self.scheduler.running):
                self.scheduler.fail(request, error)
            self._forget_in_flight()
