"""Sampling parameters and the host sampler (numpy only, no jax).

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


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token id from logits [A]: argmax when greedy (lowest id among ties), else temperature, top-k,
    top-p (smallest set of most likely tokens whose mass reaches top_p), then a draw from `rng`."""
    logits = np.asarray(logits, np.float64)
    if params.is_greedy:
        return int(np.argmax(logits))
    probs = np.exp(log_softmax(logits / params.temperature))
    order = np.argsort(-probs, kind="stable")
    if params.top_k > 0:
        order = order[: params.top_k]
    kept = probs[order]
    if params.top_p < 1:
        before = np.cumsum(kept) - kept  # mass of the more likely tokens
        kept = kept[before < params.top_p]
        order = order[: len(kept)]
    return int(order[rng.choice(len(kept), p=kept / kept.sum())])


def top_logprobs(logprobs: np.ndarray, token: int, n: int) -> dict[int, float]:
    """{token id: logprob} of the `n` most likely tokens plus the sampled `token`."""
    best = np.argsort(-logprobs, kind="stable")[:n]
    return {int(t): float(logprobs[t]) for t in [token, *best.tolist()]}
