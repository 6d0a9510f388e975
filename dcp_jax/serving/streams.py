"""A request's stream: the deltas the engine sends as a request advances, and the sinks that carry them.

`Stream.delta(request)` turns what a request gained since the last call (tokens, final text, logprobs, the finish)
into one `StreamEvent`, or None when there is nothing to say yet. Text is held back while its tail could still
start a stop string or is an unfinished UTF-8 sequence (`Request.stream_boundary`).
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
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None


class Sink(Protocol):
    def put(self, event: StreamEvent) -> None: ...


class AsyncSink:
    """Hands events from the engine thread to an asyncio queue on `loop`."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, event: StreamEvent) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


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
        if not tokens and not text and not request.is_finished:
            return None
        wants_logprobs = request.params.logprobs is not None
        event = StreamEvent(
            request_id=request.request_id, tag=self.tag, token_ids=tokens, text=text,
            logprobs=request.logprobs[self.sent_tokens:] if wants_logprobs else None,
            finish_reason=request.finish_reason, error=request.error,
            prompt_token_ids=None if self.started else request.prompt_ids,
            prompt_logprobs=None if self.started else request.prompt_logprobs,
        )
        self.started = True
        self.sent_tokens += len(tokens)
        self.sent_chars = max(self.sent_chars, boundary)
        return event
