"""Continuous-batching scheduler over the paged DCP KV pool, with chunked prefill under a token budget (pure
Python, no jax).

Owns the request states, the waiting queue and the running batch. Pages are handed out in virtual blocks of
`page_size * dcp` tokens: one page id names the same page on every DCP rank, so one block costs one id from the
`PageAllocator`. A step runs at most `max_num_batched_tokens` rows (vLLM's chunked prefill). Each step the scheduler

1. gives every running request past its prefill one decode row (unless its sampled tokens, pending ones included,
   reach max_tokens), and with speculative decoding a row per drafted token after it (`decode_rows`), growing its
   block table for them; when the pool is empty it preempts the youngest running request (its pages go back to
   the pool, it returns to the front of the queue and is recomputed by a prefill of prompt + generated tokens
   when readmitted), so a full pool never crashes a step;
2. gives running requests still prefilling their next chunk within the budget left (oldest first; when pages run
   out, the youngest is preempted for the oldest, which always fits: `check_fits`);
3. admits waiting requests first come first served while a batch slot, budget and the pages of their first chunk
   are free (nothing is admitted in a step that preempted);
4. hands the engine a `StepPlan`: each scheduled request with its rows this step, decode rows first.

A prefill computes a request's `prefill_ids` (its prompt, and for a resumed one every token it generated) in
chunks; the row of the last one samples the next token, and the decode rows follow from the next step. Each
running request also holds a slot (one of max_num_seqs) of the device's sampler state, and the row of that slot in
`block_tables` mirrors its pages, so a step gathers its sequences' tables in one numpy index. The engine may
dispatch a step before it reads the previous one's tokens: `mark_dispatched` records the rows dispatched (a chunk's
tokens, and a token sampled on the device but not yet read: `num_pending`, which the context length already
includes). The engine reports each token with `append_token`, which detokenizes it incrementally, applies the
stop rules (EOS / stop token ids, stop strings searched in the new text's tail, none of them before min_tokens;
max_tokens; `check_fits` already keeps prompt + max_tokens within max_model_len) and frees a finished request's
pages and slot at once. `abort` frees a cancelled request's wherever it is. Every page and slot taken is returned
exactly once: `check_invariants` proves it.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dcp_jax.config import EngineConfig
from dcp_jax.host.detokenizer import REPLACEMENT_CHAR, Detokenizer
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.page_allocator import BlockTable, PageAllocator, block_hashes


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens
    FINISHED_ABORTED = "abort"  # cancelled or disconnected
    FINISHED_ERROR = "error"  # the request failed (and only it)

    def __init__(self, value: str):
        # An attribute, not a property: read several times per generated token.
        self.is_finished = value not in ("waiting", "running")


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
    # Tokens its current prefill computes (`prefill_ids`, fixed at admission) and those dispatched so far; of
    # those, the ones whose KV it found in the prefix cache instead.
    prefill_len: int = 0
    num_computed: int = 0
    num_cached_tokens: int = 0
    # The prefix cache's hash of each full virtual block of its tokens, and how many of its blocks it cached.
    block_hashes: list = dataclasses.field(default_factory=list)
    num_cached_blocks: int = 0
    detokenizer: Detokenizer | None = None
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
        """Tokens its prefill computes: the prompt, then (a request resumed after a preemption) every token it
        generated; the last chunk samples the token after them."""
        return self.prompt_ids + self.output_ids[: self.prefill_len - len(self.prompt_ids)]

    @property
    def is_prefilling(self) -> bool:
        """Running with prefill chunks still to dispatch."""
        return self.num_computed < self.prefill_len

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
    """One engine step: `scheduled` requests, each with its rows this step (past its prefill: its decode row and
    its draft rows, `Scheduler.decode_rows`; else the next `num_tokens` tokens of its prefill), decode rows first;
    `preempted` lost their pages this step."""

    scheduled: tuple[tuple[Request, int], ...]
    preempted: tuple[Request, ...]

    @property
    def num_rows(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Request queue + running batch over one `PageAllocator`. Not thread-safe: the engine thread owns it."""

    def __init__(self, engine: EngineConfig, layout: DcpLayout, *, eos_token_id: int | None,
                 new_detokenizer: Callable[[], Detokenizer], enable_prefix_caching: bool = False):
        """`new_detokenizer()`: an incremental decoder for one request's output (the tokenizer's);
        `enable_prefix_caching`: reuse the cached pages of full virtual blocks of known tokens (`PageAllocator`)."""
        if layout.page_size != engine.page_size:
            raise ValueError(f"{layout=} does not match the engine's page_size={engine.page_size}")
        self.engine = engine
        self.layout = layout
        self._tokens_per_block = layout.tokens_per_block
        self.eos_token_id = eos_token_id
        self.new_detokenizer = new_detokenizer
        self.allocator = PageAllocator(engine.num_pages, enable_prefix_caching=enable_prefix_caching)
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
        """Rows for the running requests in admission order, then admissions (`Scheduler`'s steps 1-4): a decode
        row each (their budget set aside first, so no prefill starves them), prefill chunks within the rest.
        Preemption takes the youngest, never a request scheduled already (those come before it)."""
        preempted: list[Request] = []
        budget = self.engine.max_num_batched_tokens - sum(map(self.decode_rows, self.running))  # for chunks
        scheduled = []
        size = self._tokens_per_block
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                break  # preempted for an older request: so is every younger one
            if request.is_prefilling:
                if budget <= 0:
                    continue
                n = min(request.prefill_len - request.num_computed, budget)
                tokens = self._held(request, request.num_computed + n, samples=self.samples(request, n))
                budget -= n
            elif n := self.decode_rows(request):
                tokens = self._held(request, request.context_len + n - 1, samples=True)  # its drafts' rows too
            else:
                continue
            if -(-tokens // size) > len(request.pages) and not self._reserve(request, tokens, preempted):
                break  # it was the youngest left: everything after it is preempted too
            scheduled.append((request, n))
        if not preempted:
            scheduled += self._admit(budget)
        return StepPlan(scheduled=tuple(scheduled), preempted=tuple(preempted))

    def decode_rows(self, request: Request) -> int:
        """The rows a request past its prefill decodes with this step: one, and one per token drafted for it (up to
        num_speculative_tokens, while its max_tokens leaves room for them all and the token after); 0 when it
        has sampled max_tokens (its last token is pending) or is still prefilling."""
        if request.is_prefilling or request.num_sampled >= request.params.max_tokens:
            return 0
        return 1 + min(self.engine.num_speculative_tokens, request.params.max_tokens - request.num_sampled - 1)

    def _held(self, request: Request, tokens: int, *, samples: bool) -> int:
        """The tokens `request` needs pages for when this step computes its first `tokens`: with chained draft
        passes (N >= 2 drafts) and its next token sampled, also their N - 1 rows after those (`StepMetadata`'s
        draft_*), up to its max context (a draft past it is never verified)."""
        n = self.engine.num_speculative_tokens
        if samples and n >= 2:
            return max(tokens, min(tokens + n - 1, request.max_context_len))
        return tokens

    def _reserve(self, request: Request, tokens: int, preempted: list[Request]) -> bool:
        """Grow a running request's block table to hold `tokens` tokens, preempting the youngest running requests
        while pages run out; False when `request` itself was preempted (or already was)."""
        while request.status is RequestStatus.RUNNING:
            missing = self.blocks_for(tokens) - len(request.pages)
            if missing <= self.allocator.num_free:
                if missing > 0:
                    self._add_pages(request, self.allocator.allocate(missing))
                return True
            preempted.append(self._preempt_youngest())
        return False

    def _preempt_youngest(self) -> Request:
        victim = self.running.pop()
        self._free(victim)
        victim.status = RequestStatus.WAITING  # its pending token, if any, is still appended when read
        victim.prefill_len = victim.num_computed = 0  # its prefill starts over when readmitted
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    @property
    def scratch_slot(self) -> int:
        """The sampler slot of pad rows: one past the requests'."""
        return self.engine.max_num_seqs

    def mark_dispatched(self, request: Request, num_tokens: int) -> None:
        """A step with `num_tokens` rows of `request` (the plan's) was dispatched: a chunk's tokens are computed,
        and a token it samples (a decode row's, a last chunk's) is pending until `append_token` brings it."""
        if request.is_prefilling:
            request.num_computed += num_tokens
            if self.allocator.enable_prefix_caching:
                self._extend_hashes(request)
                self._cache_blocks(request, request.num_computed)
            if request.is_prefilling:
                return
        request.num_pending += 1

    def samples(self, request: Request, num_tokens: int) -> bool:
        """Whether `num_tokens` rows of `request` this step sample its next token (before `mark_dispatched`)."""
        return request.num_computed + num_tokens >= request.prefill_len

    def block_tables_of(self, requests: Sequence[Request]) -> np.ndarray:
        """[len(requests), max_blocks] int32: their page ids, -1 past them."""
        return self.block_tables[[r.slot for r in requests]]

    def _admit(self, budget: int) -> list[tuple[Request, int]]:
        admitted = []
        while self.waiting and budget > 0 and len(self.running) < self.engine.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending:
                break  # its last token is still on its way (it was preempted a step ago): next step
            prefill_len = len(request.prompt_ids) + len(request.output_ids)
            cached = self._cached_prefix(request, prefill_len)
            computed = len(cached) * self._tokens_per_block
            n = min(prefill_len - computed, budget)
            need = self.blocks_for(self._held(request, computed + n, samples=computed + n >= prefill_len)) - len(cached)
            if need > self.allocator.num_free:
                self.allocator.free(cached)
                break  # first come first served: nobody overtakes the head of the queue
            request.slot = heapq.heappop(self._free_slots)
            request.prefill_len, request.num_computed = prefill_len, computed
            request.num_cached_tokens = computed
            self._add_pages(request, cached + self.allocator.allocate(need))
            request.status = RequestStatus.RUNNING
            self.waiting.popleft()
            self.running.append(request)
            admitted.append((request, n))
            budget -= n
        return admitted

    def _cached_prefix(self, request: Request, prefill_len: int) -> list[int]:
        """The cached pages of the longest cached prefix of full blocks of `request`'s prefill (now held by it),
        short of its last token, which its prefill must compute to sample after it. None for a request that reads
        the history of its prefill on the device (its penalties, its prompt logprobs): only computed rows add to
        it."""
        params = request.params
        reads_history = (params.repetition_penalty != 1 or request.num_prompt_logprobs is not None
                         or (request.output_ids and (params.presence_penalty or params.frequency_penalty)))
        if reads_history or not self.allocator.enable_prefix_caching:
            return []
        self._extend_hashes(request)
        cached = self.allocator.take_cached(request.block_hashes)
        if len(cached) * self._tokens_per_block >= prefill_len:  # every block cached: compute the last one again
            self.allocator.free(cached[-1:])
            cached = cached[:-1]
        return cached

    def _extend_hashes(self, request: Request) -> None:
        """Hash the full blocks of its known tokens (prompt and generated) not hashed yet."""
        size, done = self._tokens_per_block, len(request.block_hashes) * self._tokens_per_block
        if done + size <= len(request.prompt_ids) + len(request.output_ids):
            parent = request.block_hashes[-1] if request.block_hashes else b""
            request.block_hashes += block_hashes(request.all_ids[done:], size, parent=parent)

    def _cache_generated_blocks(self, request: Request) -> None:
        """Cache the blocks its generated tokens complete once their KV is written: all its tokens but the last,
        which the next decode row feeds."""
        self._extend_hashes(request)
        self._cache_blocks(request, len(request.prompt_ids) + len(request.output_ids) - 1)

    def _cache_blocks(self, request: Request, computed: int) -> None:
        """Cache the full blocks of `request` whose every token's KV is written (the first `computed` tokens)."""
        first, last = request.num_cached_blocks, min(computed // self._tokens_per_block, len(request.block_hashes))
        for block in range(first, last):
            self.allocator.cache(request.pages[block], request.block_hashes[block])
        request.num_cached_blocks = max(first, last)

    def _add_pages(self, request: Request, pages: list[int]) -> None:
        """Append pages to a running request's table and to its slot's row of `block_tables`."""
        start = len(request.pages)
        request.pages.extend(pages)
        self.block_tables[request.slot, start: start + len(pages)] = pages

    def _free(self, request: Request) -> None:
        request.num_cached_blocks = 0
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
        if self.allocator.enable_prefix_caching and status is RequestStatus.RUNNING:
            self._cache_generated_blocks(request)
        # vLLM's min_tokens: no stop before the output is longer than it (the device holds EOS and the stop token ids
        # back meanwhile; a stop string may still appear in the text).
        may_stop = len(output) > params.min_tokens
        is_stop_id = may_stop and ((token == self.eos_token_id and not params.ignore_eos)
                                   or token in params.stop_token_ids)
        is_length = len(output) >= params.max_tokens  # check_fits: prompt + max_tokens <= max_model_len
        detokenizer = request.detokenizer
        if detokenizer is None:
            detokenizer = request.detokenizer = self.new_detokenizer()
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
        self.allocator.check_invariants(collections.Counter(p for r in self.running for p in r.pages))
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
        assert all(r.num_computed <= r.prefill_len and self.blocks_for(r.num_computed) <= len(r.pages)
                   for r in self.running)
        assert all(r.status is RequestStatus.WAITING and not r.pages for r in self.waiting)
        assert len(self.running) <= self.engine.max_num_seqs
        assert set(self._requests) == {r.request_id for r in [*self.running, *self.waiting]}
