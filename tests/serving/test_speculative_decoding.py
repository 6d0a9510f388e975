"""Speculative decoding with the model's MTP layer (`speculative_config`, issue 27): greedy output token for token
that of decoding without drafts at every DCP size and interleave, with contexts crossing index_topk; drafts forced
right for some requests and wrong for others are kept and rejected as they should, and the pages all come back;
penalties see the drafts a row follows; sampled output is reproducible per seed; bad configurations are refused
before anything loads."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcp_jax.config import TINY
from dcp_jax.host.sampling import SamplingParams
from dcp_jax.serving.llm import LLM

MTP = {"method": "mtp", "num_speculative_tokens": 1}
MTP3 = {"method": "mtp", "num_speculative_tokens": 3}
# Prompts of 5, 23 and 40 tokens: below and past the tiny preset's index_topk of 16.
PROMPTS = [np.random.default_rng(i).integers(2, TINY.vocab_size, n).tolist() for i, n in enumerate([5, 23, 40])]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def make_llm(dcp=1, interleave=1, speculative_config=MTP, model="tiny", **kwargs):
    return LLM(model, dcp=dcp, interleave=interleave, max_model_len=64, max_num_seqs=4, page_size=4,
               dtype="float32", kernels="reference", speculative_config=speculative_config, **kwargs)


def token_ids(llm, params=GREEDY, prompts=PROMPTS):
    return [out.outputs[0].token_ids for out in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


@pytest.fixture(scope="module")
def plain_llm():
    return make_llm(speculative_config=None)


@pytest.fixture(scope="module")
def plain_greedy(plain_llm):
    return token_ids(plain_llm)


# DCP 1, 4 and 8 repeat DCP 2's checks at other sizes, and N = 1 and 2 repeat N = 3's (slow: scripts/test.sh
# leaves them out).
SIZES = [(2, 2, MTP3), pytest.param(2, 2, MTP, marks=pytest.mark.slow),
         pytest.param(2, 1, {"method": "mtp", "num_speculative_tokens": 2}, marks=pytest.mark.slow),
         pytest.param(1, 1, MTP3, marks=pytest.mark.slow), pytest.param(4, 1, MTP3, marks=pytest.mark.slow),
         pytest.param(8, 2, MTP3, marks=pytest.mark.slow)]


# Slow at every size: the forced-drafts test below checks greedy identity at DCP 2, N = 3 too.
@pytest.mark.slow
@pytest.mark.parametrize("dcp, interleave, config", SIZES)
def test_greedy_output_with_mtp_is_greedy_decodings(plain_greedy, dcp, interleave, config):
    assert token_ids(make_llm(dcp, interleave, config)) == plain_greedy


def test_glm_index_share_drafts_with_its_mtp_layer():
    """tiny-glm (IndexShare: layers 1 and 3 reuse the selection before them; the MTP layer runs its own indexer and
    has an index-key entry of its own, after the full layers'): drafting gives plain greedy decoding's tokens at
    DCP 2 (one draft a step; chained drafts are the tiny preset's tests)."""
    prompts = PROMPTS[2:]  # 40 tokens, past index_topk
    small = dict(model="tiny-glm", max_num_batched_tokens=64)
    plain = token_ids(make_llm(2, 2, None, **small), prompts=prompts)
    assert token_ids(make_llm(2, 2, MTP, **small), prompts=prompts) == plain


def force_drafts(llm, expected, right):
    """Before each step, write each running request's drafts: its next greedy tokens (`expected`), the one after
    its first right[i] drafts (if any) changed to another token."""
    runner, scheduler = llm.runner, llm.core.scheduler
    dispatch = runner.dispatch

    def forced(rows, variant):
        drafts = np.asarray(runner.state.drafts).copy()
        for request in scheduler.running:
            index = int(request.request_id.split("-")[-1])
            k = len(request.output_ids)
            tokens = expected[index][k: k + drafts.shape[1]]
            if 0 < k and tokens:
                tokens = tokens + [0] * (drafts.shape[1] - len(tokens))
                if right[index] < len(tokens):
                    tokens[right[index]] = (tokens[right[index]] + 1) % TINY.vocab_size
                drafts[request.slot] = tokens
        runner.state = dataclasses.replace(runner.state, drafts=jax.device_put(jnp.asarray(drafts),
                                                                               runner.state.drafts.sharding))
        return dispatch(rows, variant)

    runner.dispatch = forced


def draft_counts(max_tokens: int, n: int, right: int) -> tuple[int, int]:
    """(drafted, kept) of a request whose first `right` drafts a step are right: the scheduler drafts up to n while
    max_tokens leaves room for them and the token after; the prefill samples its first token."""
    sampled, drafted, kept = 1, 0, 0
    while sampled < max_tokens:
        d = min(n, max_tokens - sampled - 1)
        drafted, kept, sampled = drafted + d, kept + min(d, right), sampled + min(d, right) + 1
    return drafted, kept


@pytest.mark.parametrize("dcp, interleave, config", SIZES)
def test_drafts_right_for_some_requests_and_wrong_for_others(plain_greedy, dcp, interleave, config):
    """All drafts kept for one request, none for another, the first only (N > 1) for the third; the output is
    greedy decoding's, the metrics count them and every page is free after; then (the MTP layer drafting again) a
    request aborted between verify steps gives its pages back."""
    llm = make_llm(dcp, interleave, config)
    n = config["num_speculative_tokens"]
    right = [n, 0, min(1, n - 1) if n > 1 else n]
    force_drafts(llm, plain_greedy, right)
    assert token_ids(llm) == plain_greedy
    metrics = llm.core.metrics.render()
    metrics = metrics.decode() if isinstance(metrics, bytes) else metrics
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("dcp_jax_spec_decode")}
    drafted, kept = values["dcp_jax_spec_decode_num_draft_tokens_total"], \
        values["dcp_jax_spec_decode_num_accepted_tokens_total"]
    counts = [draft_counts(GREEDY.max_tokens, n, r) for r in right]
    assert (drafted, kept) == tuple(map(sum, zip(*counts))), values
    assert draft_counts(12, 1, 1) == (5, 5) and draft_counts(12, 1, 0) == (10, 0)  # N = 1: 2 tokens a step, or 1
    assert values["dcp_jax_spec_decode_acceptance_rate"] == pytest.approx(kept / drafted)
    scheduler = llm.core.scheduler
    assert scheduler.allocator.num_free == llm.engine_config.num_pages and not scheduler.running
    del llm.runner.dispatch  # the drafts the MTP layer makes again
    assert_an_abort_between_verify_steps_frees_its_pages(llm, plain_greedy)


def assert_an_abort_between_verify_steps_frees_its_pages(llm, plain_greedy):
    """A drafting request holds pages for its verify rows (and with N >= 2 the chained passes' after them); aborted
    mid-generation it gives them all back, and the others' output is still greedy decoding's."""
    core = llm.core
    requests = [core.make_request(prompt, GREEDY) for prompt in PROMPTS]
    for request in requests:
        core.add(request)
    while len(requests[1].output_ids) < 2:
        core.step()
    assert core.abort(requests[1].request_id) is requests[1] and requests[1].finish_reason == "abort"
    while core.has_work:
        core.step()
    assert [requests[0].output_ids, requests[2].output_ids] == [plain_greedy[0], plain_greedy[2]]
    assert core.scheduler.allocator.num_free == llm.engine_config.num_pages and not core.scheduler.running


def test_penalties_apply_to_each_verify_row_as_without_drafts(plain_llm):
    """Presence, frequency and repetition penalties with drafting (N = 3, drafts forced right, so rows after kept
    drafts decide): each row is penalized for the drafts before it too, so greedy output is decoding's without
    drafts."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, presence_penalty=0.8,
                            frequency_penalty=0.6, repetition_penalty=1.3)
    expected = token_ids(plain_llm, params)
    assert expected != token_ids(plain_llm)  # the penalties change the output
    llm = make_llm(2, 2, MTP3)
    force_drafts(llm, expected, [3, 3, 1])
    assert token_ids(llm, params) == expected


def test_sampled_output_with_mtp_is_reproducible_per_seed():
    llm = make_llm(2, 1)
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    first, again = token_ids(llm, params), token_ids(llm, params)
    assert first == again and all(len(ids) == 10 for ids in first)
    assert all(0 <= t < TINY.vocab_size for ids in first for t in ids)


def test_bad_speculative_configurations_are_refused():
    for config, message in (({"method": "ngram", "num_speculative_tokens": 1}, "method 'ngram'"),
                            ({"method": "mtp", "num_speculative_tokens": 4}, "num_speculative_tokens must be"),
                            ({"method": "mtp"}, "num_speculative_tokens must be"),
                            ({"method": "mtp", "num_speculative_tokens": 1, "model": "x"}, "unsupported fields")):
        with pytest.raises(ValueError, match=message):
            make_llm(speculative_config=config)
    with pytest.raises(ValueError, match="has no MTP layer"):
        make_llm(speculative_config=MTP, hf_overrides={"num_nextn_predict_layers": 0})
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 must be >= max_num_seqs=4 x 2"):
        make_llm(max_num_batched_tokens=4)


def test_the_engine_serves_with_mtp_and_reports_it_in_metrics(tmp_path_factory, plain_greedy):
    """The server's engine compiles its programs at start (the verify groups' shapes; nothing compiles after),
    streams greedy decoding's output and exposes the acceptance in /metrics."""
    from tests.serving.serving_utils import make_engine

    engine = make_engine(tmp_path_factory, speculative_config=MTP, prompt_logprobs=False,
                         bucket_ladder=(8,)).start()
    try:
        for prompt, tokens in zip(PROMPTS, plain_greedy):
            events = list(engine.generate(prompt, GREEDY))
            assert [t for e in events for t in e.token_ids] == tokens
        assert engine.compiles_after_warmup == 0
        metrics = engine.metrics.render()
        metrics = metrics.decode() if isinstance(metrics, bytes) else metrics
        assert "dcp_jax_spec_decode_num_draft_tokens_total" in metrics
        assert "dcp_jax_spec_decode_mean_accepted_length" in metrics
    finally:
        engine.stop()


def test_a_checkpoints_mtp_layer_drafts_and_a_cut_checkpoint_is_refused(tmp_path, plain_greedy):
    """The MTP layer saved with a checkpoint (`save_hf(..., mtp=)`) is the one that drafts: the preset's random
    weights saved and served again give the same greedy output, drafting or not; a checkpoint cut to fewer layers
    has no MTP layer after its last one (refused before loading)."""
    from dcp_jax.model.deepseek_v32 import init_params
    from dcp_jax.model.deepseek_v32 import init_mtp_params
    from dcp_jax.model.weights import save_hf

    save_hf(TINY, init_params(TINY, seed=0), tmp_path, mtp=init_mtp_params(TINY, seed=1))
    kw = dict(max_model_len=64, max_num_seqs=4, page_size=4, dtype="float32", kernels="reference")
    assert token_ids(LLM(str(tmp_path), speculative_config=MTP, **kw)) == plain_greedy
    with pytest.raises(ValueError, match="cut to num_layers has no MTP layer"):
        LLM(str(tmp_path), speculative_config=MTP, num_layers=1, **kw)


@pytest.mark.slow  # the fp8 MTP layer's programs also run every suite in tests/bench/test_bench_mtp.py
def test_a_block_fp8_checkpoints_mtp_layer_drafts_in_fp8(tmp_path):
    """DeepSeek's release format with its MTP layer in block fp8 (blocks of 16): the layer the engine drafts with
    holds its fp8 weights (`quantization` auto) and drafting leaves the fp8 model's greedy output unchanged."""
    import json

    from safetensors.numpy import load_file, save_file

    from dcp_jax.model import fp8_linear
    from dcp_jax.model.deepseek_v32 import init_params
    from dcp_jax.model.deepseek_v32 import init_mtp_params
    from dcp_jax.model.weights import save_hf
    from tests.model.test_weights import BLOCK16, FP8_16_CONFIG, _block_fp8

    save_hf(TINY, init_params(TINY, seed=0), tmp_path / "f32", mtp=init_mtp_params(TINY, seed=1))
    tensors = load_file(str(tmp_path / "f32" / "model.safetensors"))
    (tmp_path / "fp8").mkdir()
    save_file(tensors | _block_fp8(tensors, BLOCK16)[0], str(tmp_path / "fp8" / "model.safetensors"))
    config = json.loads((tmp_path / "f32" / "config.json").read_text())
    config["quantization_config"] = FP8_16_CONFIG["quantization_config"]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    kw = dict(max_model_len=64, max_num_seqs=4, page_size=4, dtype="float32", kernels="reference")
    plain = token_ids(LLM(str(tmp_path / "fp8"), **kw))
    drafting = LLM(str(tmp_path / "fp8"), speculative_config=MTP3, **kw)
    _, mtp = drafting.runner.params  # (the model's, the MTP layer's), as the step programs take them
    assert fp8_linear.weight_block(mtp) == BLOCK16
    assert token_ids(drafting) == plain
