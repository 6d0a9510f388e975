"""dcp_jax/train/loop.py and scripts/train_tiny.py: the step learns (a fixed batch is fitted), the script's
checkpoint loads into `LLM` strictly and serves what the training forward computes."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcp_jax.model.deepseek_v32 import abstract_model, merge
from dcp_jax.serving.tokenizer import ByteTokenizer
from dcp_jax.train.forward import DENSE, RANDOM, SPARSE, sequence_forward
from dcp_jax.train.loop import DSA_TINY, Trainer, batches, init_train_params
from dcp_jax.train.retrieval import ANSWER_BYTES, CHAT_BYTES, chat_prompt, queries_for, records_for
from scripts.train_tiny import main, parse_stages


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """A persistent compilation cache for the module: each `main` builds a new Trainer, whose programs the first
    run compiled. jax keeps the first directory a process sets (an engine test's, in a worker that ran one first)."""
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


SMALL = dataclasses.replace(DSA_TINY.with_indexer(topk=16), num_hidden_layers=2)


def test_a_fixed_batch_is_fitted_in_both_modes():
    tokenizer = ByteTokenizer(SMALL.vocab_size)
    tokens, mask = next(batches(tokenizer, np.random.default_rng(0), context=64, batch=4))
    trainer = Trainer(SMALL, init_train_params(SMALL, 0), learning_rate=3e-3, total_steps=60, warmup_steps=5)
    first = trainer.evaluate(tokens, mask, DENSE)
    for step in range(60):
        trainer.step(tokens, mask, DENSE if step < 40 else SPARSE)
    last = trainer.evaluate(tokens, mask, SPARSE)
    assert last["lm"] < 0.5 * first["lm"], (first, last)
    assert last["mtp_lm"] < 0.5 * first["mtp_lm"], (first, last)
    assert last["indexer_kl"] < first["indexer_kl"], (first, last)
    assert 0 <= first["mtp_acceptance"] <= 1 and last["mtp_acceptance"] > first["mtp_acceptance"], (first, last)


@pytest.mark.slow  # the `trained` run below trains through the fp8 caches too; test_forward.py checks the roundings
def test_quantization_aware_training_reads_the_main_and_mtp_layers_through_the_fp8_caches():
    """A Trainer with fp8 CacheFormats scores the same batch differently from the exact one (the main model's loss
    and the MTP layer's alike) and steps to finite weights (the rounding's gradient: test_forward.py)."""
    from dcp_jax.train.forward import CacheFormats

    tokens, mask = next(batches(ByteTokenizer(SMALL.vocab_size), np.random.default_rng(6), context=64, batch=2))
    metrics = {}
    for caches in (CacheFormats(), CacheFormats("fp8", "fp8")):
        trainer = Trainer(SMALL, init_train_params(SMALL, 3), learning_rate=1e-3, total_steps=2, caches=caches)
        metrics[caches] = trainer.evaluate(tokens, mask, SPARSE)
        trainer.step(tokens, mask, SPARSE)
        assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(trainer.params))
    exact, fp8 = metrics.values()
    assert exact["lm"] != fp8["lm"] and exact["mtp_lm"] != fp8["mtp_lm"], (exact, fp8)
    assert abs(exact["lm"] - fp8["lm"]) < 0.1 * exact["lm"], (exact, fp8)  # a rounding, not another model


def test_the_mtp_loss_is_its_logits_of_the_token_two_past_each_row():
    """batch_loss's MTP terms by hand: MTP row r predicts token r + 2, taken where token r + 2 is an answer token
    (mask[r + 1]); its acceptance compares row r's argmax with the main model's at position r + 1."""
    from dcp_jax.model.deepseek_v32 import abstract_mtp
    from dcp_jax.train.forward import mtp_forward
    from dcp_jax.train.loop import batch_loss

    tokens, mask = next(batches(ByteTokenizer(SMALL.vocab_size), np.random.default_rng(4), context=64, batch=1))
    params = init_train_params(SMALL, 2)
    graphdefs, abstracts = {}, {}
    graphdefs["model"], abstracts["model"] = abstract_model(SMALL)
    graphdefs["mtp"], abstracts["mtp"] = abstract_mtp(SMALL)
    _, metrics = jax.jit(lambda p: batch_loss(p, tokens, mask, cfg=SMALL, graphdefs=graphdefs, abstracts=abstracts,
                                              mode=SPARSE, kl_weight=1.0, mtp_weight=0.3))(params)

    @jax.jit
    def forwards(params, row):
        model = merge(graphdefs["model"], abstracts["model"], params["model"])
        out = sequence_forward(model, row, mode=SPARSE)
        mtp = merge(graphdefs["mtp"], abstracts["mtp"], params["mtp"])
        return out, mtp_forward(model, mtp, row, out.hidden, mode=SPARSE)

    out, drafted = forwards(params, jnp.asarray(tokens[0]))
    rows = np.flatnonzero(mask[0, 1:-1])  # rows r with token r + 2 an answer token
    log_probs = np.asarray(jax.nn.log_softmax(drafted.logits))
    want = -np.mean([log_probs[r, tokens[0, r + 2]] for r in rows])
    np.testing.assert_allclose(float(metrics["mtp_lm"]), want, rtol=1e-5)
    digits = rows[1:-1]  # the value's digits: not `v`, not `;`
    main_argmax, draft_argmax = np.argmax(out.logits, -1), np.argmax(drafted.logits, -1)
    np.testing.assert_allclose(float(metrics["mtp_acceptance"]), np.mean(draft_argmax[digits] ==
                                                                         main_argmax[digits + 1]), rtol=1e-6)


def test_chat_batches_wrap_the_prompts_in_the_chat_template_and_fit_the_context():
    tokenizer = ByteTokenizer(SMALL.vocab_size)
    rng = np.random.default_rng(1)
    for chat_fraction in (1.0, 0.5):
        data = batches(tokenizer, rng, context=64, batch=2, chat_fraction=chat_fraction)
        for tokens, mask in (next(data) for _ in range(6)):
            text = tokenizer.decode(tokens[0])
            prompt = re.fullmatch(r"(?:<\|user\|>\n)?((?:k[a-z]{4}=v[0-9]{4};)+\?k[a-z]{4}=)(?:\n<\|assistant\|>\n)?"
                                  r"v[0-9]{4};", text)
            assert prompt, text
            is_chat = text.startswith("<|user|>")
            assert text[: -6] == (chat_prompt(prompt.group(1)) if is_chat else prompt.group(1))
            assert tokens.shape[1] == (64 if is_chat else 64 - CHAT_BYTES) - (64 - CHAT_BYTES - 1 - 13) % 12
            assert tokenizer.decode(tokens[0, 1:][mask[0, :-1]]) == text[-6:]


def test_mixed_batches_fill_the_context_and_chat_ones_ask_one_query_after_the_most_records():
    tokenizer = ByteTokenizer(SMALL.vocab_size)
    data = batches(tokenizer, np.random.default_rng(2), context=160, batch=3, mixed=True, chat_fraction=0.5)
    kinds = set()
    for tokens, mask in (next(data) for _ in range(8)):
        assert tokens.shape == (3, 160)
        for row in range(3):
            ids = tokens[row].tolist()
            end = len(ids) - next(i for i, t in enumerate(reversed(ids)) if t != tokenizer.eos_token_id)
            assert not mask[row, end - 1:].any() and mask[row, end - ANSWER_BYTES - 1]
            text = tokenizer.decode(ids[:end])
            records = len(re.findall(r"(?<![?])k[a-z]{4}=v[0-9]{4};", text))
            if text.startswith("<|user|>"):
                kinds.add("chat")
                assert text.count("?") == 1 and records == records_for(160 - CHAT_BYTES)
                prompt = re.fullmatch(r"<\|user\|>\n(.*)\n<\|assistant\|>\nv[0-9]{4};", text, re.S)
                assert prompt and text[: -ANSWER_BYTES] == chat_prompt(prompt.group(1))
            else:
                kinds.add("bare")
                assert text.count("?") == queries_for(160, records) >= 1
    assert kinds == {"chat", "bare"}


def test_stages_are_parsed_and_bad_ones_refused():
    stages = parse_stages("dense:10:512:8,sparse:5:1024:2:3,sparse:5:256:4:mixed")
    assert [(s.mode, s.steps, s.context, s.batch, s.queries, s.mixed) for s in stages] == [
        ("dense", 10, 512, 8, 1, False), ("sparse", 5, 1024, 2, 3, False), ("sparse", 5, 256, 4, 1, True)]
    for bad in ("dense:10:512", "causal:1:2:3", "sparse:0:64:1", "dense:1:64:2:some", "dense:1:64:2:0"):
        with pytest.raises(Exception, match="mode:steps:context:batch"):
            parse_stages(bad)


# One shape a stage (no chat-wrapped batches: each would compile a second one), through the fp8 caches' rounding;
# --eval-contexts last.
STAGES = ["--stages", "dense:2:64:2,sparse:2:96:2", "--chat-fraction", "0", "--eval-every", "1", "--index-cache",
          "fp8", "--latent-cache", "fp8", "--eval-contexts", ""]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A whole run of a four-step schedule: its output directory."""
    out = tmp_path_factory.mktemp("trained")
    assert main(["--out", str(out), *STAGES[:-2], "--eval-contexts", "96", "--eval-examples", "2"]) == 0
    return out


@pytest.fixture(scope="module")
def trained_llm(trained):
    """The trained checkpoint served by `LLM` (float32, the reference kernels)."""
    from dcp_jax.serving.llm import LLM

    return LLM(str(trained), dtype="float32", kernels="reference", max_model_len=128, page_size=4)


def test_the_script_writes_a_checkpoint_llm_serves_as_trained(trained, trained_llm):
    from dcp_jax.host.sampling import SamplingParams
    from dcp_jax.model.weights import load_hf_params

    evaluation = json.load(open(trained / "eval.json"))
    served = {"served", "served_chat", "served_fp8"}
    assert evaluation["examples"] == 2 and set(evaluation["accuracy"]) == served | {SPARSE, RANDOM}
    assert all(set(per_context) == {"96"} for per_context in evaluation["accuracy"].values())
    log = [json.loads(line) for line in open(trained / "train_log.jsonl")]
    assert [row["step"] for row in log] == [1, 2, 3, 4] and log[-1]["mode"] == "sparse"
    with np.load(trained / "train_state.npz") as saved:
        assert json.loads(str(saved["meta"]))["run"]["caches"] == {"index": "fp8", "latent": "fp8"}
    prompt = next(batches(ByteTokenizer(DSA_TINY.vocab_size), np.random.default_rng(5), context=96, batch=1))[0][0]
    out = trained_llm.generate(prompt_token_ids=[prompt[:-6].tolist()],
                       sampling_params=SamplingParams(max_tokens=1, temperature=0))
    params = load_hf_params(DSA_TINY, str(trained))
    graphdef, abstract = abstract_model(DSA_TINY)
    logits = sequence_forward(merge(graphdef, abstract, params), jnp.asarray(prompt[:-6]), mode=SPARSE).logits
    assert out[0].outputs[0].token_ids == [int(jnp.argmax(logits[-1]))]
    config = json.load(open(trained / "config.json"))
    assert config["torch_dtype"] == "bfloat16" and config["num_nextn_predict_layers"] == 1


def test_the_checkpoint_holds_the_mtp_layer_strictly(trained, tmp_path):
    """The MTP layer round-trips (bf16 on disk) and loads strictly: a missing tensor or a copy of the embedding
    that differs from the main model's is refused."""
    import shutil

    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    from dcp_jax.model.deepseek_v32 import DeepseekCheckpoint
    from dcp_jax.model.weights import load_mtp_params

    mtp_tensor_shapes, mtp_to_hf = DeepseekCheckpoint().mtp_tensor_shapes, DeepseekCheckpoint().mtp_to_hf

    mtp = load_mtp_params(DSA_TINY, str(trained))
    tensors = load_file(trained / "model.safetensors")
    assert set(mtp_tensor_shapes(DSA_TINY)) <= set(tensors)
    main_params = {"embed": tensors["model.embed_tokens.weight"], "lm_head": tensors["lm_head.weight"].T}
    for name, value in mtp_to_hf(DSA_TINY, mtp, main_params).items():
        np.testing.assert_array_equal(value.astype(ml_dtypes.bfloat16), tensors[name], err_msg=name)
    for broken in ("missing", "copy"):
        shutil.copy(trained / "config.json", tmp_path / "config.json")
        changed = dict(tensors)
        if broken == "missing":
            del changed["model.layers.4.hnorm.weight"]
        else:
            changed["model.layers.4.embed_tokens.weight"] = changed["model.layers.4.embed_tokens.weight"] * 2
        save_file(changed, tmp_path / "model.safetensors")
        with pytest.raises(ValueError, match="hnorm" if broken == "missing" else "differs from"):
            load_mtp_params(DSA_TINY, str(tmp_path))


def test_a_run_stopped_in_time_resumes_to_the_same_weights(trained, tmp_path):
    """--max-seconds stops at a step's end and leaves the state; --resume goes on to the whole run's weights."""
    from safetensors.numpy import load_file

    def saved_step():
        with np.load(tmp_path / "train_state.npz") as saved:
            return json.loads(str(saved["meta"]))["step"]

    assert main(["--out", str(tmp_path), *STAGES, "--max-seconds", "0"]) == 0  # one step, then stop
    assert saved_step() == 1 and not (tmp_path / "model.safetensors").exists()
    assert main(["--out", str(tmp_path), *STAGES, "--max-seconds", "0", "--resume"]) == 0  # mid-stage: one more
    assert saved_step() == 2 and not (tmp_path / "model.safetensors").exists()
    assert main(["--out", str(tmp_path), *STAGES, "--resume"]) == 0  # from the stages' boundary to the end
    assert saved_step() == 4 and (tmp_path / "model.safetensors").exists()
    whole, parts = load_file(trained / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    for name in whole:
        np.testing.assert_allclose(parts[name], whole[name], rtol=0, atol=1e-6, err_msg=name)
    assert [json.loads(line)["step"] for line in open(tmp_path / "train_log.jsonl")] == [1, 2, 3, 4]
    with pytest.raises(SystemExit, match="holds a run of"):
        main(["--out", str(tmp_path), "--stages", "dense:9:48:2", "--resume"])


def test_a_run_can_start_from_a_checkpoint(trained, tmp_path):
    """--init-from starts from a checkpoint's weights (its MTP layer's too): one step at the warm-up's first rate,
    zero, writes them back unchanged; a checkpoint of another architecture is refused before anything loads."""
    from safetensors.numpy import load_file

    out = tmp_path / "from"
    # The first stage's shape of STAGES: the module's compilation cache holds its programs.
    assert main(["--out", str(out), "--init-from", str(trained), "--stages", "dense:1:64:2", *STAGES[2:]]) == 0
    before, after = load_file(trained / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(after) == set(before)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    other = tmp_path / "other"
    other.mkdir()
    config = json.load(open(trained / "config.json"))
    json.dump(config | {"num_hidden_layers": 3}, open(other / "config.json", "w"))
    with pytest.raises(SystemExit, match="another architecture"):
        main(["--out", str(tmp_path / "refused"), "--init-from", str(other), *STAGES])


def test_served_accuracy_is_the_training_forwards_teacher_forced_accuracy(trained, trained_llm):
    """Greedy generation gives the answer exactly when every answer token is the argmax given the right prefix:
    the accuracy through `LLM` equals the training forward's on the same prompts (checked per prompt too); a
    random selection of the same size attends other keys."""
    import jax

    from dcp_jax.model.weights import load_hf_params
    from dcp_jax.train.evaluate import examples_for, forced_accuracy, served_accuracy

    llm = trained_llm
    graphdef, abstract = abstract_model(DSA_TINY)
    model = merge(graphdef, abstract, load_hf_params(DSA_TINY, str(trained)))
    tokenizer = ByteTokenizer(DSA_TINY.vocab_size)
    for seed in range(3):
        served = served_accuracy(llm, context=96, examples=1, seed=seed)
        assert served == forced_accuracy(model, tokenizer, context=96, examples=1, seed=seed, mode=SPARSE), seed
    assert served_accuracy(llm, context=96, examples=6, seed=3) == forced_accuracy(
        model, tokenizer, context=96, examples=6, seed=3, mode=SPARSE)
    prompt = jnp.asarray(tokenizer.encode("".join(examples_for(160, 1)[0])))  # past index_topk 64
    chosen = np.asarray(jax.jit(lambda row: sequence_forward(model, row, mode=SPARSE).selected)(prompt))
    drawn = np.asarray(jax.jit(lambda row: sequence_forward(model, row, mode=RANDOM, key=jax.random.key(0))
                               .selected)(prompt))
    assert ((drawn >= 0).sum(-1) == (chosen >= 0).sum(-1)).all()  # as many keys, all earlier ones
    assert (drawn <= np.arange(len(prompt))[:, None]).all() and (np.sort(drawn) != np.sort(chosen)).any()
