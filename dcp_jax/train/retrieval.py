"""The synthetic key-value retrieval task of the shipped tiny model, in bytes: a haystack of records
`k<key>=v<value>;` (key: 4 random lowercase ASCII letters, distinct within a prompt; value: 4 random decimal
digits), then a query `?k<key>=` for one of them, answered by `v<value>;`. Only attending to the one right record
answers it, so accuracy past index_topk tokens measures the indexer's selection.

Training examples may ask several queries in a row (`?k<key>=v<value>;` each, keys drawn independently, so no
answer follows from the earlier ones by elimination; the last one's answer the example's): every answer is
supervised, so a sequence teaches several retrievals (as multi-query associative recall trains), and its
beginning up to the first answer is an evaluation prompt's format exactly. A mixed example (`mixed_example`) draws
its number of records uniformly and fills the rest of its context with queries: one length of sequence teaches
retrieval among few records and among many. A prompt may also be wrapped in the server's chat template
(`chat_prompt`).
"""

from __future__ import annotations

import re
import string

import numpy as np

from dcp_jax.serving.chat_template import apply_chat_template

KEY_LETTERS, VALUE_DIGITS = 4, 4
RECORD_BYTES = 1 + KEY_LETTERS + 2 + VALUE_DIGITS + 1  # k<key>=v<value>;
QUERY_BYTES = 1 + 1 + KEY_LETTERS + 1  # ?k<key>=
ANSWER_BYTES = 1 + VALUE_DIGITS + 1  # v<value>;
_LETTERS = np.frombuffer(string.ascii_lowercase.encode(), np.uint8)
_DIGITS = np.frombuffer(string.digits.encode(), np.uint8)


def chat_prompt(prompt: str) -> str:
    """A prompt as the server's chat template renders a one-message conversation (the generation prompt added)."""
    return apply_chat_template([{"role": "user", "content": prompt}])


# Bytes the chat template adds around a prompt.
CHAT_BYTES = len(chat_prompt(""))
# A query answered in place: its answer's span is what `encode_batch` supervises besides the final answer.
_ANSWERED_QUERY = re.compile(r"\?k[a-z]{%d}=(v[0-9]{%d};)" % (KEY_LETTERS, VALUE_DIGITS))


def records_for(context: int, queries: int = 1) -> int:
    """Records in a prompt of at most `context` tokens (a BOS token, the records, the queries and their
    answers)."""
    records = (context - 1 - queries * (QUERY_BYTES + ANSWER_BYTES)) // RECORD_BYTES
    if records < 1:
        raise ValueError(f"a context of {context} tokens holds no record and {queries} queries")
    return records


def make_example(rng: np.random.Generator, num_records: int, queries: int = 1) -> tuple[str, str]:
    """(prompt, answer): `num_records` records, then `queries` queries of records drawn uniformly and
    independently, each but the last answered in the prompt; the answer is the last one's."""
    if not 1 <= num_records <= len(_LETTERS) ** KEY_LETTERS:
        raise ValueError(f"{num_records=} must be in [1, {len(_LETTERS) ** KEY_LETTERS}]")
    if queries < 1:
        raise ValueError(f"{queries=} must be >= 1")
    codes = rng.choice(len(_LETTERS) ** KEY_LETTERS, num_records, replace=False)
    keys = _LETTERS[(codes[:, None] // len(_LETTERS) ** np.arange(KEY_LETTERS)[::-1]) % len(_LETTERS)]
    values = _DIGITS[rng.integers(0, 10, (num_records, VALUE_DIGITS))]
    asked = rng.integers(num_records, size=queries)
    text = [f"k{bytes(k).decode()}=v{bytes(v).decode()};" for k, v in zip(keys, values)]
    text += [f"?k{bytes(keys[i]).decode()}=v{bytes(values[i]).decode()};" for i in asked[:-1]]
    return "".join(text) + f"?k{bytes(keys[asked[-1]]).decode()}=", f"v{bytes(values[asked[-1]]).decode()};"


def queries_for(context: int, records: int) -> int:
    """Queries (each answered) that fill a prompt of at most `context` tokens after a BOS token and `records`
    records."""
    return (context - 1 - records * RECORD_BYTES) // (QUERY_BYTES + ANSWER_BYTES)


def mixed_example(rng: np.random.Generator, context: int) -> tuple[str, str]:
    """(prompt, answer) of at most `context` tokens: a number of records drawn uniformly from 1 to
    `records_for(context)`, then as many queries as fit."""
    records = int(rng.integers(1, records_for(context) + 1))
    return make_example(rng, records, queries_for(context, records))


def encode_batch(tokenizer, examples: list[tuple[str, str]],
                 length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, T] int32: BOS, prompt, answer, a byte a token; answer_mask [B, T] bool: the positions whose
    next token is an answer token (the final answer's, and those of queries answered in the prompt), where the
    loss and the accuracy are taken). Without `length` the examples must have one length; with it, shorter ones
    are padded after their answer with EOS tokens (T = length), which no answer position attends (causal)."""
    rows = [tokenizer.encode(prompt + answer) for prompt, answer in examples]
    if length is None:
        if len({len(row) for row in rows}) != 1:
            raise ValueError("the examples of a batch must have one length")
        length = len(rows[0])
    if max(len(row) for row in rows) > length:
        raise ValueError(f"an example is longer than {length} tokens")
    tokens = np.full((len(rows), length), tokenizer.eos_token_id, np.int32)
    mask = np.zeros(tokens.shape, bool)
    for row, (ids, (prompt, _)) in enumerate(zip(rows, examples)):
        tokens[row, : len(ids)] = ids
        mask[row, len(ids) - ANSWER_BYTES - 1: len(ids) - 1] = True
        for found in _ANSWERED_QUERY.finditer(prompt):  # token p + 1 is byte p: the mask's positions are bytes'
            mask[row, found.start(1): found.end(1)] = True
    return tokens, mask

