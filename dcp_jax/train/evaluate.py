"""Retrieval accuracy of a model: as users run it (prompts of the task, `retrieval.py`, through `LLM.generate`,
greedy, an example right when the generated text is its answer exactly), and teacher-forced through the training
forward (right when every answer token is the argmax after the right prefix: the same verdict as greedy
generation, tested), which can also attend to a random selection instead of the indexer's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dcp_jax.host.sampling import SamplingParams
from dcp_jax.train.forward import sequence_forward
from dcp_jax.train.retrieval import ANSWER_BYTES, encode_batch, make_example, records_for


def examples_for(context: int, examples: int, seed: int = 0) -> list[tuple[str, str]]:
    """The (prompt, answer) pairs an evaluation at `context` tokens uses: drawn from seed and context alone."""
    rng = np.random.default_rng([seed, context])
    return [make_example(rng, records_for(context)) for _ in range(examples)]


def served_accuracy(llm, *, context: int, examples: int, seed: int = 0) -> float:
    """The share of `examples` prompts filling `context` tokens whose greedy answer through `llm` is right."""
    cases = examples_for(context, examples, seed)
    outputs = llm.generate(prompts=[prompt for prompt, _ in cases],
                           sampling_params=SamplingParams(max_tokens=ANSWER_BYTES, temperature=0, ignore_eos=True))
    return sum(out.outputs[0].text == answer for out, (_, answer) in zip(outputs, cases)) / examples


def forced_accuracy(model, tokenizer, *, context: int, examples: int, seed: int = 0, mode: str,
                    key: jax.Array | None = None) -> float:
    """The share of `examples_for(context, examples, seed)` whose answer tokens are all the argmax of `model` (a
    `DeepseekV32`) attending as `mode` (the training forward's; RANDOM draws from `key`, another draw a prompt)."""
    tokens, mask = encode_batch(tokenizer, examples_for(context, examples, seed))
    answer_logits = jax.jit(lambda row, k: sequence_forward(model, row, mode=mode, key=k).logits[-ANSWER_BYTES - 1:-1])
    right = 0
    for index, row in enumerate(tokens):
        row_key = None if key is None else jax.random.fold_in(key, index)
        predicted = np.asarray(jnp.argmax(answer_logits(jnp.asarray(row), row_key), axis=-1))
        right += bool(np.all(predicted == row[-ANSWER_BYTES:]))
    return right / examples
