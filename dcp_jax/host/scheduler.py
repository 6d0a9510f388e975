"""Continuous-batching scheduler over the paged DCP KV pool (pure Python, no jax).

Owns the request states, the waiting queue and the running batch. Pages are handed out in virtual blocks of
`page_size * dcp` tokens: one page id names the same page on every DCP rank, so one block costs one id from the
`PageAllocator`. Each step the scheduler

1. grows every running request's block table to hold its next decode token; when the pool is empty it preempts
   the youngest running request (its pages go back to the pool, it returns to the front of the queue and is
   recomputed by a prefill of prompt + generated tokens when readmitted), so a full pool never crashes a step;
2. admits waiting requests first come first served while a batch slot and the pages of their prefill plus the
   first decode token (never more than `max_context_len` can ever need) are free (nothing is admitted in a step
   that preempted);
3. hands the engine a `StepPlan`: the requests to prefill, then the decode rows (the new ones join the batch).

The engine reports sampled tokens with `append_token`, which applies the stop rules (EOS / stop token ids, stop
strings, max_tokens; `check_fits` already keeps prompt + max_tokens within max_model_len) and frees a finished
request's pages at once. `abort` frees a cancelled request's pages wherever it is. Every page taken is returned
exactly once: `check_invariants` proves it.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from dcp_jax.config import EngineConfig
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.page_allocator import BlockTable, PageAllocator

REPLACEMENT_CHAR = "\ufffd"  # what a byte-level decode of an unfinished UTF-8 sequence ends with


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens
    FINISHED_ABORTED = "abort"  # cancelled or disconnected
    FINISHED_ERROR = "error"  # the request failed (and only it)

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


def max_context_len(prompt_len: int, max_tokens: int) -> int:
    """Context a request of this size can ever hold (its KV pages are sized by it): the prompt and every
    generated token but the last, which is sampled and never fed back."""
    return prompt_len + max_tokens - 1


@dataclasses.dataclass(eq=False)
class Request:
    """One sequence. `params` needs max_tokens, stop (tuple of str), stop_token_ids and ignore_eos
    (a `sampling.SamplingParams`); `rng` is the request's own generator, untouched by the scheduler."""

    request_id: str
    prompt_ids: list[int]
    params: Any
    rng: Any = None
    # Top-N logprobs of every prompt token wanted (echo); None: no prompt logprobs.
    num_prompt_logprobs: int | None = None
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    first_token_time: float | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = dataclasses.field(default_factory=list)
    # Virtual-block page ids, one per page_size * dcp tokens of context.
    pages: BlockTable = dataclasses.field(default_factory=BlockTable)
    # Generated text, cut before a stop string once one appears.
    text: str = ""
    num_preemptions: int = 0
    error: str | None = None
    # One `sampling.TokenLogprob` per generated token when params.logprobs is set; the prompt's (None at position
    # 0, which nothing precedes) once prefilled, when num_prompt_logprobs is set.
    logprobs: list = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def context_len(self) -> int:
        """Tokens in context once the last sampled token is fed to the next decode step."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    @property
    def max_context_len(self) -> int:
        """The most context this request can ever hold: the last sampled token is never fed back."""
        return max_context_len(len(self.prompt_ids), self.params.max_tokens)

    @property
    def prefill_ids(self) -> list[int]:
        """Tokens a prefill writes: the prompt for a new request; prompt + generated minus the last (which the
        next decode step feeds) for a preempted one, whose logits are then discarded."""
        return self.prompt_ids if not self.output_ids else self.all_ids[:-1]

    @property
    def is_resumed(self) -> bool:
        return bool(self.output_ids)

    def stream_boundary(self) -> int:
        """How much of `text` is final: all of it once finished; else held back while its tail could still
        start a stop string or is an unfinished UTF-8 byte sequence."""
        if self.is_finished:
            return len(self.text)
        end = len(self.text)
        while end and self.text[end - 1] == REPLACEMENT_CHAR:
            end -= 1
        held = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, end), 0, -1):
                if self.text[end - k:end] == stop[:k]:
                    held = max(held, k)
                    break
        return end - held


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One engine step: prefill `prefills` (each alone), then decode `decodes` (running requests, the new ones
    included) in one program of width `bucket`; `preempted` lost their pages this step."""

    prefills: tuple[Request, ...]
    decodes: tuple[Request, ...]
    preempted: tuple[Request, ...]


class Scheduler:
    """Request queue + running batch over one `PageAllocator`. Not thread-safe: the engine thread owns it."""

    def __init__(self, engine: EngineConfig, layout: DcpLayout, *, eos_token_id: int | None,
                 detokenize: Callable[[Sequence[int]], str], max_prefills_per_step: int = 4):
        if max_prefills_per_step < 1:
            raise ValueError(f"{max_prefills_per_step=} must be >= 1")
        if layout.page_size != engine.page_size:
            raise ValueError(f"{layout=} does not match the engine's page_size={engine.page_size}")
        self.engine = engine
        self.layout = layout
        self.eos_token_id = eos_token_id
        self.detokenize = detokenize
        self.max_prefills_per_step = max_prefills_per_step
        self.allocator = PageAllocator(engine.num_pages)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the youngest, preempted first
        self._requests: dict[str, Request] = {}

    # ---- queue ------------------------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return int(self.layout.virtual_blocks(tokens))

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """ValueError unless a request of this size can ever run (before it is queued)."""
        if prompt_len < 1:
            raise ValueError("the prompt is empty")
        total = prompt_len + max_tokens
        if total > self.engine.max_model_len:
            raise ValueError(f"{prompt_len} prompt tokens + max_tokens={max_tokens} = {total} exceed "
                             f"max_model_len={self.engine.max_model_len}")
        need = self.blocks_for(max_context_len(prompt_len, max_tokens))
        if need > self.engine.num_pages:
            raise ValueError(f"a request of {total} tokens needs {need} KV pages, the pool holds "
                             f"{self.engine.num_pages}")

    def add(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        self.check_fits(len(request.prompt_ids), request.params.max_tokens)
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def abort(self, request_id: str) -> Request | None:
        """Cancel a request wherever it is and free its pages; None when it is unknown or already done."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def fail(self, request: Request, error: str) -> None:
        request.error = error
        self.finish(request, RequestStatus.FINISHED_ERROR)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Move a live request to a finished `status`, out of the queue or batch, and free its pages."""
        assert status.is_finished
        if request.is_finished:
            return
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        self._free(request)
        request.status = status
        self._requests.pop(request.request_id, None)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Grow the running requests' block tables (preempting the youngest when pages run out), admit waiting
        requests, and return the step's plan."""
        preempted = self._grow_running()
        prefills = [] if preempted else self._admit()
        return StepPlan(prefills=tuple(prefills), decodes=tuple(self.running), preempted=tuple(preempted))

    def decode_rows(self, plan: StepPlan) -> list[Request]:
        """The plan's decode rows still running after the prefills (a prefill may have finished one)."""
        return [r for r in plan.decodes if r.status is RequestStatus.RUNNING]

    def bucket_for(self, rows: int) -> int:
        return self.engine.bucket_for(rows)

    def _grow_running(self) -> list[Request]:
        preempted = []
        i = 0
        while i < len(self.running):
            request = self.running[i]
            missing = self.blocks_for(request.context_len) - len(request.pages)
            if missing <= 0:
                i += 1
            elif missing <= self.allocator.num_free:
                request.pages.extend(self.allocator.allocate(missing))
                i += 1
            else:
                victim = self.running.pop()  # the youngest; may be `request` itself
                self._free(victim)
                victim.status = RequestStatus.WAITING
                victim.num_preemptions += 1
                self.waiting.appendleft(victim)
                preempted.append(victim)
        return preempted

    def _admit(self) -> list[Request]:
        admitted = []
        while (self.waiting and len(admitted) < self.max_prefills_per_step
               and len(self.running) < self.engine.max_num_seqs):
            request = self.waiting[0]
            # The prefill's tokens plus the slot of the first decode token, capped by what the request can ever
            # hold (the bound `check_fits` checked, so the head of the queue always fits an empty pool).
            need = self.blocks_for(min(len(request.prefill_ids) + 1, request.max_context_len))
            if need > self.allocator.num_free:
                break  # first come first served: nobody overtakes the head of the queue
            request.pages.extend(self.allocator.allocate(need))
            request.status = RequestStatus.RUNNING
            self.waiting.popleft()
            self.running.append(request)
            admitted.append(request)
        return admitted

    def _free(self, request: Request) -> None:
        if request.pages:
            self.allocator.free(request.pages.clear())

    # ---- results ----------------------------------------------------------------------------------------
    def append_token(self, request: Request, token: int) -> None:
        """Record a sampled token, update the text and apply the stop rules (finishing frees the pages).
        Stop strings cut the text before them; EOS and stop token ids stay in output_ids, not in the text."""
        if request.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {request.request_id!r} is {request.status.value}, not running")
        params = request.params
        request.output_ids.append(int(token))
        is_eos = token == self.eos_token_id and not params.ignore_eos
        is_stop_id = token in params.stop_token_ids
        text_ids = request.output_ids[:-1] if is_eos or is_stop_id else request.output_ids
        request.text = self.detokenize(text_ids)
        hits = [request.text.find(s) for s in params.stop if s in request.text]
        if hits:
            request.text = request.text[: min(hits)]
            self.finish(request, RequestStatus.FINISHED_STOPPED)
        elif is_eos or is_stop_id:
            self.finish(request, RequestStatus.FINISHED_STOPPED)
        elif len(request.output_ids) >= params.max_tokens:  # check_fits: prompt + max_tokens <= max_model_len
            self.finish(request, RequestStatus.FINISHED_LENGTH)

    def check_invariants(self) -> None:
        """Every used page belongs to exactly one live request; queue and batch hold what they should."""
        held = [p for r in self.running for p in r.pages] + [p for r in self.waiting for p in r.pages]
        assert len(held) == len(set(held)) == self.allocator.num_used, (len(held), self.allocator.num_used)
        assert all(r.status is RequestStatus.RUNNING for r in self.running)
        assert all(r.status is RequestStatus.WAITING and not r.pages for r in self.waiting)
        assert len(self.running) <= self.engine.max_num_seqs
        assert set(self._requests) == {r.request_id for r in [*self.running, *self.waiting]}
