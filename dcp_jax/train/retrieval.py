"""The synthetic key-value retrieval task of the shipped tiny model, in bytes: a haystack of records
`k<key>=v<value>;` (key: 4 random lowercase ASCII letters, distinct within a prompt; value: 4 random decimal
digits), then a query `?k<key>=` for one of them, answered by `v<value>;`. Only attending to the one right record
answers it, so accuracy past index_topk tokens measures the indexer's selection.
"""

from __future__ import annotations

import string

import numpy as np

KEY_LETTERS, VALUE_DIGITS = 4, 4
RECORD_BYTES = 1 + KEY_LETTERS + 2 + VALUE_DIGITS + 1  # k<key>=v<value>;
QUERY_BYTES = 1 + 1 + KEY_LETTERS + 1  # ?k<key>=
ANSWER_BYTES = 1 + VALUE_DIGITS + 1  # v<value>;
_LETTERS = np.frombuffer(string.ascii_lowercase.encode(), np.uint8)
_DIGITS = np.frombuffer(string.digits.encode(), np.uint8)


def records_for(context: int) -> int:
    """Records in a prompt of at most `context` tokens (a BOS token, the records, the query and the answer)."""
    records = (context - 1 - QUERY_BYTES - ANSWER_BYTES) // RECORD_BYTES
    if records < 1:
        raise ValueError(f"a context of {context} tokens holds no record")
    return records


def make_example(rng: np.random.Generator, num_records: int) -> tuple[str, str]:
    """(prompt, answer): `num_records` records and a query for one of them, chosen uniformly."""
    if not 1 <= num_records <= len(_LETTERS) ** KEY_LETTERS:
        raise ValueError(f"{num_records=} must be in [1, {len(_LETTERS) ** KEY_LETTERS}]")
    codes = rng.choice(len(_LETTERS) ** KEY_LETTERS, num_records, replace=False)
    keys = _LETTERS[(codes[:, None] // len(_LETTERS) ** np.arange(KEY_LETTERS)[::-1]) % len(_LETTERS)]
    values = _DIGITS[rng.integers(0, 10, (num_records, VALUE_DIGITS))]
    asked = int(rng.integers(num_records))
    text = [f"k{bytes(k).decode()}=v{bytes(v).decode()};" for k, v in zip(keys, values)]
    return "".join(text) + f"?k{bytes(keys[asked]).decode()}=", f"v{bytes(values[asked]).decode()};"


def encode_batch(tokenizer, examples: list[tuple[str, str]]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, T] int32: BOS, prompt, answer; answer_mask [B, T] bool: the positions whose next token is an
    answer token, where the loss and the accuracy are taken). The examples must have one length."""
    rows = [tokenizer.encode(prompt + answer) for prompt, answer in examples]
    if len({len(row) for row in rows}) != 1:
        raise ValueError("the examples of a batch must have one length")
    tokens = np.asarray(rows, np.int32)
    mask = np.zeros(tokens.shape, bool)
    mask[:, -ANSWER_BYTES - 1: -1] = True
    return tokens, mask
