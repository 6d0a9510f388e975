"""The offline API, vLLM-style: `LLM(model=path_or_preset, dcp=N, ...)` and `LLM.generate(...)`.

Continuous batching kept simple: waiting requests are admitted while a batch slot and their pages are free
(pages for prompt + max_tokens are reserved up front, so a running request never runs out), admitted requests are
prefilled together, then every running request decodes one token per step in the smallest bucket that holds them;
a finished request leaves the batch and its pages go back to the pool.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence

import numpy as np

from dcp_jax.loading import load_model
from dcp_jax.page_allocator import PageAllocator
from dcp_jax.sampling import SamplingParams, log_softmax, sample, top_logprobs


@dataclasses.dataclass
class RequestOutput:
    """One finished request. `logprobs[j]` holds the j-th generated token's logprob (log-softmax of the raw
    logits) and those of the `SamplingParams.logprobs` most likely tokens. finish_reason: "stop" or "length"."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]]
    finish_reason: str

    @property
    def outputs(self) -> list[RequestOutput]:
        """vLLM spells the completion `outputs[0]`; one completion per request here."""
        return [self]


@dataclasses.dataclass
class _Request:
    index: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    rng: np.random.Generator
    pages: list[int] = dataclasses.field(default_factory=list)
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.generated)


class LLM:
    """A DeepSeek-V3.2 model on `tp` devices (default `dcp`), KV split over DCP groups of `dcp` ranks.

    model: a preset name (`tiny`, `deepseek-v3.2`, `glm-5`; random weights) or a HF checkpoint directory.
    """

    def __init__(self, model: str = "tiny", *, dcp: int = 1, interleave: int = 1, tp: int | None = None,
                 max_num_seqs: int = 8, max_model_len: int = 512, page_size: int = 16, num_pages: int | None = None,
                 kernels: str = "auto", seed: int = 0, num_layers: int | None = None):
        loaded = load_model(model, dcp=dcp, interleave=interleave, tp=tp, page_size=page_size, num_pages=num_pages,
                            max_num_seqs=max_num_seqs, max_model_len=max_model_len, kernels=kernels, seed=seed,
                            num_layers=num_layers)
        self.cfg, self.parallel, self.engine, self.seed = loaded.cfg, loaded.parallel, loaded.engine, seed
        self.tokenizer, self.runner, self.backend = loaded.tokenizer, loaded.runner, loaded.backend
        self.runner.compile_decode()
        engine = loaded.engine
        self._allocator = PageAllocator(engine.num_pages)
        self._next_id = 0

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, *, use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        """Generate for `prompts` (text, tokenized with BOS) or `prompt_token_ids` (used as given); one
        SamplingParams for all or one per prompt. Returns one RequestOutput per prompt, in order."""
        requests = self._make_requests(prompts, prompt_token_ids, sampling_params)
        waiting, running = deque(requests), []
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(requests), desc="Processed prompts", unit="req")
        try:
            while waiting or running:
                admitted = self._admit(waiting, running)
                if admitted:
                    logits, _ = self.runner.prefill([r.prompt_ids for r in admitted], [r.pages for r in admitted])
                    self._append(admitted, logits)
                    running += admitted
                running = self._retire(running, progress)
                if running:
                    logits, _ = self.runner.decode([r.generated[-1] for r in running],
                                                   [r.context_len for r in running], [r.pages for r in running])
                    self._append(running, logits)
                    running = self._retire(running, progress)
        finally:
            for r in running + list(waiting):
                if r.pages:
                    self._allocator.free(r.pages)
                    r.pages = []
            if progress is not None:
                progress.close()
        return [RequestOutput(r.index, r.prompt, r.prompt_ids, r.generated, r.text, r.logprobs, r.finish_reason)
                for r in requests]

    def _make_requests(self, prompts, prompt_token_ids, sampling_params) -> list[_Request]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts and prompt_token_ids")
        if prompts is not None:
            prompts = [prompts] if isinstance(prompts, str) else list(prompts)
            if any(not isinstance(p, str) for p in prompts):
                raise TypeError("prompts must be strings (use prompt_token_ids for token ids)")
            ids = [self.tokenizer.encode(p) for p in prompts]
        else:
            ids = [[int(t) for t in p] for p in prompt_token_ids]
            prompts = [None] * len(ids)
        if not ids:
            raise ValueError("no prompts given")
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = [params] * len(ids) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(ids) or any(not isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"need one SamplingParams or one per prompt ({len(ids)}), got {sampling_params!r}")
        tokens_per_block = self.engine.page_size * self.parallel.dcp
        requests = []
        for i, (prompt_ids, p) in enumerate(zip(ids, params)):
            if not prompt_ids:
                raise ValueError(f"prompt {i} is empty")
            if min(prompt_ids) < 0 or max(prompt_ids) >= self.cfg.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.cfg.vocab_size})")
            total = len(prompt_ids) + p.max_tokens
            if total > self.engine.max_model_len:
                raise ValueError(f"prompt {i}: {len(prompt_ids)} prompt tokens + max_tokens={p.max_tokens} exceed "
                                 f"max_model_len={self.engine.max_model_len}")
            if -(-total // tokens_per_block) > self.engine.num_pages:
                raise ValueError(f"prompt {i} needs more KV pages than the pool holds ({self.engine.num_pages})")
            seed = p.seed if p.seed is not None else (self.seed, self._next_id)
            requests.append(_Request(i, prompts[i], prompt_ids, p, np.random.default_rng(seed)))
            self._next_id += 1
        return requests

    def _admit(self, waiting: deque, running: list) -> list[_Request]:
        admitted = []
        tokens_per_block = self.engine.page_size * self.parallel.dcp
        while waiting and len(running) + len(admitted) < self.engine.max_num_seqs:
            r = waiting[0]
            need = -(-(len(r.prompt_ids) + r.params.max_tokens) // tokens_per_block)
            if need > self._allocator.num_free:
                break
            r.pages = self._allocator.allocate(need)
            admitted.append(waiting.popleft())
        return admitted

    def _append(self, requests: list[_Request], logits: np.ndarray) -> None:
        """Sample each request's next token from its logits row and update its stop state."""
        for r, row in zip(requests, logits):
            token = sample(row, r.params, r.rng)
            r.generated.append(token)
            r.logprobs.append(top_logprobs(log_softmax(row), token, r.params.logprobs or 0))
            r.text = self.tokenizer.decode(r.generated)
            p = r.params
            hit = [r.text.find(s) for s in p.stop if s in r.text]
            if hit:
                r.text = r.text[: min(hit)]
                r.finish_reason = "stop"
            elif token in p.stop_token_ids or (token == self.cfg.eos_token_id and not p.ignore_eos):
                r.finish_reason = "stop"
            elif len(r.generated) >= p.max_tokens:
                r.finish_reason = "length"

    def _retire(self, running: list[_Request], progress) -> list[_Request]:
        still = []
        for r in running:
            if r.finish_reason is None:
                still.append(r)
                continue
            self._allocator.free(r.pages)
            r.pages = []
            if progress is not None:
                progress.update(1)
        return still

    @property
    def num_free_pages(self) -> int:
        return self._allocator.num_free
