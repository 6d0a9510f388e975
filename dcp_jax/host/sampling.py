"""Sampling parameters and the logprobs the device reports (numpy only, no jax). The sampler itself runs on the
device, inside the compiled programs (`runtime/sampler.py`).

A request's tokens depend only on its seed and their positions, never on its batch neighbours: its draws come
from a counter-based stream keyed by a 64-bit seed (`seed_words`), its own or one derived from the engine's seed
and its arrival number. Logprobs are the log-softmax of the raw logits (before penalties, temperature, top-k,
top-p), as vLLM reports them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# The most top logprobs a request may ask for (vLLM's max_logprobs default); the device computes this many.
MAX_LOGPROBS = 20
# Stop strings a request may give, and their length: the engine thread looks for each after every token, so a
# long list must not cost the other requests their time.
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 512
_SEED_MASK = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """vLLM's names and meanings. n completions of the prompt (each a request of its own: `for_choice`);
    temperature in [0, 2], 0 greedy (the lowest id among equal logits; then n must be 1, as in vLLM); top_k 0 or -1,
    top_p 1 and min_p 0 disable those filters; presence_penalty and frequency_penalty (in [-2, 2], 0: off) apply to
    the generated tokens, repetition_penalty (> 0, 1: off) to the prompt's and the generated ones; logprobs N (at
    most MAX_LOGPROBS, vLLM's max_logprobs) asks for the N most likely tokens of every step (the sampled one is
    always included); `stop` strings end the text (excluded from it unless include_stop_str_in_output),
    `stop_token_ids` and eos (unless ignore_eos) end the generation (kept in token_ids); vLLM's min_tokens: the
    first min_tokens tokens are never eos or a stop token id (the device does not sample them) and no stop string
    ends the text among them."""

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False

    def __post_init__(self):
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got "
                             f"{self.min_tokens!r}")
        if not np.isfinite(self.temperature) or not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if self.temperature == 0 and self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling (temperature 0), got {self.n}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not np.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative int or None, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be a non-negative int or None, got {self.logprobs!r}")
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            raise ValueError(f"Requested sample logprobs of {self.logprobs}, which is greater than max allowed: "
                             f"{MAX_LOGPROBS}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters")
        object.__setattr__(self, "stop", tuple(stop))
        ids = list(self.stop_token_ids or [])
        if any(not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of the n: one completion, drawing from seed + index when seeded (vLLM's
        child requests), so seeded choices differ and each is reproducible alone."""
        return dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + index)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def request_seed(params: SamplingParams, engine_seed: int, number: int) -> int:
    """The 64-bit seed of a request's draws: its own, else one mixed from the engine's seed and its arrival number
    (splitmix64's finalizer, so neighbouring numbers give unrelated streams)."""
    if params.seed is not None:
        return params.seed & _SEED_MASK
    z = (engine_seed * 0x9E3779B97F4A7C15 + number + 1) & _SEED_MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _SEED_MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _SEED_MASK
    return z ^ (z >> 31)


def seed_words(seed: int) -> tuple[int, int]:
    """A 64-bit seed as its (low, high) uint32 words, as the device's key takes it."""
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF


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
    def of(cls, token: int, logprob: float, top_ids, top_logprobs, top_n: int, text_offset: int = 0) -> TokenLogprob:
        """From the device's outputs for one position: the token, its logprob, and the most likely tokens and
        their logprobs (largest first), of which the first `top_n` are kept (after the token itself)."""
        token = int(token)
        top = {int(token): float(logprob)}
        top.update((int(t), float(lp)) for t, lp in zip(top_ids[:top_n], top_logprobs[:top_n]) if int(t) != token)
        return cls(int(token), float(logprob), top, text_offset)
