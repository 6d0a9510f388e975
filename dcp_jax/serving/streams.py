"""A request's stream: the deltas the engine sends as a request advances, and the sinks that carry them.

`Stream.delta(request)` turns what a request gained since the last call (tokens, final text, logprobs, the finish)
into one `StreamEvent`, or None when there is nothing to say yet. Text is held back while its tail could still
start a stop string or is an unfinished UTF-8 sequence (`Request.stream_boundary`). `output_text` and
`stop_reason` give a finished request's text as vLLM returns it (the stop string kept when asked) and what stopped it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Protocol

from dcp_jax.host.sampling import TokenLogprob
from dcp_jax.host.scheduler import Request


@dataclasses.dataclass(slots=True)  # not frozen: a frozen init costs 3x, for an event of every token
class StreamEvent:
    """A delta of one request (its readers never change it). The first event carries `prompt_logprobs` when they
    were asked for (position 0 is None: nothing precedes it); the last one has `finish_reason` ("stop", "length",
    "abort", "error")."""

    request_id: str
    tag: Any
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    # With finish_reason "stop": the stop string or stop token id that ended it; None for EOS (vLLM's stop_reason).
    stop_reason: str | int | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None


class Sink(Protocol):
    """Where the engine puts events (from its thread). A sink may also have `flush()`, which the engine calls once
    after each turn of its loop that put events into it."""

    def put(self, event: StreamEvent) -> None: ...


class LoopSink:
    """One sink for many requests consumed on an asyncio loop: `put` (the engine thread) collects a step's events,
    `flush` hands them to the loop in one call (one wake-up a step, not one per event), and the loop puts each
    event into the queue its request was routed to. `route` before `Engine.add_request`, `unroute` when done (on
    the loop); events of a request routed nowhere are dropped."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._batch: list[StreamEvent] = []  # the engine thread's
        self._queues: dict[str, asyncio.Queue] = {}  # the loop's

    def route(self, request_id: str, queue: asyncio.Queue) -> None:
        self._queues[request_id] = queue

    def is_routed(self, request_id: str) -> bool:
        return request_id in self._queues

    def unroute(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def put(self, event: StreamEvent) -> None:
        self._batch.append(event)

    def flush(self) -> None:
        batch, self._batch = self._batch, []
        if batch:
            self.loop.call_soon_threadsafe(self._deliver, batch)

    def _deliver(self, batch: list[StreamEvent]) -> None:
        for event in batch:
            queue = self._queues.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)


@dataclasses.dataclass
class Stream:
    """Where one request's events go, and how much of it they have carried so far."""

    sink: Sink
    tag: Any
    sent_tokens: int = 0
    sent_chars: int = 0
    started: bool = False

    def delta(self, request: Request) -> StreamEvent | None:
        """The event for what `request` gained since the last delta; None when it has nothing to say yet (still
        queued, or its text held back)."""
        tokens = request.output_ids[self.sent_tokens:]
        boundary = request.stream_boundary()
        text = request.text[self.sent_chars:boundary]
        finished = request.is_finished
        if not tokens and not text and not finished:
            return None
        stop = stop_reason(request) if finished else None
        if isinstance(stop, str) and request.params.include_stop_str_in_output:
            text += stop
        wants_logprobs = request.params.logprobs is not None
        event = StreamEvent(
            request_id=request.request_id, tag=self.tag, token_ids=tokens, text=text,
            logprobs=request.logprobs[self.sent_tokens:] if wants_logprobs else None,
            finish_reason=request.finish_reason, stop_reason=stop, error=request.error,
            prompt_token_ids=None if self.started else request.prompt_ids,
            prompt_logprobs=None if self.started else request.prompt_logprobs,
        )
        self.started = True
        self.sent_tokens += len(tokens)
        self.sent_chars = max(self.sent_chars, boundary)
        return event


def stop_reason(request: Request) -> str | int | None:
    """What ended a request that finished with "stop": the stop string its text was cut before, else the stop token
    id it ended on, else None (EOS; or another finish)."""
    if request.finish_reason != "stop":
        return None
    params = request.params
    # The scheduler cuts the text before the stop string; the detokenizer's text goes on past the cut.
    full = request.detokenizer.text if request.detokenizer is not None else request.text
    stop = next((stop for stop in params.stop if full.startswith(stop, len(request.text))), None)
    if stop is None and request.output_ids and request.output_ids[-1] in params.stop_token_ids:
        return request.output_ids[-1]
    return stop


def output_text(request: Request) -> str:
    """A finished request's text: the stop string that ended it appended when `include_stop_str_in_output`."""
    stop = stop_reason(request)
    if isinstance(stop, str) and request.params.include_stop_str_in_output:
        return request.text + stop
    return request.text
