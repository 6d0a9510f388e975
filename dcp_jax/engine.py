"""The serving loop: scheduler -> plan -> prefill / decode programs -> sampling -> scheduler update -> streams.

`Engine` owns the model runner (weights, the paged DCP KV pool, the compiled programs), the `Scheduler` and a
background thread that runs the loop. Every decode bucket and every prefill length is compiled at start-up (one
tqdm bar), so serving never traces; `compiles_after_warmup` counts any compile that happens anyway. Requests come
in from any thread through `add_request` (validated at once, ValueError before anything is queued) and `abort`;
each request streams `StreamEvent`s (token and text deltas, logprobs, finish reason) into its own sink. A request
that fails (sampling, detokenizing, its prefill) fails alone; the loop goes on. The prefill and decode programs
donate the KV cache: when one raises after consuming it, the cache is reallocated and every running request (whose
context it held) fails; the waiting ones go on. A stopped engine refuses new requests (`EngineStoppedError`) and
ends every stream still open with an "abort" event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from dcp_jax.config import DEFAULT_BUCKETS
from dcp_jax.loading import load_model
from dcp_jax.metrics import ServingMetrics
from dcp_jax.sampling import SamplingParams, log_softmax, sample, top_logprobs
from dcp_jax.scheduler import Request, RequestStatus, Scheduler

log = logging.getLogger(__name__)

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = [0]
_listener_lock = threading.Lock()
_listener_registered = [False]


def _on_jax_event(event: str, duration_s: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE_EVENT:
        _compiles[0] += 1


def _count_compiles() -> None:
    """Count every XLA compile of this process (one listener, registered once)."""
    import jax

    with _listener_lock:
        if not _listener_registered[0]:
            jax.monitoring.register_event_duration_secs_listener(_on_jax_event)
            _listener_registered[0] = True


class EngineStoppedError(RuntimeError):
    """The engine's loop is not running: nothing would ever serve the request."""


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One position: the token's logprob and the top-N {token id: logprob} (the token itself included).
    text_offset: for a generated token, where its text starts in the request's generated text (the characters
    decoded before it; past a stop string's cut it exceeds the returned text). 0 for prompt tokens."""

    token_id: int
    logprob: float
    top: dict[int, float]
    text_offset: int = 0

    @classmethod
    def of(cls, logprobs: np.ndarray, token: int, top_n: int, text_offset: int = 0) -> TokenLogprob:
        """From a log-softmax row: the token's logprob and `sampling.top_logprobs` (the one helper for both
        the engine and the offline LLM)."""
        token = int(token)
        return cls(token, float(logprobs[token]), top_logprobs(logprobs, token, top_n), text_offset)


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """A delta of one request. The first event carries `prompt_logprobs` when they were asked for (position 0
    is None: nothing precedes it); the last one has `finish_reason` ("stop", "length", "abort", "error")."""

    request_id: str
    tag: Any
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None


class Sink(Protocol):
    def put(self, event: StreamEvent) -> None: ...


class _AsyncSink:
    """Hands events from the engine thread to an asyncio queue on `loop`."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, event: StreamEvent) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


@dataclasses.dataclass
class _Stream:
    sink: Sink
    tag: Any
    want_logprobs: int | None
    sent_tokens: int = 0
    sent_chars: int = 0
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    first_token_time: float | None = None
    started: bool = False


class Engine:
    """A continuous-batching server engine over one model on `tp` devices (KV split over `dcp` ranks).

    model: a preset name (random weights; `tiny` is the embedded default) or a HF checkpoint directory.
    prompt_logprobs: also compile the all-positions prefill, so requests may ask for prompt logprobs (echo).
    index_cache: the indexer key cache, "exact" (model dtype, HF's math) or "fp8" (e4m3 keys and an f32 scale per
    token, scored with fp8 queries).
    latent_cache: the MLA latent cache, "exact" (the pool's dtype) or "fp8" (656 B/token at DeepSeek's sizes: e4m3
    latent with an f32 scale per 128 columns, bf16 rope; attention reads the dequantized values, and on a GPU its
    kernel computes in bf16).
    """

    def __init__(self, model: str = "tiny", *, dcp: int = 1, interleave: int = 1, tp: int | None = None,
                 page_size: int = 16, num_pages: int | None = None, max_num_seqs: int = 8, max_model_len: int = 512,
                 bucket_ladder: Sequence[int] = DEFAULT_BUCKETS, max_prefills_per_step: int = 4,
                 kernels: str = "auto", seed: int = 0, num_layers: int | None = None, index_cache: str = "exact",
                 latent_cache: str = "exact", prompt_logprobs: bool = True, compilation_cache_dir: str | None = None,
                 progress: bool = True):
        import jax

        if compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", os.fspath(compilation_cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        _count_compiles()
        loaded = load_model(model, dcp=dcp, interleave=interleave, tp=tp, page_size=page_size, num_pages=num_pages,
                            max_num_seqs=max_num_seqs, max_model_len=max_model_len, bucket_ladder=bucket_ladder,
                            kernels=kernels, seed=seed, num_layers=num_layers, index_cache=index_cache,
                            latent_cache=latent_cache)
        self.config, self.model_name = loaded.engine, loaded.name
        self.cfg, self.parallel, self.seed = loaded.cfg, loaded.parallel, seed
        self.has_prompt_logprobs = prompt_logprobs
        self.tokenizer, self.runner, self.backend = loaded.tokenizer, loaded.runner, loaded.backend
        self.scheduler = Scheduler(self.config, self.parallel.dcp, eos_token_id=self.cfg.eos_token_id,
                                   detokenize=self.tokenizer.decode, max_prefills_per_step=max_prefills_per_step)
        self.metrics = ServingMetrics(self._gauges)
        self._compiles_at_start = _compiles[0]
        self.warmup(progress=progress)
        self._compiles_after_warmup = _compiles[0]
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}  # the engine thread's
        self._ids = itertools.count()
        # Guards `_accepting` and `_live_ids` (the ids of requests queued and not yet finished), both touched
        # by callers' threads; holding it while queueing means no request slips in after the loop's last drain.
        self._lock = threading.Lock()
        self._accepting = False
        self._live_ids: set[str] = set()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._gauge_values = dict(running_requests=0, waiting_requests=0)

    # ---- start-up ---------------------------------------------------------------------------------------
    def warmup(self, *, progress: bool = True) -> None:
        """Compile every decode bucket and every prefill length (and the all-logits prefill when prompt
        logprobs are on) once, so no request ever waits for a compile."""
        from tqdm import tqdm

        variants = (False, True) if self.has_prompt_logprobs else (False,)
        work = [("decode", rows) for rows in self.config.buckets]
        work += [("prefill", t, all_logits) for all_logits in variants for t in self.runner.prefill_lengths]
        bar = tqdm(work, desc="compiling buckets", unit="program", disable=not progress)
        for item in bar:
            bar.set_postfix_str(" ".join(map(str, item)))
            if item[0] == "decode":
                self.runner.decode_step.compile(self.runner.params, self.runner.kv_cache, item[1])
            else:
                _, t, all_logits = item
                # Pages of the free pool take the writes: they hold no live context, and a request reads
                # only what its own prefill and decode steps wrote.
                table = [0] * self.scheduler.blocks_for(t)
                self.runner.prefill([[0] * t], [table], all_logits=all_logits)
        bar.close()
        self.num_programs = len(work)

    @property
    def compile_count(self) -> int:
        """XLA compiles since this engine began its warm-up."""
        return _compiles[0] - self._compiles_at_start

    @property
    def compiles_after_warmup(self) -> int:
        return _compiles[0] - self._compiles_after_warmup

    def _gauges(self) -> dict[str, float]:
        alloc = self.scheduler.allocator
        return dict(self._gauge_values, kv_pages_used=alloc.num_used, kv_pages_free=alloc.num_free,
                    kv_pages_total=alloc.num_pages, compiles_total=self.compile_count,
                    compiles_after_warmup_total=self.compiles_after_warmup, programs_compiled=self.num_programs)

    # ---- the thread -------------------------------------------------------------------------------------
    def start(self) -> Engine:
        """Start the loop's thread (again after `stop`)."""
        if self._thread is None:
            self._stopping.clear()
            with self._lock:
                self._accepting = True
            self._thread = threading.Thread(target=self._loop, name="dcp-jax-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_alive(self) -> bool:
        """The loop runs and takes requests."""
        return self._accepting and self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._drain_inbox(block=not self.scheduler.has_work)
                    if self._stopping.is_set():
                        break
                    if self.scheduler.has_work:
                        self.step()
                except Exception:  # a bug in the loop itself: log it, fail what is live, keep serving
                    log.exception("engine step failed")
                    for request in [*self.scheduler.running, *self.scheduler.waiting]:
                        self.scheduler.fail(request, "internal engine error")
                        self._emit(request)
        finally:
            self._shut_down()

    def _shut_down(self) -> None:
        """Refuse new requests, then end every open stream with an abort: the queued and running requests and
        the ones still in the inbox."""
        with self._lock:
            self._accepting = False
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                request, stream = payload
                request.status, request.error = RequestStatus.FINISHED_ABORTED, "the engine stopped"
                self._streams[request.request_id] = stream
                self._emit(request)
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            self.scheduler.abort(request.request_id)
            request.error = "the engine stopped"
            self._emit(request)

    def _drain_inbox(self, *, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add":
                request, stream = payload  # add_request refused a duplicate id: this one is new
                self._streams[request.request_id] = stream
                try:
                    self.scheduler.add(request)
                    self.metrics.on_prompt(len(request.prompt_ids))
                except ValueError as e:
                    request.status, request.error = RequestStatus.FINISHED_ERROR, str(e)
                    self._emit(request)
            elif kind == "abort":
                request = self.scheduler.abort(payload)
                if request is not None:
                    self._emit(request)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    # ---- requests ---------------------------------------------------------------------------------------
    def validate(self, prompt_ids: Sequence[int], params: SamplingParams, prompt_logprobs: int | None = None) -> None:
        """ValueError for a request that can never run (before it is queued)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if prompt_ids and (min(prompt_ids) < 0 or max(prompt_ids) >= self.cfg.vocab_size):
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        if prompt_logprobs is not None and not self.has_prompt_logprobs:
            raise ValueError("this engine was started without prompt logprobs")
        self.scheduler.check_fits(len(prompt_ids), params.max_tokens)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink, *, tag: Any = None,
                    prompt_logprobs: int | None = None, request_id: str | None = None) -> str:
        """Queue a request (from any thread); its events go to `sink.put`. Returns its id. ValueError for a
        request that can never run or an id already live; EngineStoppedError when the loop is not running."""
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, params, prompt_logprobs)
        number = next(self._ids)
        request_id = request_id or f"req-{number}"
        seed = params.seed if params.seed is not None else (self.seed, number)
        request = Request(request_id, prompt_ids, params, rng=np.random.default_rng(seed),
                          prompt_logprobs=prompt_logprobs)
        with self._lock:
            if not self._accepting:
                raise EngineStoppedError("the engine is not running")
            if request_id in self._live_ids:
                raise ValueError(f"duplicate request_id {request_id!r}: a request of that id is still running")
            self._live_ids.add(request_id)
            self._inbox.put(("add", (request, _Stream(sink, tag, params.logprobs))))
        return request_id

    def abort(self, request_id: str) -> None:
        """Cancel a request (from any thread); its pages return to the pool on the next step."""
        self._inbox.put(("abort", request_id))

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, **kw) -> Iterator[StreamEvent]:
        """Blocking stream of one request's events (the engine must be started)."""
        sink: queue.Queue = queue.Queue()
        request_id = self.add_request(prompt_ids, params, sink, **kw)
        try:
            while True:
                event = sink.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self.abort(request_id)  # a consumer that stops early frees the pages (no-op when finished)

    async def generate_async(self, prompt_ids: Sequence[int], params: SamplingParams, **kw
                             ) -> AsyncIterator[StreamEvent]:
        """The same stream for an asyncio consumer."""
        sink = _AsyncSink(asyncio.get_running_loop())
        request_id = self.add_request(prompt_ids, params, sink, **kw)
        try:
            while True:
                event = await sink.queue.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self.abort(request_id)

    # ---- one step ---------------------------------------------------------------------------------------
    def step(self) -> None:
        """Schedule, prefill the admitted requests, decode the batch, sample, update, stream."""
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
        self._gauge_values = dict(running_requests=sched.num_running, waiting_requests=sched.num_waiting)
        for request in dict.fromkeys([*plan.prefills, *plan.decodes]):
            self._emit(request)

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
        want = request.prompt_logprobs is not None and not request.is_resumed
        logits, _ = self.runner.prefill([request.prefill_ids], [request.pages], all_logits=want)
        if request.is_resumed:
            return  # recompute after preemption: the next token is already sampled
        if want:
            stream = self._streams[request.request_id]
            stream.prompt_logprobs = self._prompt_logprobs(request.prompt_ids, logits[0], request.prompt_logprobs)
            last = logits[0, len(request.prompt_ids) - 1]
        else:
            last = logits[0]
        self._sample(request, last)

    @staticmethod
    def _prompt_logprobs(prompt: list[int], logits: np.ndarray, top_n: int) -> list[TokenLogprob | None]:
        lps = log_softmax(logits[: len(prompt) - 1])
        return [None] + [TokenLogprob.of(lps[pos - 1], prompt[pos], top_n) for pos in range(1, len(prompt))]

    def _sample(self, request: Request, logits: np.ndarray) -> None:
        try:
            token = sample(logits, request.params, request.rng)
            stream = self._streams[request.request_id]
            if stream.want_logprobs is not None:
                stream.logprobs.append(TokenLogprob.of(log_softmax(logits), token, stream.want_logprobs,
                                                       text_offset=len(request.text)))
            if stream.first_token_time is None:
                stream.first_token_time = time.monotonic()
                self.metrics.on_first_token(stream.first_token_time - request.arrival_time)
            self.scheduler.append_token(request, token)
            self.metrics.on_tokens(1)
        except Exception as e:
            log.exception("sampling %s failed", request.request_id)
            self.scheduler.fail(request, f"sampling failed: {e}")

    def _emit(self, request: Request) -> None:
        stream = self._streams.get(request.request_id)
        if stream is None:
            return
        tokens = request.output_ids[stream.sent_tokens:]
        boundary = request.stream_boundary()
        text = request.text[stream.sent_chars:boundary]
        finished = request.is_finished
        if not tokens and not text and not finished:
            return  # nothing to say yet (still queued, or text held back)
        event = StreamEvent(
            request_id=request.request_id, tag=stream.tag, token_ids=tokens, text=text,
            logprobs=stream.logprobs[stream.sent_tokens:] if stream.want_logprobs is not None else None,
            finish_reason=request.finish_reason, error=request.error,
            prompt_token_ids=None if stream.started else request.prompt_ids,
            prompt_logprobs=None if stream.started else stream.prompt_logprobs,
        )
        stream.started = True
        stream.sent_tokens += len(tokens)
        stream.sent_chars = max(stream.sent_chars, boundary)
        if finished:
            del self._streams[request.request_id]
            with self._lock:
                self._live_ids.discard(request.request_id)
            if stream.first_token_time is not None:
                now = time.monotonic()
                self.metrics.on_finish(request.finish_reason, e2e_s=now - request.arrival_time,
                                       decode_s=now - stream.first_token_time, output_tokens=len(request.output_ids))
            else:
                self.metrics.on_finish(request.finish_reason, e2e_s=time.monotonic() - request.arrival_time,
                                       decode_s=0.0, output_tokens=0)
        try:
            stream.sink.put(event)
        except Exception:  # nobody can hear this request any more: free its pages and forget it
            log.exception("sink of %s failed", request.request_id)
            if not finished:
                self.scheduler.abort(request.request_id)
                del self._streams[request.request_id]
                with self._lock:
                    self._live_ids.discard(request.request_id)

    # ---- introspection ----------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return self.scheduler.allocator.num_free

    @property
    def num_pages(self) -> int:
        return self.scheduler.allocator.num_pages

