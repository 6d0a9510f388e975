"""Retrieval accuracy of a model: as users run it (prompts of the task, `retrieval.py`, through `LLM.generate`,
greedy, an example right when the generated text is its answer exactly), and teacher-forced through the training
forward (right when every answer token is the argmax after the right prefix: the same verdict as greedy
generation, tested), which can also attend to a random selection instead of the indexer's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dcp_jax.host.sampling import SamplingParams
from dcp_jax.train.forward import CacheFormats, sequence_forward
from dcp_jax.train.retrieval import ANSWER_BYTES, CHAT_BYTES, chat_prompt, encode_batch, make_example, records_for

# Room an evaluation prompt of `context` tokens leaves: the chat template's bytes and a generation of 8 tokens (a
# client's max_tokens past the answer), so either client's request fits a server of max_model_len `context`.
EVAL_ROOM = CHAT_BYTES + 8


def examples_for(context: int, examples: int, seed: int = 0) -> list[tuple[str, str]]:
    """The (prompt, answer) pairs an evaluation at `context` tokens uses (the prompt EVAL_ROOM tokens short of
    it, the answer included): drawn from seed and context alone."""
    rng = np.random.default_rng([seed, context])
    return [make_example(rng, records_for(context - EVAL_ROOM)) for _ in range(examples)]


def served_accuracy(llm, *, context: int, examples: int, seed: int = 0, chat: bool = False) -> float:
    """The share of `examples` prompts filling `context` tokens whose greedy answer through `llm` is right; with
    `chat` each prompt is wrapped in the chat template as /v1/chat/completions renders it."""
    cases = examples_for(context, examples, seed)
    outputs = llm.generate(prompts=[chat_prompt(prompt) if chat else prompt for prompt, _ in cases],
                           sampling_params=SamplingParams(max_tokens=ANSWER_BYTES, temperature=0, ignore_eos=True))
    return sum(out.outputs[0].text == answer for out, (_, answer) in zip(outputs, cases)) / examples


def forced_accuracy(model, tokenizer, *, context: int, examples: int, seed: int = 0, mode: str,
                    key: jax.Array | None = None, caches: CacheFormats = CacheFormats()) -> float:
    """The share of `examples_for(context, examples, seed)` whose answer tokens are all the argmax of `model` (a
    `DeepseekV32`) attending as `mode` (the training forward's; RANDOM draws each prompt's keys from its own
    fold of `key`) through `caches` (fp8: as served with those caches)."""
    tokens, _ = encode_batch(tokenizer, examples_for(context, examples, seed))
    graphdef, state = nnx.split(model)

    @jax.jit
    def answer_logits(state, row, row_key):
        out = sequence_forward(nnx.merge(graphdef, state), row, mode=mode, key=row_key, caches=caches)
        return out.logits[-ANSWER_BYTES - 1:-1]

    right = 0
    for index, row in enumerate(tokens):
        row_key = None if key is None else jax.random.fold_in(key, index)
        predicted = np.asarray(jnp.argmax(answer_logits(state, jnp.asarray(row), row_key), axis=-1))
        right += bool(np.all(predicted == row[-ANSWER_BYTES:]))
    return right / examples


def evaluate_checkpoint(path: str, *, contexts: list[int], examples: int, seed: int = 0) -> dict:
    """A trained checkpoint's accuracy per context: served (`LLM`, greedy, the checkpoint's dtype; the prompts
    bare and in the chat template, and bare with the fp8 index and latent caches), and teacher forced in float32
    attending to the indexer's selection and to a random one of the same size (the contrast that shows the
    selection matters): {"served"|"served_chat"|"served_fp8"|"sparse"|"random": {context: accuracy}}."""
    from dcp_jax.model import architecture
    from dcp_jax.model.weights import load_hf_params
    from dcp_jax.serving.llm import LLM
    from dcp_jax.serving.tokenizer import ByteTokenizer
    from dcp_jax.train.forward import RANDOM, SPARSE

    result = {}
    for cache_format, runs in (("exact", (("served", False), ("served_chat", True))),
                               ("fp8", (("served_fp8", False),))):
        llm = LLM(path, max_model_len=max(contexts), max_num_seqs=min(examples, 64), index_cache=cache_format,
                  latent_cache=cache_format)  # prompts leave EVAL_ROOM
        for name, chat in runs:
            result[name] = {context: served_accuracy(llm, context=context, examples=examples, seed=seed, chat=chat)
                            for context in contexts}
        del llm
    cfg = architecture.config_from_hf(path)
    functions = architecture.of(cfg).model
    model = functions.merge(*functions.abstract_model(cfg), load_hf_params(cfg, path))
    tokenizer = ByteTokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    for mode in (SPARSE, RANDOM):
        result[mode] = {context: forced_accuracy(model, tokenizer, context=context, examples=examples, seed=seed,
                                                 mode=mode, key=jax.random.key(seed) if mode == RANDOM else None)
                        for context in contexts}
    return result
