"""The serving engine: the shared `ServingCore` stepped by a background thread, with a stream per request.

`Engine` owns the core (the model runner with the paged DCP KV pool and the compiled programs, and the
`Scheduler`) and a thread that runs the loop. Every bucket of the step program is compiled at start-up (one tqdm
bar), so serving never traces; `compiles_after_warmup` counts any compile that happens anyway.
Requests come in from any thread through `add_request` (validated at once, ValueError before anything is queued)
and `abort`; each request streams `StreamEvent`s (token and text deltas, logprobs, finish reason) into its sink.
A sink with a `flush()` is flushed once after each turn of the loop that gave it events, so one sink shared by many
requests (`streams.LoopSink`) hands a whole step's events to an asyncio loop at once. A request that fails fails
alone; the loop goes on. A stopped engine refuses new requests (`EngineStoppedError`) and ends every stream still
open with an "abort" event.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from dcp_jax.host.sampling import SamplingParams
from dcp_jax.host.scheduler import Request, RequestStatus, Scheduler
from dcp_jax.runtime.forward import GREEDY, PROMPT_LOGPROBS, SAMPLED, SERVING_KIND_NAMES
from dcp_jax.runtime.multihost import Distributed, FollowerChannel, StepChannel, connect, follow
from dcp_jax.serving.core import ServingCore
from dcp_jax.serving.engine_args import DEFAULT_MODEL, EngineArgs
from dcp_jax.serving.loading import load_model
from dcp_jax.serving.metrics import ServingMetrics
from dcp_jax.serving.streams import LoopSink, Sink, Stream, StreamEvent

log = logging.getLogger(__name__)
# A multi-host leader that lost a process fails its streams from the watcher's thread when its loop did not within
# the grace, and exits this long after (`Engine._on_peer_lost`).
PEER_LOST_GRACE_S, PEER_LOST_EXIT_S = 1.0, 3.0

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


def _program_label(kind_name: str, rows: int) -> str:
    """'greedy, 8 rows'."""
    return f"{kind_name}, {rows} rows"


class EngineStoppedError(RuntimeError):
    """The engine's loop is not running: nothing would ever serve the request."""


class Engine:
    """A continuous-batching server engine over one model on `tp` devices (KV split over `dcp` ranks).

    model and every keyword but the engine's own are engine arguments (`EngineArgs`, documented there once; `LLM`
    takes the same). Every bucket of `bucket_ladder` (`EngineConfig.buckets`) is compiled at start-up, and a step
    runs in the smallest that holds its rows. The engine's own:
    prompt_logprobs: also compile the programs that return every row's logprobs, so requests may ask for prompt
    logprobs (echo).
    progress: report the start-up compiles as they go (a bar on a terminal, else a log line each).
    Multi-host: process 0's engine serves and schedules; every other process builds the same engine and runs
    `follow()` instead of `start()`.
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, prompt_logprobs: bool = True, progress: bool = True,
                 **kwargs):
        args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.args = args
        self.distributed = Distributed.of(args.coordinator_address, args.num_processes, args.process_id)
        _count_compiles()
        loaded = load_model(args, distributed=self.distributed)
        self.model_name, self.dtype = loaded.name, loaded.dtype
        self.model_config, self.parallel_config, self.engine_config = loaded.cfg, loaded.parallel, loaded.engine
        self.tokenizer, self.runner, self.backend = loaded.tokenizer, loaded.runner, loaded.backend
        self.scheduler = Scheduler(self.engine_config, self.runner.layout, eos_token_id=self.model_config.eos_token_id,
                                   new_detokenizer=self.tokenizer.new_detokenizer,
                                   enable_prefix_caching=args.enable_prefix_caching)
        self.metrics = ServingMetrics(self._live_metrics)
        self.core = ServingCore(self.runner, self.scheduler, vocab_size=self.model_config.vocab_size, seed=args.seed,
                                has_prompt_logprobs=prompt_logprobs, metrics=self.metrics,
                                async_scheduling=args.async_scheduling)
        self._compiles_at_start = _compiles[0]
        self.warmup(progress=progress)
        self._compiles_after_warmup = _compiles[0]
        # What start-up built (model, programs) lives as long as the engine: out of the collector's full passes,
        # which otherwise rescan it while serving (vLLM freezes it too).
        gc.freeze()
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, Stream] = {}  # the engine thread's
        self._unflushed: dict[int, Sink] = {}  # sinks given events since the last flush (the engine thread's)
        # Guards `_accepting` and `_live_ids` (the ids of requests queued and not yet finished), both touched
        # by callers' threads; holding it while queueing means no request slips in after the loop's last drain.
        self._lock = threading.Lock()
        self._accepting = False
        self._live_ids: set[str] = set()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._streams_failed = threading.Event()
        self._channel = None if self.distributed is None else connect(
            self.distributed, self.runner, SERVING_KIND_NAMES, on_lost=self._on_peer_lost)

    def follow(self) -> None:
        """A multi-host follower (process_id > 0): run the leader's programs until it stops (returns) or is gone
        (`multihost.PeerLost`)."""
        if not isinstance(self._channel, FollowerChannel):
            raise RuntimeError("follow() is for the processes after process 0 of a multi-host deployment")
        try:
            follow(self.runner, self._channel, SERVING_KIND_NAMES)
        finally:
            self._channel.close()

    def _on_peer_lost(self, message: str) -> None:
        """A process of the deployment is gone (on the channel's watcher thread, or the loop's when a send found it):
        the engine cannot go on. Nothing new is taken; the loop ends every open stream with the error; when it does
        not within PEER_LOST_GRACE_S (it waits in a step's collective with the lost process, which never returns),
        this thread does; PEER_LOST_EXIT_S later (for the events to reach the clients) the process exits with
        status 1 (jax.distributed's heartbeat would end it a little later)."""
        log.error("%s: failing every request in flight and exiting", message)
        with self._lock:
            self._accepting = False
        try:
            if threading.current_thread() is self._thread:
                self._fail_open_streams(message)
            else:
                self._inbox.put(("peer_lost", message))
                if not self._streams_failed.wait(PEER_LOST_GRACE_S):
                    self._fail_open_streams(message)
        finally:
            threading.Timer(PEER_LOST_EXIT_S, os._exit, args=(1,)).start()

    def _fail_open_streams(self, message: str) -> None:
        """End every open stream with an error event `message` (a lost process)."""
        if self._streams_failed.is_set():
            return
        self._streams_failed.set()
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            request.status, request.error = RequestStatus.FINISHED_ERROR, message  # an error event
            self._emit(request)
        self._flush_sinks()

    # ---- start-up ---------------------------------------------------------------------------------------
    def warmup(self, *, progress: bool = True) -> None:
        """Compile every bucket's greedy and drawing programs (and the prompt-logprobs ones when they are on) once,
        so no request ever waits for a compile: lowered in turn, then compiled one per CPU core at once."""
        from tqdm import tqdm

        work = self.runner.programs((GREEDY, SAMPLED, PROMPT_LOGPROBS) if self.core.has_prompt_logprobs
                                    else (GREEDY, SAMPLED))
        begin = time.monotonic()
        # A bar on a terminal only (disable=None); a log line a program elsewhere.
        bar = tqdm(total=len(work), desc="compiling buckets", unit="program", disable=None if progress else True)
        done = [0]

        def compiled(kind_name, rows):
            label = _program_label(kind_name, rows)
            done[0] += 1
            bar.set_postfix_str(label)
            bar.update()
            if progress and bar.disable:
                log.info("compiled program %d/%d: %s", done[0], len(work), label)

        self.runner.compile_all(work, workers=os.cpu_count() or 1, on_compiled=compiled)
        bar.close()
        self.num_programs = len(work)
        log.info("compiled %d programs in %.1f s", len(work), time.monotonic() - begin)

    @property
    def compile_count(self) -> int:
        """XLA compiles since this engine began its warm-up."""
        return _compiles[0] - self._compiles_at_start

    @property
    def compiles_after_warmup(self) -> int:
        return _compiles[0] - self._compiles_after_warmup

    def _live_metrics(self) -> dict[str, float]:
        alloc = self.scheduler.allocator
        return dict(kv_pages_used=alloc.num_used, kv_pages_free=alloc.num_free, kv_pages_capacity=alloc.num_pages,
                    compiles=self.compile_count, compiles_after_warmup=self.compiles_after_warmup,
                    programs_compiled=self.num_programs)

    # ---- the thread -------------------------------------------------------------------------------------
    def start(self) -> Engine:
        """Start the loop's thread (again after `stop`, on one host: a multi-host deployment stops for good)."""
        if self._channel is not None and self._channel.failure:
            raise RuntimeError(f"this multi-host engine cannot serve again: {self._channel.failure}")
        if self.distributed is not None and not self.distributed.is_leader:
            raise RuntimeError("processes after process 0 of a multi-host deployment run follow(), not start()")
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
        if isinstance(self._channel, StepChannel):  # multi-host: the followers stop too
            self._channel.close()

    @property
    def is_alive(self) -> bool:
        """The loop runs and takes requests."""
        return self._accepting and self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._drain_inbox(block=not self.core.has_work)
                    if self._stopping.is_set():
                        break
                    if self.core.has_work:
                        self.step()
                except Exception:  # a bug in the loop itself (or a lost process): log it, fail what is live
                    log.exception("engine step failed")
                    lost = self._channel.failure if self._channel is not None else None
                    for request in self.core.fail_live(lost or "internal engine error"):
                        self._emit(request)
                self._flush_sinks()
        finally:
            self._shut_down()
            self._flush_sinks()

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
            self.core.abort(request.request_id)
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
                    self.core.add(request)
                except ValueError as e:
                    request.status, request.error = RequestStatus.FINISHED_ERROR, str(e)
                    self._emit(request)
            elif kind == "abort":
                request = self.core.abort(payload)
                if request is not None:
                    self._emit(request)
            elif kind == "peer_lost":
                self._fail_open_streams(payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                self._publish_gauges()  # an abort may leave nothing to step: the gauges still see it
                return

    # ---- requests ---------------------------------------------------------------------------------------
    def validate(self, prompt_ids: Sequence[int], params: SamplingParams, prompt_logprobs: int | None = None) -> None:
        """ValueError for a request that can never run (before it is queued)."""
        self.core.validate(prompt_ids, params, prompt_logprobs)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink, *, tag: Any = None,
                    prompt_logprobs: int | None = None, request_id: str | None = None) -> str:
        """Queue a request (from any thread); its events go to `sink.put`. Returns its id. ValueError for a
        request that can never run or an id already live; EngineStoppedError when the loop is not running."""
        request = self.core.make_request(prompt_ids, params, request_id=request_id, prompt_logprobs=prompt_logprobs)
        request_id = request.request_id
        with self._lock:
            if not self._accepting:
                raise EngineStoppedError("the engine is not running")
            if request_id in self._live_ids:
                raise ValueError(f"duplicate request_id {request_id!r}: a request of that id is still running")
            self._live_ids.add(request_id)
            self._inbox.put(("add", (request, Stream(sink, tag))))
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
        sink = LoopSink(asyncio.get_running_loop())
        events: asyncio.Queue = asyncio.Queue()
        request_id = kw.pop("request_id", None) or f"async-{uuid.uuid4().hex}"
        sink.route(request_id, events)
        request_id = self.add_request(prompt_ids, params, sink, request_id=request_id, **kw)
        try:
            while True:
                event = await events.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self.abort(request_id)
            sink.unroute(request_id)

    # ---- one step ---------------------------------------------------------------------------------------
    def step(self) -> None:
        """One core step, then stream what it changed (the loop flushes the sinks after it)."""
        touched = self.core.step()
        self._publish_gauges()
        for request in touched:
            self._emit(request)

    def _publish_gauges(self) -> None:
        """The queue's sizes for the metrics, after every change the loop makes."""
        self.metrics.set_queue(running=self.scheduler.num_running, waiting=self.scheduler.num_waiting)

    def _emit(self, request: Request) -> None:
        stream = self._streams.get(request.request_id)
        if stream is None:
            return
        event = stream.delta(request)
        if event is None:
            return
        finished = request.is_finished
        if finished:
            self._forget(request.request_id)
            now = time.monotonic()
            first = request.first_token_time
            self.metrics.on_finish(request.finish_reason, e2e_s=now - request.arrival_time,
                                   decode_s=0.0 if first is None else now - first,
                                   output_tokens=0 if first is None else len(request.output_ids))
        try:
            stream.sink.put(event)
        except Exception:  # nobody can hear this request any more: free its pages and forget it
            log.exception("sink of %s failed", request.request_id)
            if not finished:
                self.core.abort(request.request_id)
                self._forget(request.request_id)
            return
        self._unflushed[id(stream.sink)] = stream.sink

    def _flush_sinks(self) -> None:
        """Hand over what the sinks collected since the last flush (sinks without `flush` took each event)."""
        sinks, self._unflushed = self._unflushed, {}
        for sink in sinks.values():
            flush = getattr(sink, "flush", None)
            if flush is None:
                continue
            try:
                flush()
            except Exception:  # a consumer gone (its loop closed): its requests' events are lost, not the loop
                log.exception("flushing a sink failed")

    def _forget(self, request_id: str) -> None:
        del self._streams[request_id]
        with self._lock:
            self._live_ids.discard(request_id)

    # ---- introspection ----------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return self.scheduler.allocator.num_free

    @property
    def num_pages(self) -> int:
        return self.scheduler.allocator.num_pages
