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

Each running request also holds a slot (one of max_num_seqs) of the device's sampler state, and the row of that
slot in `block_tables` mirrors its pages, so a decode step gathers its rows' tables in one numpy index. The engine may
dispatch a step before it reads the previous one's tokens: `mark_dispatched` counts a token sampled on the device
but not yet read (`num_pending`), which the context length already includes, and a request whose pending tokens
reach max_tokens gets no decode row. The engine reports each token with `append_token`, which detokenizes it
incrementally, applies the stop rules (EOS / stop token ids, stop strings searched in the new text's tail, none
of them before min_tokens; max_tokens; `check_fits` already keeps prompt + max_tokens within max_model_len) and
frees a finished request's pages and slot at once. `abort` frees a cancelled request's wherever it is. Every
page and slot taken is returned exactly once: `check_invariants` proves it.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dcp_jax.config import EngineConfig
from dcp_jax.host.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.page_allocator import BlockTable, PageAllocator


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
    """One sequence. `params` needs max_tokens, min_tokens, stop (tuple of str), stop_token_ids and ignore_eos
    (a `sampling.SamplingParams`); `seed` keys its draws on the device (`sampling.request_seed`)."""

    request_id: str
    prompt_ids: list[int]
    params: Any
    seed: int = 0
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
    # Its slot of the device's sampler state while running; None otherwise.
    slot: int | None = None
    # Tokens sampled on the device for it whose values the host has not read yet.
    num_pending: int = 0
    detokenizer: IncrementalDetokenizer | None = None
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
        """Tokens in context once the last sampled token (read or pending) is fed to the next decode step."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_sampled(self) -> int:
        """Tokens generated so far, the pending ones included."""
        return len(self.output_ids) + self.num_pending

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
        self._tokens_per_block = layout.tokens_per_block
        self.eos_token_id = eos_token_id
        self.detokenize = detokenize
        self.max_prefills_per_step = max_prefills_per_step
        self.allocator = PageAllocator(engine.num_pages)
        self._free_slots = list(range(engine.max_num_seqs))  # a heap: the lowest free slot is handed out
        # [max_num_seqs, max_blocks] int32: row s holds the page ids of the request on slot s, -1 past them.
        self.block_tables = np.full((engine.max_num_seqs, engine.max_blocks_per_seq(layout.dcp_size)), -1, np.int32)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the youngest, preempted first
        self._requests: dict[str, Request] = {}

    # ---- queue ------------------------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        """Virtual blocks that hold `tokens` tokens (`DcpLayout.virtual_blocks` for one int, in Python)."""
        return -(-tokens // self._tokens_per_block)

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

    @property
    def scratch_slot(self) -> int:
        """The sampler slot of pad rows: one past the requests'."""
        return self.engine.max_num_seqs

    def decode_rows(self, plan: StepPlan) -> list[Request]:
        """The plan's decode rows still running after the prefills (a prefill may have finished one), but not those
        whose sampled tokens (pending ones included) already reach max_tokens."""
        return [r for r in plan.decodes if r.status is RequestStatus.RUNNING and r.num_sampled < r.params.max_tokens]

    def mark_dispatched(self, request: Request) -> None:
        """A step that samples a token for `request` was dispatched; its value comes with `append_token`."""
        request.num_pending += 1

    def decode_block_tables(self, rows: Sequence[Request]) -> np.ndarray:
        """[len(rows), max_blocks] int32: the rows' page ids, -1 past them."""
        return self.block_tables[[r.slot for r in rows]]

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
                self._add_pages(request, self.allocator.allocate(missing))
                i += 1
            else:
                victim = self.running.pop()  # the youngest; may be `request` itself
                self._free(victim)
                victim.status = RequestStatus.WAITING  # its pending token, if any, is still appended when read
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
            if request.num_pending:
                break  # its last token is still on its way (it was preempted a step ago): next step
            request.slot = heapq.heappop(self._free_slots)
            self._add_pages(request, self.allocator.allocate(need))
            request.status = RequestStatus.RUNNING
            self.waiting.popleft()
            self.running.append(request)
            admitted.append(request)
        return admitted

    def _add_pages(self, request: Request, pages: list[int]) -> None:
        """Append pages to a running request's table and to its slot's row of `block_tables`."""
        start = len(request.pages)
        request.pages.extend(pages)
        self.block_tables[request.slot, start: start + len(pages)] = pages

    def _free(self, request: Request) -> None:
        if request.pages:
            self.allocator.free(request.pages.clear())
        if request.slot is not None:
            self.block_tables[request.slot] = -1
            heapq.heappush(self._free_slots, request.slot)
            request.slot = None

    # ---- results ----------------------------------------------------------------------------------------
    def append_token(self, request: Request, token: int) -> None:
        """Record a sampled token (a pending one, once dispatched), update the text and apply the stop rules
        (finishing frees the pages). Stop strings cut the text before them; EOS and stop token ids stay in
        output_ids, not in the text. A token that arrives for a finished request (a step dispatched before its
        stop was read) is dropped."""
        status = request.status
        if request.num_pending > 0:
            request.num_pending -= 1
            if status.is_finished:
                return
            # A pending token may arrive after its request was preempted (waiting): it is still its next token.
        elif status is not RequestStatus.RUNNING:
            raise ValueError(f"request {request.request_id!r} is {status.value}, not running")
        params = request.params
        token = int(token)
        output = request.output_ids
        output.append(token)
        # vLLM's min_tokens: no stop (EOS, stop token ids, stop strings) before the output is longer than it.
        may_stop = len(output) > params.min_tokens
        is_stop_id = may_stop and ((token == self.eos_token_id and not params.ignore_eos)
                                   or token in params.stop_token_ids)
        is_length = len(output) >= params.max_tokens  # check_fits: prompt + max_tokens <= max_model_len
        detokenizer = request.detokenizer
        if detokenizer is None:
            detokenizer = request.detokenizer = IncrementalDetokenizer(self.detokenize)
        before = len(request.text)
        if not is_stop_id:
            detokenizer.add_one(token)
        if is_stop_id or is_length:
            detokenizer.flush()
        request.text = detokenizer.text
        if params.stop and may_stop and self._cut_at_stop_string(request, before):
            self.finish(request, RequestStatus.FINISHED_STOPPED)
        elif is_stop_id:
            self.finish(request, RequestStatus.FINISHED_STOPPED)
        elif is_length:
            self.finish(request, RequestStatus.FINISHED_LENGTH)

    @staticmethod
    def _cut_at_stop_string(request: Request, before: int) -> bool:
        """Cut `request.text` before the first stop string in it; only the text past `before` and the stop length
        before it can hold one that was not there before. True when one was found."""
        stops = request.params.stop
        tail_start = max(0, before - max(len(stop) for stop in stops) + 1)
        tail = request.text[tail_start:]
        hits = [tail_start + tail.find(stop) for stop in stops if stop in tail]
        if hits:
            request.text = request.text[: min(hits)]
        return bool(hits)

    def check_invariants(self) -> None:
        """Every used page belongs to exactly one live request; queue and batch hold what they should."""
        held = [p for r in self.running for p in r.pages] + [p for r in self.waiting for p in r.pages]
        assert len(held) == len(set(held)) == self.allocator.num_used, (len(held), self.allocator.num_used)
        slots = [r.slot for r in self.running]
        assert None not in slots and len(slots) == len(set(slots))
        assert sorted(slots + self._free_slots) == list(range(self.engine.max_num_seqs))
        assert all(r.slot is None for r in self.waiting)
        for r in self.running:
            row = self.block_tables[r.slot]
            assert row[: len(r.pages)].tolist() == list(r.pages) and np.all(row[len(r.pages):] == -1), r.request_id
        free_rows = self.block_tables[sorted(self._free_slots)]
        assert np.all(free_rows == -1)
        assert all(r.status is RequestStatus.RUNNING for r in self.running)
        assert all(r.status is RequestStatus.WAITING and not r.pages for r in self.waiting)
        assert len(self.running) <= self.engine.max_num_seqs
        assert set(self._requests) == {r.request_id for r in [*self.running, *self.waiting]}
