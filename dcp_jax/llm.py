"""The offline API, vLLM-style: `LLM(model=path_or_preset, dcp=N, ...)` and `LLM.generate(...)`.

The serving engine's `Scheduler` drives the batch here too, without a thread or streams: the same admission (first
come first served while a batch slot and the pages of the prefill plus the first decode token are free), the same
page growth and preemption, the same stop rules (EOS and stop token ids end the generation and stay out of the
text, stop strings cut it). Each step prefills the admitted requests together, then every running request decodes
one token in the smallest bucket that holds them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dcp_jax.loading import load_model
from dcp_jax.sampling import SamplingParams, log_softmax, sample, top_logprobs
from dcp_jax.scheduler import Request, Scheduler


@dataclasses.dataclass
class RequestOutput:
    """One finished request. `logprobs[j]` holds the j-th generated token's logprob (log-softmax of the raw
    logits) and those of the `SamplingParams.logprobs` most likely tokens. finish_reason: "stop" or "length".
    `text` leaves out EOS and stop token ids and ends before a stop string (as the server's does)."""

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


class LLM:
    """A DeepSeek-V3.2 model on `tp` devices (default `dcp`), KV split over DCP groups of `dcp` ranks.

    model: a preset name (`tiny`, `deepseek-v3.2`, `glm-5`; random weights) or a HF checkpoint directory.
    index_cache: the indexer key cache, "exact" (model dtype, HF's math) or "fp8" (e4m3 keys and an f32 scale per
    token, scored with fp8 queries).
    latent_cache: the MLA latent cache, "exact" (the pool's dtype) or "fp8" (656 B/token at DeepSeek's sizes: e4m3
    latent with an f32 scale per 128 columns, bf16 rope; attention reads the dequantized values, and on a GPU its
    kernel computes in bf16).
    """

    def __init__(self, model: str = "tiny", *, dcp: int = 1, interleave: int = 1, tp: int | None = None,
                 max_num_seqs: int = 8, max_model_len: int = 512, page_size: int = 16, num_pages: int | None = None,
                 kernels: str = "auto", seed: int = 0, num_layers: int | None = None, index_cache: str = "exact",
                 latent_cache: str = "exact"):
        loaded = load_model(model, dcp=dcp, interleave=interleave, tp=tp, page_size=page_size, num_pages=num_pages,
                            max_num_seqs=max_num_seqs, max_model_len=max_model_len, kernels=kernels, seed=seed,
                            num_layers=num_layers, index_cache=index_cache, latent_cache=latent_cache)
        self.cfg, self.parallel, self.engine, self.seed = loaded.cfg, loaded.parallel, loaded.engine, seed
        self.tokenizer, self.runner, self.backend = loaded.tokenizer, loaded.runner, loaded.backend
        self.runner.compile_decode()
        self._scheduler = Scheduler(self.engine, self.parallel.dcp, eos_token_id=self.cfg.eos_token_id,
                                    detokenize=self.tokenizer.decode, max_prefills_per_step=self.engine.max_num_seqs)
        self._next_id = 0

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, *, use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        """Generate for `prompts` (text, tokenized with BOS) or `prompt_token_ids` (used as given); one
        SamplingParams for all or one per prompt. Returns one RequestOutput per prompt, in order."""
        sched = self._scheduler
        requests, texts = self._make_requests(prompts, prompt_token_ids, sampling_params)
        logprobs: dict[str, list[dict[int, float]]] = {r.request_id: [] for r in requests}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(requests), desc="Processed prompts", unit="req")
        try:
            for r in requests:
                sched.add(r)
            while sched.has_work:
                plan = sched.schedule()
                if plan.prefills:
                    logits, _ = self.runner.prefill([r.prefill_ids for r in plan.prefills],
                                                    [r.pages for r in plan.prefills])
                    for r, row in zip(plan.prefills, logits):
                        if not r.is_resumed:  # a recompute after preemption: its next token is already sampled
                            self._sample(r, row, logprobs[r.request_id])
                rows = sched.decode_rows(plan)
                if rows:
                    logits, _ = self.runner.decode([r.output_ids[-1] for r in rows], [r.context_len for r in rows],
                                                   [r.pages for r in rows])
                    for r, row in zip(rows, logits):
                        self._sample(r, row, logprobs[r.request_id])
                if progress is not None:
                    progress.update(sum(r.is_finished for r in requests) - progress.n)
        finally:
            for r in requests:
                sched.abort(r.request_id)  # a no-op for the finished; frees the pages of the rest
            if progress is not None:
                progress.close()
        return [RequestOutput(i, text, r.prompt_ids, r.output_ids, r.text, logprobs[r.request_id], r.finish_reason)
                for i, (r, text) in enumerate(zip(requests, texts))]

    def _sample(self, request: Request, logits: np.ndarray, logprobs: list[dict[int, float]]) -> None:
        token = sample(logits, request.params, request.rng)
        logprobs.append(top_logprobs(log_softmax(logits), token, request.params.logprobs or 0))
        self._scheduler.append_token(request, token)

    def _make_requests(self, prompts, prompt_token_ids, sampling_params) -> tuple[list[Request], list[str | None]]:
        """Validate every prompt (ValueError before anything runs) and build its request."""
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
        requests = []
        for i, (prompt_ids, p) in enumerate(zip(ids, params)):
            if not prompt_ids:
                raise ValueError(f"prompt {i} is empty")
            if min(prompt_ids) < 0 or max(prompt_ids) >= self.cfg.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.cfg.vocab_size})")
            try:
                self._scheduler.check_fits(len(prompt_ids), p.max_tokens)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            seed = p.seed if p.seed is not None else (self.seed, self._next_id)
            requests.append(Request(f"llm-{self._next_id}", prompt_ids, p, rng=np.random.default_rng(seed)))
            self._next_id += 1
        return requests, prompts

    @property
    def num_free_pages(self) -> int:
        return self._scheduler.allocator.num_free
