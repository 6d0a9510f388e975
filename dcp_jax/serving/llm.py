"""The offline API, vLLM-style: `LLM(model=path_or_preset, dcp=N, ...)` and `LLM.generate(...)`.

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

from dcp_jax.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from dcp_jax.host.sampling import SamplingParams
from dcp_jax.host.scheduler import Request, Scheduler
from dcp_jax.runtime.forward import VARIANTS
from dcp_jax.runtime.multihost import Distributed, PeerLost, connect, follow
from dcp_jax.serving.core import ServingCore
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
    """A DeepSeek-V3.2 model on `tp` devices (default `dcp`), KV split over DCP groups of `dcp` ranks.

    model: a preset name (`tiny`, `deepseek-v3.2`, `glm-5`; random weights), a shipped checkpoint's name or a HF
    checkpoint directory.
    max_model_len: None takes the model's max_position_embeddings, capped by what the KV pool holds.
    index_cache: the indexer key cache, "exact" (model dtype, HF's math) or "fp8" (e4m3 keys and an f32 scale per
    token, scored with fp8 queries).
    latent_cache: the MLA latent cache, "exact" (the pool's dtype) or "fp8" (656 B/token at DeepSeek's sizes: e4m3
    latent with an f32 scale per 128 columns, bf16 rope; attention reads the dequantized values, and on a GPU its
    kernel computes in bf16).
    dtype: "auto" (the checkpoint's; bfloat16 for presets), "bfloat16" or "float32": the activations' and the
    weights' not kept in fp8.
    quantization: "auto" (the checkpoint's: a block fp8 checkpoint's linear weights stay e4m3 with their block
    scales, multiplied by a fine-grained fp8 GEMM), "none" (dequantized into dtype on load) or "fp8" (also an
    unquantized checkpoint's or a preset's linear weights quantized to block fp8 on load).
    num_pages None: what fits gpu_memory_utilization of the GPU's memory after the weights (CPU: max_num_seqs
    requests of max_model_len).
    max_num_batched_tokens: rows of one step at most (decode rows and prefill-chunk tokens; vLLM's name).
    async_scheduling: dispatch each step before reading the previous one's tokens (`core.py`).
    enable_prefix_caching: reuse the KV pages of full virtual blocks a prompt shares with earlier requests.
    enable_expert_parallel: split the routed experts whole over the tp ranks, each rank running only the tokens
    routed to its experts (vLLM's name); by default every rank runs every expert on its slice of their width.
    hf_overrides: config.json fields to replace (vLLM's name), e.g. {"index_topk": 4096}.
    speculative_config: {"method": "mtp", "num_speculative_tokens": N} (vLLM's; N in 1..3): the model's MTP layer
    drafts N tokens per request and step, verified in the next (greedy outputs unchanged in f32, a near-tie may flip
    in bf16; sampled ones distributed as the model's); steps then run synchronously.
    enable_tbo: two-batch overlap: each layer's attention runs as two micro-batches of the step's rows, so one's
    collectives can run beside the other's compute (same outputs).
    coordinator_address, num_processes, process_id: one process of a multi-host deployment (`runtime/multihost.py`;
    jax.distributed's names): every process constructs the same LLM and calls the same `generate`s; process 0
    schedules and every process returns its outputs.
    """

    def __init__(self, model: str = "tiny", *, dcp: int = 1, interleave: int = 1, tp: int | None = None,
                 max_num_seqs: int = 8, max_model_len: int | None = None, page_size: int = 16,
                 num_pages: int | None = None, kernels: str = "auto", seed: int = 0, num_layers: int | None = None,
                 index_cache: str = "exact", latent_cache: str = "exact", dtype: str = "auto",
                 gpu_memory_utilization: float = 0.9, async_scheduling: bool = True,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, enable_prefix_caching: bool = False,
                 enable_expert_parallel: bool = False, quantization: str = "auto", unroll_layers: bool = False,
                 hf_overrides: dict | None = None, speculative_config: dict | None = None,
                 enable_tbo: bool = False, coordinator_address: str | None = None, num_processes: int = 1,
                 process_id: int = 0):
        self.distributed = Distributed.of(coordinator_address, num_processes, process_id)
        loaded = load_model(model, dcp=dcp, interleave=interleave, tp=tp, page_size=page_size, num_pages=num_pages,
                            max_num_seqs=max_num_seqs, max_model_len=max_model_len, kernels=kernels, seed=seed,
                            num_layers=num_layers, index_cache=index_cache, latent_cache=latent_cache, dtype=dtype,
                            gpu_memory_utilization=gpu_memory_utilization,
                            max_num_batched_tokens=max_num_batched_tokens,
                            enable_expert_parallel=enable_expert_parallel, quantization=quantization,
                            unroll_layers=unroll_layers, hf_overrides=hf_overrides,
                            speculative_config=speculative_config, enable_tbo=enable_tbo,
                            distributed=self.distributed)
        self.dtype = loaded.dtype
        self.model_config, self.parallel_config, self.engine_config = loaded.cfg, loaded.parallel, loaded.engine
        self.tokenizer, self.runner, self.backend = loaded.tokenizer, loaded.runner, loaded.backend
        scheduler = Scheduler(self.engine_config, self.runner.layout, eos_token_id=self.model_config.eos_token_id,
                              new_detokenizer=self.tokenizer.new_detokenizer,
                              enable_prefix_caching=enable_prefix_caching)
        # Programs compile at their first use (an engine compiles them all at start-up).
        self.core = ServingCore(self.runner, scheduler, vocab_size=self.model_config.vocab_size, seed=seed,
                                has_prompt_logprobs=False, async_scheduling=async_scheduling)
        self._channel = None if self.distributed is None else connect(self.distributed, self.runner, VARIANTS)

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
            outcome = follow(self.runner, self._channel, VARIANTS)
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
