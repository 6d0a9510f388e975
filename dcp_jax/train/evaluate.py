"""Retrieval accuracy of a model as users run it: prompts of the task (`retrieval.py`) through `LLM.generate`,
greedy, an example right when the generated text is its answer exactly."""

from __future__ import annotations

import numpy as np

from dcp_jax.host.sampling import SamplingParams
from dcp_jax.train.retrieval import ANSWER_BYTES, make_example, records_for


def served_accuracy(llm, *, context: int, examples: int, seed: int = 0) -> float:
    """The share of `examples` prompts filling `context` tokens whose greedy answer through `llm` is right."""
    rng = np.random.default_rng([seed, context])
    cases = [make_example(rng, records_for(context)) for _ in range(examples)]
    outputs = llm.generate(prompts=[prompt for prompt, _ in cases],
                           sampling_params=SamplingParams(max_tokens=ANSWER_BYTES, temperature=0, ignore_eos=True))
    return sum(out.outputs[0].text == answer for out, (_, answer) in zip(outputs, cases)) / examples
