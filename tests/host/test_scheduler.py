"""The continuous-batching scheduler (dcp_jax/host/scheduler.py): admission, buckets, growth, preemption, aborts,
stop rules, stream hold-back; pages always return to the pool. Pure Python: no model, no jax."""

import random
import subprocess
import sys

import pytest

from dcp_jax.config import EngineConfig
from dcp_jax.host.detokenizer import IncrementalDetokenizer
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.sampling import SamplingParams
from dcp_jax.host.scheduler import Request, RequestStatus, Scheduler

EOS = 1


def live(s, request_id: str):
    """The scheduler's running or waiting request of `request_id` (None once it ended)."""
    return next((r for r in [*s.running, *s.waiting] if r.request_id == request_id), None)


def detok(ids):
    return "".join(chr(ord("a") + (i - 2) % 26) for i in ids if i >= 2)


def make(num_pages=16, max_num_seqs=4, page_size=2, dcp=2, max_model_len=64, max_num_batched_tokens=64):
    engine = EngineConfig(page_size=page_size, num_pages=num_pages, max_num_seqs=max_num_seqs,
                          max_model_len=max_model_len, bucket_ladder=(1, 2, 4, 8),
                          max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(engine, DcpLayout(dcp, 1, page_size), eos_token_id=EOS,
                     new_detokenizer=lambda: IncrementalDetokenizer(detok))


def req(rid, prompt_len=3, **params):
    params.setdefault("max_tokens", 8)
    return Request(str(rid), list(range(2, 2 + prompt_len)), SamplingParams(**params))


def dispatch(s, plan):
    """What the engine does with a plan's rows: check each has the pages it writes, mark it dispatched; returns the
    requests whose next token the step samples."""
    assert plan.num_rows <= s.engine.max_num_batched_tokens
    samplers = []
    for r, n in plan.scheduled:
        if r.is_prefilling:
            assert 1 <= n <= r.prefill_len - r.num_computed
            assert len(r.pages) >= s.blocks_for(r.num_computed + n), "a chunk without pages for its tokens"
        else:
            assert n == 1 and len(r.pages) >= s.blocks_for(r.context_len), "decode row without a page for its token"
        if s.samples(r, n):
            samplers.append(r)
        s.mark_dispatched(r, n)
    return samplers


def run_step(s, token_for=lambda r: 5):
    """One synchronous engine step: schedule, dispatch, then the sampled tokens."""
    plan = s.schedule()
    samplers = dispatch(s, plan)
    for r in samplers:
        s.append_token(r, token_for(r))
    s.check_invariants()
    return plan, samplers


def ids(plan):
    return [(r.request_id, n) for r, n in plan.scheduled]


def test_scheduler_does_not_import_jax():
    code = "import sys, dcp_jax.host.scheduler; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_admission_limited_by_batch_slots():
    s = make(num_pages=64, max_num_seqs=3)
    for i in range(5):
        s.add(req(i))
    plan, _ = run_step(s)
    assert ids(plan) == [("0", 3), ("1", 3), ("2", 3)]  # three slots, then the batch is full
    assert s.num_running == 3 and s.num_waiting == 2
    plan, _ = run_step(s)
    assert ids(plan) == [("0", 1), ("1", 1), ("2", 1)]  # their decode rows; nobody else fits


def test_admission_limited_by_pages_first_come_first_served():
    # page_size 2 * dcp 2 = 4 tokens per virtual block.
    s = make(num_pages=3)
    s.add(req("big", prompt_len=9, max_tokens=2))  # 9 tokens -> 3 blocks
    s.add(req("small", prompt_len=1))
    plan = s.schedule()
    assert ids(plan) == [("big", 9)]
    assert live(s, "big").pages == [0, 1, 2] and s.allocator.num_free == 0
    dispatch(s, plan)
    plan = s.schedule()
    assert ids(plan) == [("big", 1)] and s.num_waiting == 1  # its decode row (context 10: 3 blocks); small waits


def test_virtual_block_growth_one_page_per_page_size_times_dcp_tokens():
    s = make(num_pages=8, page_size=2, dcp=2)
    r = req(0, prompt_len=3, max_tokens=20)
    s.add(r)
    run_step(s)  # the prefill of 3 tokens samples the first token: context 4 once fed
    assert len(r.pages) == 1 and r.context_len == 4
    run_step(s)  # decode row at position 3: 4 tokens, still 1 block
    assert len(r.pages) == 1 and r.context_len == 5
    run_step(s)  # context 5 needs a second block
    assert len(r.pages) == 2


def test_bucket_is_smallest_width_holding_the_rows():
    s = make(num_pages=64, max_num_seqs=8, max_num_batched_tokens=24)
    assert [s.engine.bucket_for(n) for n in (1, 2, 3, 5, 8, 9, 17)] == [1, 2, 4, 8, 8, 24, 24]  # ladder (1, 2, 4, 8)
    with pytest.raises(ValueError):
        s.engine.bucket_for(25)


def test_long_prompts_prefill_in_chunks_under_the_token_budget():
    """A prompt longer than the budget runs in chunks of the budget left after the decode rows; only its last chunk
    samples; the chunks cover the prompt exactly once, in order."""
    s = make(num_pages=64, max_num_batched_tokens=8)
    old = req("old", prompt_len=2, max_tokens=20)
    s.add(old)
    run_step(s)  # old's prefill samples its first token
    long = req("long", prompt_len=21, max_tokens=2)
    s.add(long)
    chunks = []
    while long.is_prefilling or long.status is RequestStatus.WAITING:
        plan, samplers = run_step(s)
        assert plan.scheduled[0] == (old, 1)  # the decode row first: a prefill never starves it
        chunks += [n for r, n in plan.scheduled if r is long]
        assert (long in samplers) == (not long.is_prefilling)
    assert chunks == [7, 7, 7] and long.num_computed == 21 and long.output_ids == [5]
    plan, _ = run_step(s)
    assert ids(plan) == [("old", 1), ("long", 1)]


def test_budget_left_after_a_chunk_admits_the_next_request():
    s = make(num_pages=64, max_num_batched_tokens=8)
    s.add(req("a", prompt_len=5))
    s.add(req("b", prompt_len=6))
    plan, samplers = run_step(s)
    assert ids(plan) == [("a", 5), ("b", 3)] and [r.request_id for r in samplers] == ["a"]
    plan, samplers = run_step(s)
    assert ids(plan) == [("a", 1), ("b", 3)] and [r.request_id for r in samplers] == ["a", "b"]


def test_preemption_in_the_middle_of_a_prefill_starts_it_over():
    s = make(num_pages=4, max_num_seqs=4, page_size=2, dcp=1, max_num_batched_tokens=4)  # 2 tokens per block
    a = req("a", prompt_len=3, max_tokens=6)
    b = req("b", prompt_len=7, max_tokens=2)
    s.add(a)
    s.add(b)
    plan, _ = run_step(s)
    assert ids(plan) == [("a", 3), ("b", 1)]  # a: 2 pages, b: 1 page, 1 free
    plan, _ = run_step(s)  # a's decode row (context 4: 2 pages) and 3 more of b (context 4: 2 pages)
    assert ids(plan) == [("a", 1), ("b", 3)] and b.num_computed == 4 and s.allocator.num_free == 0
    plan, _ = run_step(s)  # a needs a third page for context 5: b, the youngest, is preempted mid-prefill
    assert [r.request_id for r in plan.preempted] == ["b"] and ids(plan) == [("a", 1)]
    assert b.status is RequestStatus.WAITING and b.num_computed == 0 and b.pages == [] and not b.is_prefilling
    for _ in range(60):
        if not s.has_work:
            break
        run_step(s)
    assert a.finish_reason == b.finish_reason == "length" and len(b.output_ids) == 2
    assert s.allocator.num_free == 4


def test_preemption_frees_youngest_and_resumes_by_recompute():
    s = make(num_pages=4, max_num_seqs=4, page_size=2, dcp=1)  # 2 tokens per block
    a, b = req("a", prompt_len=3, max_tokens=6), req("b", prompt_len=3, max_tokens=6)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled, 2 pages each: pool empty
    run_step(s)  # decode rows at context 4: still 2 pages each
    assert s.allocator.num_free == 0
    plan, samplers = run_step(s)  # a needs a third page -> b (youngest) preempted
    assert [r.request_id for r in plan.preempted] == ["b"]
    assert b.status is RequestStatus.WAITING and b.pages == [] and s.waiting[0] is b
    assert [r.request_id for r in samplers] == ["a"]
    generated = list(b.output_ids)
    for _ in range(50):
        if b.status is RequestStatus.RUNNING:
            break
        run_step(s)
    assert b.prefill_len == len(b.prompt_ids) + len(generated)  # the resumed prefill computes every token it had
    assert b.prefill_ids == b.prompt_ids + generated
    for _ in range(50):
        if not s.has_work:
            break
        run_step(s)
    assert a.finish_reason == b.finish_reason == "length"
    assert len(a.output_ids) == len(b.output_ids) == 6 and b.num_preemptions >= 1
    assert s.allocator.num_free == 4


def test_youngest_request_preempts_itself_when_it_cannot_grow():
    s = make(num_pages=4, max_num_seqs=4, page_size=2, dcp=1)  # 2 tokens per block
    a, b = req("a", prompt_len=4, max_tokens=5), req("b", prompt_len=2, max_tokens=7)
    s.add(a)
    s.add(b)
    run_step(s)  # a: 2 pages (4 tokens), b: 1 page (2 tokens); 1 free
    plan, samplers = run_step(s)  # a takes the free page for context 5; b needs one for context 3: none left
    assert [r.request_id for r in plan.preempted] == ["b"] and [r.request_id for r in samplers] == ["a"]
    assert b.pages == [] and b.status is RequestStatus.WAITING
    for _ in range(60):
        if not s.has_work:
            break
        run_step(s)
    assert a.is_finished and b.is_finished and len(a.output_ids) == 5 and len(b.output_ids) == 7
    assert s.allocator.num_free == 4


def test_abort_waiting_and_running_frees_pages():
    s = make(num_pages=8, max_num_seqs=1)
    s.add(req("run"))
    s.add(req("wait"))
    run_step(s)
    assert s.allocator.num_used > 0
    assert s.abort("wait").finish_reason == "abort"
    assert s.abort("run").finish_reason == "abort"
    assert s.abort("run") is None and s.abort("nope") is None
    assert s.allocator.num_free == 8 and not s.has_work
    s.check_invariants()


def test_stop_rules():
    s = make(num_pages=64, max_num_seqs=8)
    eos, length, stop_id, ignore = req("eos"), req("len", max_tokens=2), req("id", stop_token_ids=[7]), \
        req("ign", ignore_eos=True, max_tokens=3)
    text = req("text", stop=["cd"])
    for r in (eos, length, stop_id, ignore, text):
        s.add(r)
    s.schedule()
    s.append_token(eos, 4)
    s.append_token(eos, EOS)
    assert eos.finish_reason == "stop" and eos.output_ids == [4, EOS] and eos.text == "c"
    s.append_token(length, 4)
    s.append_token(length, 4)
    assert length.finish_reason == "length"
    s.append_token(stop_id, 7)
    assert stop_id.finish_reason == "stop" and stop_id.text == ""
    for _ in range(3):
        s.append_token(ignore, EOS)
    assert ignore.finish_reason == "length" and len(ignore.output_ids) == 3
    for t in (2, 3, 4, 5):  # a b c d -> stop at "cd", text cut before it
        if not text.is_finished:
            s.append_token(text, t)
    assert text.finish_reason == "stop" and text.text == "ab" and text.output_ids == [2, 3, 4, 5]
    assert s.allocator.num_free == 64
    with pytest.raises(ValueError):
        s.append_token(text, 2)


def test_min_tokens_holds_every_stop_rule_until_the_output_is_longer():
    """vLLM's min_tokens: EOS, a stop token id and a stop string among the first min_tokens tokens are ordinary
    tokens (EOS has no text); the first one after them stops."""
    s = make(num_pages=64, max_num_seqs=8)
    eos, stop_id, text = (req("eos", min_tokens=2), req("id", min_tokens=2, stop_token_ids=[7]),
                          req("text", min_tokens=2, stop=["b"]))
    for r in (eos, stop_id, text):
        s.add(r)
    s.schedule()
    for token in (EOS, EOS, EOS):
        s.append_token(eos, token)
    assert eos.finish_reason == "stop" and eos.output_ids == [EOS] * 3 and eos.text == ""
    for token in (7, 7, 7):
        s.append_token(stop_id, token)
    assert stop_id.finish_reason == "stop" and stop_id.output_ids == [7] * 3 and stop_id.text == "ff"
    for token in (3, 3, 3):  # b b b: the third "b" stops; the text is cut before it
        s.append_token(text, token)
    assert text.finish_reason == "stop" and text.output_ids == [3] * 3 and text.text == "bb"
    assert s.allocator.num_free == 64


def test_max_model_len_is_enforced_before_queueing_so_max_tokens_ends_generation():
    s = make(num_pages=64, max_model_len=6)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(req("over", prompt_len=3, max_tokens=4))
    r = req("r", prompt_len=3, max_tokens=3)  # exactly max_model_len: runs to its max_tokens
    s.add(r)
    while s.has_work:
        run_step(s)
    assert r.finish_reason == "length" and len(r.output_ids) == 3


def test_request_filling_the_pool_with_one_token_is_admitted_not_stuck():
    """check_fits and admission size a request by the same bound (the context it can ever hold): a 16-token prompt
    with max_tokens=1 in a 2-page pool of 8-token blocks is accepted, admitted (2 pages, not 3), finishes, and the
    request queued behind it runs too."""
    s = make(num_pages=2, page_size=4, dcp=2, max_model_len=64)
    full = req("full", prompt_len=16, max_tokens=1)
    after = req("after", prompt_len=5, max_tokens=4)
    s.add(full)
    s.add(after)
    plan, _ = run_step(s)
    assert ids(plan) == [("full", 16)] and full.finish_reason == "length"
    for _ in range(10):
        if not s.has_work:
            break
        run_step(s)
    assert after.finish_reason == "length" and len(after.output_ids) == 4
    assert s.allocator.num_free == 2


def test_check_fits_rejects_impossible_requests():
    s = make(num_pages=2, page_size=2, dcp=2, max_model_len=64)  # 2 blocks = 8 tokens of context
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(req("long", prompt_len=60, max_tokens=8))
    with pytest.raises(ValueError, match="KV pages"):
        s.add(req("pool", prompt_len=8, max_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        s.add(req("empty", prompt_len=0))
    s.add(req("ok", prompt_len=4, max_tokens=5))  # context peaks at 8
    with pytest.raises(ValueError, match="duplicate"):
        s.add(req("ok"))


def test_stream_boundary_holds_back_stop_prefixes_and_partial_utf8():
    s = make()
    r = req("r", stop=["xyz"])
    s.add(r)
    r.text = "abcxy"
    assert r.stream_boundary() == 3
    r.text = "abc\ufffd"
    assert r.stream_boundary() == 3
    r.text = "abcd"
    assert r.stream_boundary() == 4


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_never_leaks_pages(seed):
    rnd = random.Random(seed)
    s = make(num_pages=10, max_num_seqs=4, page_size=2, dcp=2, max_model_len=32,
             max_num_batched_tokens=rnd.choice([4, 7, 16]))
    added, n = [], 0
    for step in range(400):
        if n < 40 and rnd.random() < 0.5:
            r = req(n, prompt_len=rnd.randint(1, 12), max_tokens=rnd.randint(1, 16))
            s.add(r)
            added.append(r)
            n += 1
        if added and rnd.random() < 0.05:
            s.abort(rnd.choice(added).request_id)
        run_step(s, token_for=lambda r: rnd.choice([EOS] + [5] * 30))
        if n == 40 and not s.has_work:
            break
    assert not s.has_work and all(r.is_finished for r in added)
    assert s.allocator.num_free == 10 and s.allocator.num_used == 0
    for r in added:
        if r.finish_reason == "length":
            assert len(r.output_ids) == r.params.max_tokens


def test_each_running_request_holds_its_own_sampler_slot_until_it_ends():
    s = make(num_pages=64, max_num_seqs=3)
    for i in range(4):
        s.add(req(i, max_tokens=3))
    s.schedule()
    slots = {r.request_id: r.slot for r in s.running}
    assert sorted(slots.values()) == [0, 1, 2] and s.scratch_slot == 3
    s.abort("1")
    assert live(s, "1") is None
    s.schedule()  # the freed slot goes to the waiting request
    assert live(s, "3").slot == slots["1"]
    s.check_invariants()


def test_pending_tokens_count_in_the_context_and_stop_decode_rows_at_max_tokens():
    """The engine dispatches before it reads: a pending token lengthens the context; a request whose sampled tokens
    (pending included) reach max_tokens gets no decode row; its last token still arrives."""
    s = make(num_pages=64)
    s.add(req("a", prompt_len=3, max_tokens=2))
    plan = s.schedule()
    (r, n), = plan.scheduled
    dispatch(s, plan)  # its prefill samples token 1
    assert r.context_len == 4 and r.num_sampled == 1
    plan = s.schedule()
    assert ids(plan) == [("a", 1)]
    dispatch(s, plan)  # the decode step samples token 2 = max_tokens
    assert s.schedule().scheduled == ()  # nothing more to sample, two tokens on their way
    s.append_token(r, 5)
    assert r.output_ids == [5] and r.num_pending == 1 and not r.is_finished
    s.append_token(r, 6)
    assert r.finish_reason == "length" and r.num_pending == 0 and s.allocator.num_used == 0
    s.check_invariants()


def test_a_token_sampled_past_a_stop_is_dropped_and_one_after_a_preemption_kept():
    s = make(num_pages=64)
    s.add(req("eos", max_tokens=8))
    dispatch(s, s.schedule())
    r = live(s, "eos")
    dispatch(s, s.schedule())  # a decode dispatched before the EOS below was read
    s.append_token(r, EOS)
    assert r.finish_reason == "stop"
    s.append_token(r, 9)  # the late one: dropped, no error
    assert r.output_ids == [EOS] and r.num_pending == 0
    with pytest.raises(ValueError, match="not running"):
        s.append_token(r, 9)  # nothing pending: a caller's mistake
    s.add(req("pre", max_tokens=8))
    dispatch(s, s.schedule())
    p = live(s, "pre")
    assert s._preempt_youngest() is p  # preempted with its first token still on the way
    assert s.schedule().scheduled == ()  # not readmitted before its token arrives
    s.append_token(p, 11)
    assert p.output_ids == [11] and p.status is RequestStatus.WAITING
    assert ids(s.schedule()) == [("pre", 4)] and p.prefill_ids == p.prompt_ids + [11]
    s.check_invariants()


def test_stop_strings_are_found_across_tokens_in_the_new_tail():
    s = make(num_pages=64)
    s.add(req("s", max_tokens=20, stop=["cde"]))
    (r, _), = s.schedule().scheduled
    for token in [2, 3, 4, 5, 6]:  # detok: a b c d e
        if r.is_finished:
            break
        s.append_token(r, token)
    assert r.finish_reason == "stop" and r.text == "ab" and r.output_ids == [2, 3, 4, 5, 6]


def test_slot_rows_of_block_tables_mirror_the_pages_through_growth_preemption_and_finish():
    """A step takes its sequences' tables from `block_tables` (one numpy index): each running request's slot row
    holds exactly its pages, and a freed slot's row is all -1 (check_invariants proves both each step)."""
    s = make(num_pages=6, max_num_seqs=3, page_size=2, dcp=1, max_model_len=24, max_num_batched_tokens=5)
    for i in range(3):
        s.add(req(i, prompt_len=3, max_tokens=10))
    preempted = 0
    while s.has_work:
        plan = s.schedule()
        preempted += len(plan.preempted)
        live = [r for r, _ in plan.scheduled]
        for row, r in zip(s.block_tables_of(live), live):
            assert row[: len(r.pages)].tolist() == list(r.pages) and (row[len(r.pages):] == -1).all()
        for r in dispatch(s, plan):
            s.append_token(r, 5)
        s.check_invariants()
    assert preempted > 0, "the pool was meant to run out"
    assert (s.block_tables == -1).all()


def cached(num_pages=16, **kw):
    """A scheduler with the prefix cache, 4 tokens a virtual block."""
    s = make(num_pages=num_pages, page_size=2, dcp=2, **kw)
    s.allocator.enable_prefix_caching = True
    return s


def run_to_the_end(s, *requests):
    while any(not r.is_finished for r in requests):
        run_step(s)


def test_a_cached_prefix_is_reused_and_only_the_rest_computed():
    s = cached()
    first = req("first", prompt_len=10, max_tokens=2)  # blocks [0,4) and [4,8) full, 2 tokens past them
    s.add(first)
    run_to_the_end(s, first)
    assert s.allocator.num_cached == 2 and s.allocator.num_used == 0  # its full blocks outlive it
    again = req("again", prompt_len=11, max_tokens=2)  # the same first 10 tokens, one more
    s.add(again)
    plan, _ = run_step(s)
    assert ids(plan) == [("again", 3)] and again.num_cached_tokens == 8  # tokens 8, 9, 10 computed
    assert list(again.pages)[:2] == [0, 1]  # first's pages
    run_to_the_end(s, again)
    assert s.allocator.num_used == 0 and s.allocator.num_free == 16


def test_a_fully_cached_prompt_computes_its_last_block_again():
    s = cached()
    one = req("one", prompt_len=8, max_tokens=1)  # two full blocks
    s.add(one)
    run_to_the_end(s, one)
    two = req("two", prompt_len=8, max_tokens=1)
    s.add(two)
    plan = s.schedule()
    assert ids(plan) == [("two", 4)] and two.num_cached_tokens == 4 and s.samples(two, 4)
    assert two.pages[0] == 0 and two.pages[1] != 1  # the last block in a fresh page: a cached page is never written


def test_requests_that_read_their_history_do_not_reuse_it():
    """The repetition penalty and prompt logprobs read every prompt token's row: computed, never cached."""
    s = cached()
    base = req("base", prompt_len=9, max_tokens=1)
    s.add(base)
    run_to_the_end(s, base)
    penalized = req("pen", prompt_len=9, max_tokens=1, repetition_penalty=1.2)
    echo = req("echo", prompt_len=9, max_tokens=1)
    echo.num_prompt_logprobs = 1
    for r in (penalized, echo):
        s.add(r)
        plan, _ = run_step(s)
        assert ids(plan) == [(r.request_id, 9)] and r.num_cached_tokens == 0
        run_to_the_end(s, r)


def test_generated_tokens_complete_blocks_a_follow_up_prompt_reuses():
    """A multi-turn chat: the next prompt is the last one plus the answer; the blocks the answer completed (their
    KV written, all tokens but the last) are cached too."""
    s = cached()
    turn = req("turn", prompt_len=3, max_tokens=7, ignore_eos=True)  # 3 + 7 = 10 tokens: blocks [0,4), [4,8)
    s.add(turn)
    run_to_the_end(s, turn)
    assert s.allocator.num_cached == 2
    follow = Request("follow", turn.all_ids + [9, 9], SamplingParams(max_tokens=1))
    s.add(follow)
    plan, _ = run_step(s)
    assert follow.num_cached_tokens == 8 and ids(plan) == [("follow", 4)]


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_with_the_prefix_cache_never_leaks_or_double_frees_pages(seed):
    """Shared prefixes, a pool small enough to preempt and evict, aborts: every step's holds match the allocator's
    counts (check_invariants), and everything comes back."""
    rnd = random.Random(seed)
    s = cached(num_pages=10, max_num_seqs=4, max_model_len=32, max_num_batched_tokens=rnd.choice([4, 7, 16]))
    stems = [[rnd.randint(2, 4) for _ in range(12)] for _ in range(3)]
    added, n = [], 0
    for _ in range(500):
        if n < 40 and rnd.random() < 0.5:
            prompt = rnd.choice(stems)[: rnd.randint(1, 12)] + [rnd.randint(2, 30) for _ in range(rnd.randint(0, 3))]
            r = Request(str(n), prompt, SamplingParams(max_tokens=rnd.randint(1, 12)))
            s.add(r)
            added.append(r)
            n += 1
        if added and rnd.random() < 0.05:
            s.abort(rnd.choice(added).request_id)
        run_step(s, token_for=lambda r: rnd.choice([EOS] + [5] * 30))
        if n == 40 and not s.has_work:
            break
    assert not s.has_work and all(r.is_finished for r in added)
    assert s.allocator.num_used == 0 and s.allocator.num_free == 10
    assert sum(r.num_cached_tokens for r in added) > 0  # prefixes were reused


@pytest.mark.parametrize("drafts", [1, 3])
def test_drafting_requests_hold_pages_for_the_chained_passes_rows(drafts):
    """With N >= 2 drafts a request that samples holds pages past its step's rows for the N - 1 rows of the chained
    MTP passes (`StepMetadata.draft_*`), never past its max context; N = 1 needs none."""
    engine = EngineConfig(page_size=2, num_pages=64, max_num_seqs=2, max_model_len=64, bucket_ladder=(1, 2, 4, 8),
                          max_num_batched_tokens=64, num_speculative_tokens=drafts)
    s = Scheduler(engine, DcpLayout(1, 1, 2), eos_token_id=EOS, new_detokenizer=lambda: IncrementalDetokenizer(detok))
    s.add(req("a", prompt_len=5, max_tokens=12))
    extra = drafts - 1
    plan = s.schedule()  # its prefill samples its first token: rows 0..4, chained rows after them
    r = live(s, "a")
    assert len(r.pages) == s.blocks_for(5 + extra)
    dispatch(s, plan)
    s.append_token(r, 5)
    ((_, n),) = s.schedule().scheduled  # a decode row and its drafts' rows, then the chained ones
    assert n == 1 + drafts and len(r.pages) == s.blocks_for(r.context_len + n - 1 + extra)
    s.add(req("short", prompt_len=5, max_tokens=2))  # its max context, 6 tokens, caps what it holds
    s.schedule()
    assert len(live(s, "short").pages) == s.blocks_for(min(5 + extra, 6))
