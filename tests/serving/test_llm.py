"""The offline API (`dcp_jax/llm.py`) and the `generate` command, on the HF oracle checkpoint and the tiny preset."""

from pathlib import Path

import numpy as np
import pytest

from dcp_jax import LLM, SamplingParams
from dcp_jax.cli import main
from dcp_jax.model.deepseek_v32 import layer_params
from dcp_jax.runtime import oracle

from tests.oracle import hf_tiny

FIXTURE = dict(np.load(Path(__file__).resolve().parents[1] / "fixtures" / "oracle" / "yarn.npz"))
PROMPTS = [FIXTURE["prompt_ids"][i, :n].tolist() for i, n in enumerate(FIXTURE["prompt_lens"])]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("yarn")
    hf_tiny.write_random_checkpoint(hf_tiny.tiny_configs()["yarn"], int(FIXTURE["seed"]), path)
    return path


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint), dcp=2, tp=4, interleave=2, max_num_seqs=4, max_model_len=64, page_size=4)


def test_greedy_generation_equals_hf(llm):
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    for i, out in enumerate(o.outputs[0] for o in outs):
        assert out.token_ids == FIXTURE["gen_tokens"][i].tolist()
        assert out.finish_reason == "length"
        chosen = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        np.testing.assert_allclose(chosen, FIXTURE["gen_logprobs"][i], atol=2e-3, rtol=0)
        assert all(len(lp) >= 2 for lp in out.logprobs)
        assert len(outs[i].outputs) == 1 and outs[i].prompt_token_ids == PROMPTS[i]
    assert llm.num_free_pages == llm.engine_config.num_pages


def test_expert_parallel_generates_the_same_greedy_tokens(checkpoint, llm):
    """Routed experts split whole over the 4 ranks: the same greedy tokens (HF's) and logprobs as the default
    split along their width."""
    ep = LLM(str(checkpoint), dcp=2, tp=4, interleave=2, max_num_seqs=4, max_model_len=64, page_size=4,
             enable_expert_parallel=True)
    assert ep.parallel_config.enable_expert_parallel and not llm.parallel_config.enable_expert_parallel
    outs, want = ep.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY), llm.generate(
        prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    for i, (out, ref) in enumerate(zip(outs, want)):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids == FIXTURE["gen_tokens"][i].tolist()
        chosen = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in (out, ref)]
        np.testing.assert_allclose(chosen[0], chosen[1], atol=1e-4, rtol=0)


def test_continuous_batching_more_requests_than_slots(llm):
    """8 requests through 4 slots with different max_tokens: late requests join while others decode, every
    output equals the HF greedy prefix, and every page comes back."""
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (10, 3, 7, 1, 2, 10, 5, 4)]
    outs = llm.generate(prompt_token_ids=PROMPTS + PROMPTS[::-1], sampling_params=params)
    order = [0, 1, 2, 3, 3, 2, 1, 0]
    for out, p, i in zip(outs, params, order):
        assert out.outputs[0].token_ids == FIXTURE["gen_tokens"][i, : p.max_tokens].tolist()
    assert llm.num_free_pages == llm.engine_config.num_pages


def test_stop_token_ids_and_stop_strings(llm):
    stop_at = int(FIXTURE["gen_tokens"][2, 3])
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at])
    out = llm.generate(prompt_token_ids=[PROMPTS[2]], sampling_params=params)[0].outputs[0]
    assert out.stop_reason == stop_at
    assert out.token_ids == FIXTURE["gen_tokens"][2, :4].tolist() and out.finish_reason == "stop"
    # As the server's Scheduler does: the stop token id ends the generation and stays out of the text.
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1])
    whole = llm.generate(prompts=["hello"], sampling_params=SamplingParams(max_tokens=12, temperature=0,
                                                                            ignore_eos=True))[0]
    assert whole.prompt_token_ids == llm.tokenizer.encode("hello")
    full = whole.outputs[0]
    assert full.text == llm.tokenizer.decode(full.token_ids)
    # The stop string is a character the greedy run actually generated (the seeded model is deterministic).
    visible = [c for c in full.text if c != "\ufffd"]
    assert visible, f"the greedy text {full.text!r} has no character to stop on"
    stop = visible[len(visible) // 2]
    cut = llm.generate(prompts=["hello"], sampling_params=SamplingParams(max_tokens=12, temperature=0,
                                                                          ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    assert cut.stop_reason == stop
    kept = llm.generate(prompts=["hello"], sampling_params=SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == cut.text + stop and kept.token_ids == cut.token_ids


def test_seeded_sampling_is_per_request(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=3)
    alone = llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=params)[0].outputs[0].token_ids
    batched = llm.generate(prompt_token_ids=[PROMPTS[0], PROMPTS[1]], sampling_params=[
        SamplingParams(max_tokens=4, temperature=1.0, seed=9), params])[1].outputs[0].token_ids
    assert alone == batched


def test_n_completions_per_prompt_draw_from_seed_plus_their_index(llm):
    """vLLM's n: RequestOutput.outputs holds n completions; seeded, completion j draws what a request of seed
    seed + j draws alone, so they differ."""
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=40, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[PROMPTS[0], PROMPTS[1]], sampling_params=params)
    assert [len(o.outputs) for o in out] == [3, 3] and [c.index for c in out[1].outputs] == [0, 1, 2]
    choices = [c.token_ids for c in out[0].outputs]
    assert len({tuple(c) for c in choices}) == 3
    for j, tokens in enumerate(choices):
        alone = SamplingParams(max_tokens=6, temperature=1.0, seed=40 + j, ignore_eos=True)
        assert llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=alone)[0].outputs[0].token_ids == tokens
    assert llm.num_free_pages == llm.engine_config.num_pages


def test_bad_requests_fail_before_running(llm):
    with pytest.raises(ValueError, match="exactly one"):
        llm.generate(prompts=["a"], prompt_token_ids=[[2]])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompt_token_ids=[PROMPTS[3]], sampling_params=SamplingParams(max_tokens=30))
    with pytest.raises(ValueError, match="token ids outside"):
        llm.generate(prompt_token_ids=[[5, 512]])
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt_token_ids=[[]])
    assert llm.num_free_pages == llm.engine_config.num_pages


def test_generate_command_with_a_hf_directory_and_the_tiny_preset(checkpoint, capsys):
    assert main(["generate", "--model", str(checkpoint), "--dcp", "2", "--prompt", "hi", "--max-tokens", "4",
                 "--max-model-len", "32", "--page-size", "4"]) == 0
    assert "(4 tokens, length)" in capsys.readouterr().out
    assert main(["generate", "--model", "tiny", "--dcp", "4", "--prompt", "hello", "--max-tokens", "3",
                 "--max-model-len", "32"]) == 0
    assert "model tiny" in capsys.readouterr().out
    assert main(["generate", "--model", "nope", "--prompt", "x"]) == 2
    assert main(["generate", "--model", str(checkpoint), "--num-layers", "2", "--prompt", "hi", "--max-tokens", "2",
                 "--max-model-len", "32", "--page-size", "4"]) == 0
    assert "(2 tokens, length)" in capsys.readouterr().out
    assert main(["generate", "--model", str(checkpoint), "--num-layers", "9", "--prompt", "x"]) == 2
    assert "num_layers=9 must be in [1, 3]" in capsys.readouterr().err


def test_runner_rejects_bad_pages_and_mismatched_rows(llm):
    runner, pages = llm.runner, llm.runner.engine.num_pages
    with pytest.raises(ValueError, match=f"pages past the pool's {pages}"):
        oracle.prefill(runner, [[1, 2, 3]], [[pages]])
    with pytest.raises(ValueError, match="its block table has 0 page ids"):
        oracle.prefill(runner, [[1, 2, 3]], [[]])
    with pytest.raises(ValueError, match="must match"):
        oracle.decode(runner, [1, 2], [3], [[0]])


def test_fp8_latent_cache_is_refused_for_a_checkpoint_it_cannot_tile(checkpoint, monkeypatch):
    """The HF tiny checkpoint's latent is 64 wide: refused with the reason, before any weight is read."""
    import dcp_jax.model.weights

    monkeypatch.setattr(dcp_jax.model.weights, "load_hf_params", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ValueError, match="needs kv_lora_rank a multiple of 128; this model's is 64"):
        LLM(str(checkpoint), latent_cache="fp8", max_model_len=32)


# Slow: the seed's line (tests/serving/test_seed_command_line.py) serves both fp8 caches every suite.
@pytest.mark.slow
@pytest.mark.parametrize("cache", ["index", "latent"])
def test_generate_with_an_fp8_cache_on_the_tiny_preset(cache, capsys):
    """The runner allocates, writes (prefill and decode) and reads the fp8 index (or latent) cache; greedy
    generation runs to the end, every page comes back, and the generate command takes the flag."""
    llm = LLM("tiny", dcp=2, interleave=2, max_num_seqs=2, max_model_len=32, page_size=4, **{f"{cache}_cache": "fp8"})
    assert getattr(llm.engine_config, f"{cache}_cache") == "fp8"
    outs = llm.generate(prompt_token_ids=[list(range(5, 25)), [7, 8, 9]],
                        sampling_params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [(len(out.outputs[0].token_ids), out.outputs[0].finish_reason) for out in outs] == [(8, "length")] * 2
    assert llm.num_free_pages == llm.engine_config.num_pages
    kv = llm.runner.kv_cache
    index_k, latent = kv.pools["index_k"], kv.pools["latent"]
    pool, values = (index_k, index_k.keys) if cache == "index" else (latent, latent.latent)
    assert values.dtype == np.dtype("float8_e4m3fn")
    # One power-of-two scale per token (and 128-column latent tile) written, by its owner rank only: each prompt,
    # then the 7 tokens fed back.
    assert np.count_nonzero(np.asarray(pool.scales)[:, 0]) == 20 + 3 + 2 * 7  # layer 0 of [W, L, ...]
    assert main(["generate", "--model", "tiny", "--dcp", "2", f"--{cache}-cache", "fp8", "--prompt", "hello",
                 "--max-tokens", "3", "--max-model-len", "32"]) == 0
    assert f"fp8 {cache} cache" in capsys.readouterr().out


def test_a_step_runs_the_program_its_rows_need():
    """All greedy: the greedy program; any drawing row: the drawing one; a chunk that wants prompt logprobs: the
    one that returns them (it draws too)."""
    from dcp_jax.runtime.runner import step_kind

    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)
    assert step_kind([greedy, greedy], prompt_logprobs=False).name == "greedy"
    assert step_kind([], prompt_logprobs=False).name == "greedy"  # intermediate chunks sample nothing
    assert step_kind([hot, greedy], prompt_logprobs=False).name == "sampled"
    assert step_kind([greedy], prompt_logprobs=True).name == "prompt_logprobs"
    assert [kind.draws for kind in (step_kind([greedy], prompt_logprobs=False), step_kind([hot], prompt_logprobs=False),
                                    step_kind([greedy], prompt_logprobs=True))] == [False, True, True]


def test_llm_keeps_a_block_fp8_checkpoint_in_fp8_and_generates(tmp_path):
    """DeepSeek's release format loads with quantization "auto": the placed projections are e4m3 with f32 block
    scales, split over the ranks, and greedy generation runs (its closeness to the dequantized model is
    tests/model/test_weights.py's)."""
    from tests.model import test_weights as w

    tensors = hf_tiny.random_tensors(w.HF_CONFIG, seed=5)
    w._write_fp8(tmp_path, tensors | w._block_fp8(tensors, w.BLOCK16)[0] | w.MTP, w.FP8_16_CONFIG)
    llm = LLM(str(tmp_path), dcp=2, tp=2, max_num_seqs=2, max_model_len=32, page_size=4)
    layer = layer_params(llm.model_config, llm.runner.params, 1)
    for weight in (layer["attention"]["wq_b"], layer["attention"]["wo"], layer["mlp"]["experts_down"]):
        assert weight.values.dtype == np.dtype("float8_e4m3fn") and weight.scales.dtype == np.float32
        assert len(weight.values.sharding.device_set) == 2
    assert layer["mlp"]["router"].dtype == np.float32
    outs = llm.generate(prompt_token_ids=[[5, 9, 17, 3], [300, 12]], sampling_params=SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
