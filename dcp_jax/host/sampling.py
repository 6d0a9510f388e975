"""Sampling parameters, the host sampler and the logprobs it reports (numpy only, no jax).

Logits come back from the step as f32 [R, A]; each row is sampled with its request's own generator, so a
request's tokens depend only on its seed, never on its batch neighbours. Logprobs are the log-softmax of the raw
logits (before temperature, top-k, top-p), as vLLM reports them.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """vLLM-style. temperature 0 is greedy; top_k 0 or -1 and top_p 1 disable those filters; logprobs N asks
    for the N most likely tokens of every step (the sampled one is always included); `stop` strings end the
    text (excluded from it), `stop_token_ids` and eos (unless ignore_eos) end the generation (kept in token_ids)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative int or None, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be a non-negative int or None, got {self.logprobs!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = list(self.stop_token_ids or [])
        if any(not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis."""
    x = np.asarray(logits, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def most_likely(scores: np.ndarray, n: int) -> np.ndarray:
    """Ids of the `n` largest scores, largest first, the lower id first among ties (a stable descending sort
    cut at n), in O(A) for n << A: a partition finds them, only they are sorted."""
    n = min(n, len(scores))
    if n <= 0:
        return np.zeros(0, np.int64)
    if 4 * n >= len(scores):
        return np.argsort(-scores, kind="stable")[:n]
    kth = scores[np.argpartition(-scores, n - 1)[n - 1]]  # the n-th largest value
    above = np.flatnonzero(scores > kth)
    ids = np.concatenate([above, np.flatnonzero(scores == kth)[: n - len(above)]])
    return ids[np.lexsort((ids, -scores[ids]))]


def kept_tokens(probs: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Token ids kept by top-k, then top-p (the smallest set of most likely tokens whose mass reaches top_p), most
    likely first. Only a prefix of the order is sorted: it grows until its mass reaches top_p."""
    limit = min(top_k, len(probs)) if top_k > 0 else len(probs)
    size = min(limit, 256)
    while True:
        order = most_likely(probs, size)
        kept = probs[order]
        mass = np.cumsum(kept)
        # Stop once the prefix's mass clears top_p by more than rounding: every later token is then cut.
        if size >= limit or top_p < 1 and mass[-1] > top_p + 1e-9:
            return order[mass - kept < top_p] if top_p < 1 else order  # mass of the more likely tokens < top_p
        size = min(limit, 4 * size)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from logits [A]: argmax when greedy (lowest id among ties), else temperature, then top-k and
    top-p when set, then a draw from `rng`. O(A) per call (plus sorting the kept tokens)."""
    logits = np.asarray(logits, np.float64)
    if params.is_greedy:
        return int(np.argmax(logits))
    probs = np.exp((logits - logits.max()) / params.temperature)
    probs /= probs.sum()
    if params.top_k <= 0 and params.top_p >= 1:
        return _draw(probs, rng)
    order = kept_tokens(probs, params.top_k, params.top_p)
    return int(order[_draw(probs[order], rng)])


def _draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """rng.choice(len(weights), p=weights / weights.sum()), the same draw, without its O(A) checks."""
    cdf = np.cumsum(weights)
    return int(np.searchsorted(cdf / cdf[-1], rng.random(), side="right"))


def top_logprobs(logprobs: np.ndarray, token: int, n: int) -> dict[int, float]:
    """{token id: logprob} of the `n` most likely tokens plus the sampled `token`."""
    return {int(t): float(logprobs[t]) for t in [token, *most_likely(logprobs, n).tolist()]}


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One position: the token's logprob and the top-N {token id: logprob} (the token itself included).
    text_offset: for a generated token, where its text starts in the request's generated text (the characters
    decoded before it; past a stop string's cut it exceeds the returned text). 0 for prompt tokens."""

    token_id: int
    logprob: float
    top: dict[int, float]
    text_offset: int = 0

    @classmethod
    def of(cls, logprobs: np.ndarray, token: int, top_n: int, text_offset: int = 0) -> TokenLogprob:
        """From a log-softmax row: the token's logprob and the `top_n` most likely tokens'."""
        token = int(token)
        return cls(token, float(logprobs[token]), top_logprobs(logprobs, token, top_n), text_offset)
