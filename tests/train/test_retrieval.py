"""dcp_jax/train/retrieval.py: the task's format, its lengths and its answer positions."""

import re

import numpy as np
import pytest

from dcp_jax.serving.tokenizer import ByteTokenizer
from dcp_jax.train.retrieval import (ANSWER_BYTES, RECORD_BYTES, encode_batch, make_example, mixed_example,
                                     queries_for, records_for)


def test_an_example_asks_for_one_of_its_distinct_keys():
    rng = np.random.default_rng(0)
    for records in (1, 7, 300):
        prompt, answer = make_example(rng, records)
        found = re.fullmatch(r"((?:k[a-z]{4}=v[0-9]{4};)+)\?k([a-z]{4})=", prompt)
        assert found, prompt
        pairs = dict(re.findall(r"k([a-z]{4})=v([0-9]{4});", found.group(1)))
        assert len(pairs) == records  # distinct keys
        assert answer == f"v{pairs[found.group(2)]};"
    with pytest.raises(ValueError, match="num_records"):
        make_example(rng, 0)


def test_lengths_fit_the_context_and_the_mask_covers_the_answer():
    tokenizer = ByteTokenizer(264)
    for context in (64, 1024, 4096):
        records = records_for(context)
        tokens, mask = encode_batch(tokenizer, [make_example(np.random.default_rng(i), records) for i in range(3)])
        assert tokens.shape[1] <= context < tokens.shape[1] + RECORD_BYTES
        assert mask.sum(axis=1).tolist() == [ANSWER_BYTES] * 3
        answer = tokenizer.decode(tokens[0, 1:][mask[0, :-1]])  # the tokens the masked positions predict
        assert re.fullmatch(r"v[0-9]{4};", answer), answer
    with pytest.raises(ValueError, match="holds no record"):
        records_for(20)


def test_queries_answered_in_the_prompt_are_supervised_too():
    """A training example of several queries: keys of its records asked, each earlier one answered in place, every
    answer's tokens masked (and nothing else); its beginning up to the first answer is a one-query prompt."""
    tokenizer = ByteTokenizer(264)
    rng = np.random.default_rng(3)
    records = records_for(256, queries=5)
    assert 1 + records * RECORD_BYTES + 5 * (7 + ANSWER_BYTES) <= 256
    prompt, answer = make_example(rng, records, queries=5)
    found = re.fullmatch(r"((?:k[a-z]{4}=v[0-9]{4};)+)((?:\?k[a-z]{4}=v[0-9]{4};){4})\?k([a-z]{4})=", prompt)
    assert found, prompt
    pairs = dict(re.findall(r"k([a-z]{4})=v([0-9]{4});", found.group(1)))
    asked = re.findall(r"\?k([a-z]{4})=v([0-9]{4});", found.group(2))
    assert len(pairs) == records and all(pairs[k] == v for k, v in asked)
    assert found.group(3) in pairs and answer == f"v{pairs[found.group(3)]};"
    tokens, mask = encode_batch(tokenizer, [(prompt, answer)])
    assert mask.sum() == 5 * ANSWER_BYTES
    supervised = tokenizer.decode(tokens[0, 1:][mask[0, :-1]])
    assert supervised == "".join(f"v{v};" for _, v in asked) + answer
    first = prompt.index("?")
    assert re.fullmatch(r"(k[a-z]{4}=v[0-9]{4};)+\?k[a-z]{4}=", prompt[: first + 7])
    with pytest.raises(ValueError, match="queries"):
        make_example(rng, 3, queries=0)


def test_mixed_examples_draw_their_records_and_fill_the_rest_with_queries():
    """Every number of records from 1 to the most is drawn; the queries fill the context; a batch of them is padded
    after each answer with EOS, unsupervised."""
    tokenizer = ByteTokenizer(264)
    rng = np.random.default_rng(7)
    context = 160
    seen = set()
    for _ in range(200):
        prompt, answer = mixed_example(rng, context)
        records = len(re.findall(r"(?<![?])k[a-z]{4}=v[0-9]{4};", prompt))
        queries = prompt.count("?")
        seen.add(records)
        assert queries == queries_for(context, records) >= 1
        assert len(tokenizer.encode(prompt + answer)) <= context < len(tokenizer.encode(prompt + answer)) + 13
    assert seen == set(range(1, records_for(context) + 1))
    examples = [make_example(rng, 1), make_example(rng, 3, queries=2)]
    tokens, mask = encode_batch(tokenizer, examples, length=70)
    assert tokens.shape == (2, 70)
    for row, (prompt, answer) in enumerate(examples):
        ids = tokenizer.encode(prompt + answer)
        assert tokens[row, : len(ids)].tolist() == ids and set(tokens[row, len(ids):]) <= {tokenizer.eos_token_id}
        assert not mask[row, len(ids) - 1:].any() and mask[row, len(ids) - ANSWER_BYTES - 1]
        assert tokenizer.decode(tokens[row, 1:][mask[row, :-1]]).endswith(answer)
    with pytest.raises(ValueError, match="one length"):
        encode_batch(tokenizer, examples)
    with pytest.raises(ValueError, match="longer than 20"):
        encode_batch(tokenizer, examples, length=20)
