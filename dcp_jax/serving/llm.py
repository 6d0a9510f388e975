"""The offline API, vLLM-style: `LLM(model=path_or_preset, dcp=N, ...)` (any `EngineArgs`) and `LLM.generate(...)`.

`LLM` steps the same `ServingCore` as the serving engine, without a thread or streams: the same validation,
admission (first come first served while a batch slot, the token budget and the pages of the first prefill chunk
are free), chunked prefill, page growth and preemption, sampling and stop rules (EOS and stop token ids end the
generation and stay out of the text, stop strings cut it). Each step runs every running request's decode row and
prefill chunks up to `max_num_batched_tokens` rows, in the smallest bucket that holds them; programs compile at
their first use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dcp_jax.host.sampling import SamplingParams
from dcp_jax.host.scheduler import Request, Scheduler
from dcp_jax.runtime.forward import SERVING_KIND_NAMES
from dcp_jax.runtime.multihost import Distributed, PeerLost, connect, follow
from dcp_jax.serving.core import ServingCore
from dcp_jax.serving.engine_args import DEFAULT_MODEL, EngineArgs
from dcp_jax.serving.loading import load_model
from dcp_jax.serving.streams import output_text, stop_reason


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's). `logprobs[j]` (when `SamplingParams.logprobs` asked for them, else
    None) holds the j-th generated token's logprob (log-softmax of the raw logits) and those of the
    `SamplingParams.logprobs` most likely tokens. finish_reason: "stop" or "length"; stop_reason: the stop string
    or stop token id that ended it (None for EOS). `text` leaves out EOS and stop token ids and ends before a stop
    string unless `include_stop_str_in_output` (as the server's does)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str
    stop_reason: str | int | None = None


@dataclasses.dataclass
class RequestOutput:
    """One prompt's result (vLLM's): its `SamplingParams.n` completions in `outputs`."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


class LLM:
    """A model of the registry (DeepSeek-V3.2) on `tp` devices (default `dcp`), KV split over DCP groups of `dcp`
    ranks, for offline generation.

    model: a shipped checkpoint's name (dsa-tiny, the default), a preset name (`tiny`, `deepseek-v3.2`, `glm-5`;
    random weights) or a HF checkpoint directory. Every other keyword is an engine argument (`EngineArgs`: its
    field names, or vLLM's aliases such as tensor_parallel_size, decode_context_parallel_size, block_size; each is
    documented there once), e.g. dcp, interleave, tp, page_size, max_num_seqs, max_model_len, dtype, quantization,
    kv_cache_dtype / latent_cache / index_cache, kernels, enable_prefix_caching, enable_expert_parallel,
    hf_overrides, speculative_config (the MTP layer drafts; steps then run synchronously), enable_tbo,
    async_scheduling, and coordinator_address, num_processes, process_id for one process of a multi-host deployment
    (`runtime/multihost.py`: every process constructs the same LLM and calls the same `generate`s; process 0
    schedules and every process returns its outputs). Programs compile at their first use.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.args = args
        self.distributed = Distributed.of(args.coordinator_address, args.num_processes, args.process_id)
        loaded = load_model(args, distributed=self.distributed)
        self.dtype = loaded.dtype
        self.model_config, self.parallel_config, self.engine_config = loaded.cfg, loaded.parallel, loaded.engine
        self.tokenizer, self.runner, self.backend = loaded.tokenizer, loaded.runner, loaded.backend
        scheduler = Scheduler(self.engine_config, self.runner.layout, eos_token_id=self.model_config.eos_token_id,
                              new_detokenizer=self.tokenizer.new_detokenizer,
                              enable_prefix_caching=args.enable_prefix_caching)
        self.core = ServingCore(self.runner, scheduler, vocab_size=self.model_config.vocab_size, seed=args.seed,
                                has_prompt_logprobs=False, async_scheduling=args.async_scheduling)
        self._channel = (None if self.distributed is None
                         else connect(self.distributed, self.runner, SERVING_KIND_NAMES))

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, *, use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        """Generate for `prompts` (text, tokenized with BOS) or `prompt_token_ids` (used as given); one
        SamplingParams for all or one per prompt. Returns one RequestOutput per prompt, in order, with the n
        completions its SamplingParams ask for (completion j draws from seed + j when seeded, as vLLM's). In a
        multi-host deployment process 0 generates and sends its outputs (or its error) to the others, which run its
        programs meanwhile and return them."""
        args, kwargs = (prompts, sampling_params, prompt_token_ids), dict(use_tqdm=use_tqdm)
        if self.distributed is None:
            return self._generate(*args, **kwargs)
        if not self.distributed.is_leader:
            outcome = follow(self.runner, self._channel, SERVING_KIND_NAMES)
            if outcome is None:
                raise PeerLost("the leader stopped")
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        try:
            outputs = self._generate(*args, **kwargs)
        except Exception as e:
            self.runner.mirror.result(e)
            raise
        self.runner.mirror.result(outputs)
        return outputs

    def close(self) -> None:
        """Multi-host: release the other processes (process 0), close the channel."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, *, use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        """`generate` on this process."""
        grouped, texts = self._make_requests(prompts, prompt_token_ids, sampling_params)
        requests = [r for choices in grouped for r in choices]
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(requests), desc="Processed prompts", unit="req", disable=None)  # a terminal only
        try:
            for r in requests:
                self.core.add(r)
            while self.core.has_work:
                self.core.step()
                if progress is not None:
                    progress.update(sum(r.is_finished for r in requests) - progress.n)
        finally:
            for r in requests:
                self.core.abort(r.request_id)  # a no-op for the finished; frees the pages of the rest
            if progress is not None:
                progress.close()
        failed = [r for r in requests if r.error]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return [RequestOutput(i, text, choices[0].prompt_ids, [
            CompletionOutput(j, output_text(r), r.output_ids,
                             [lp.top for lp in r.logprobs] if r.params.logprobs is not None else None,
                             r.finish_reason, stop_reason(r)) for j, r in enumerate(choices)])
            for i, (choices, text) in enumerate(zip(grouped, texts))]

    def _make_requests(self, prompts, prompt_token_ids, sampling_params
                       ) -> tuple[list[list[Request]], list[str | None]]:
        """Validate every prompt (ValueError before anything runs) and build its n requests, prompt by prompt."""
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
        for i, (prompt_ids, p) in enumerate(zip(ids, params)):
            try:
                self.core.validate(prompt_ids, p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return [[self.core.make_request(prompt_ids, p.for_choice(j), id_prefix="llm") for j in range(p.n)]
                for prompt_ids, p in zip(ids, params)], prompts

    @property
    def num_free_pages(self) -> int:
        return self.core.scheduler.allocator.num_free
