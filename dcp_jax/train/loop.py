"""Training the tiny retrieval model (issue 26): the architecture, the loss and one optax step, the stages.

Stages as DeepSeek-V3.2 trains its indexer: a dense stage (the main model attends to every earlier token and
learns the task by the LM loss; the indexer, on detached inputs, learns the main attention's distribution by its KL
loss: the warm-up), then a sparse stage (the main model attends to the indexer's top-k only; the indexer's KL is
taken over what it selected). The LM loss is the answer's tokens' (`retrieval.encode_batch`); accuracy counts an
example right when every answer token is the argmax.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dcp_jax.config import TINY, ModelConfig
from dcp_jax.model import architecture
from dcp_jax.runtime.xla_flags import step_compiler_options
from dcp_jax.train.forward import DENSE, SPARSE, CacheFormats, mtp_forward, sequence_forward
from dcp_jax.train.retrieval import (CHAT_BYTES, chat_prompt, encode_batch, make_example, mixed_example,
                                     records_for)

# The shipped model's shape: DeepSeek-V3.2's architecture (MLA with q_lora and the latent cache, the lightning
# indexer, one dense layer then MoE layers with shared experts and group routing, one MTP layer), byte vocabulary
# (2 specials + 256 bytes, rounded up), index_topk 64 so 1K-16K contexts are far past it.
DSA_TINY = dataclasses.replace(TINY.with_indexer(topk=64), vocab_size=264, num_hidden_layers=4,
                               max_position_embeddings=16384, num_nextn_predict_layers=1)
# DeepSeek-V3's MTP loss weight (lambda) for its first 10T tokens.
MTP_WEIGHT = 0.3


def init_train_params(cfg: ModelConfig, seed: int) -> dict:
    """Random f32 weights to train: {"model": the main model's, "mtp": the MTP layer's (when the config has
    one)}."""
    model = architecture.of(cfg).model
    params = {"model": model.init_params(cfg, seed)}
    if cfg.num_nextn_predict_layers:
        params["mtp"] = model.init_mtp_params(cfg, seed + 1)
    return params


@dataclasses.dataclass(frozen=True)
class Stage:
    """`steps` optimizer steps attending as `mode` on batches of `batch` examples of `context` tokens asking
    `queries` queries each (the records filling the rest), or `mixed_example`s when `mixed`."""

    mode: str
    steps: int
    context: int
    batch: int
    queries: int = 1
    mixed: bool = False


def batches(tokenizer, rng: np.random.Generator, *, context: int, batch: int, queries: int = 1, mixed: bool = False,
            chat_fraction: float = 0.0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless (tokens, answer_mask) batches of retrieval examples filling `context` tokens: of `queries` queries,
    or `mixed_example`s when `mixed` (padded to `context` tokens); a `chat_fraction` of the batches wrap each
    prompt in the chat template (`chat_prompt`), so the model answers through /v1/chat/completions too (their
    examples fit `context`; the others are CHAT_BYTES shorter unless mixed, as every batch has one length). A mixed
    chat batch asks one query after the most records: the final answer alone follows the template, and an example
    of many queries would train that format once."""
    if mixed:
        records = records_for(context - CHAT_BYTES)  # a chat batch's
    else:
        records = records_for(context - (CHAT_BYTES if chat_fraction else 0), queries)  # one length for every batch
    while True:
        chat = rng.random() < chat_fraction
        if mixed and chat:
            examples = [make_example(rng, records, 1) for _ in range(batch)]
        elif mixed:
            examples = [mixed_example(rng, context) for _ in range(batch)]
        else:
            examples = [make_example(rng, records, queries) for _ in range(batch)]
        if chat:
            examples = [(chat_prompt(prompt), answer) for prompt, answer in examples]
        yield encode_batch(tokenizer, examples, context if mixed else None)


def _value_positions(answer_mask):
    """The positions of a row's answer mask [T] (`encode_batch`'s) whose next token is a digit of the value: the
    answer's positions but its first (next `v`) and its last (next `;`)."""
    before = jnp.concatenate([jnp.zeros(1, bool), answer_mask[:-1]])
    after = jnp.concatenate([answer_mask[1:], jnp.zeros(1, bool)])
    return answer_mask & before & after


def _answer_terms(logits, tokens, mask):
    """(mean cross-entropy over the answer's tokens, whether every one is the argmax, the argmax [T-1]) of one
    row's logits [T, A] (position p's are of token p + 1)."""
    logits, targets, answer = logits[:-1], tokens[1:], mask[:-1]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], axis=-1)[:, 0]
    predicted = jnp.argmax(logits, axis=-1)
    right = jnp.all(jnp.where(answer, predicted == targets, True))
    return jnp.sum(nll * answer) / jnp.sum(answer), right, predicted


def batch_loss(params, tokens, mask, *, cfg: ModelConfig, graphdefs, abstracts, mode: str, kl_weight: float,
               mtp_weight: float, caches: CacheFormats = CacheFormats()):
    """(loss, metrics) of a batch read through `caches`: the mean answer cross-entropy, plus kl_weight times the
    indexers' KL (averaged over the attention layers, the MTP layer's included), plus mtp_weight times the MTP
    layer's answer cross-entropy (DeepSeek-V3's MTP loss, one depth). The MTP metrics: its accuracy on the answer
    tokens and its acceptance on the value's digits (its argmax there equal to the main model's, as a greedy draft
    is verified)."""
    merge = architecture.of(cfg).model.merge
    model = merge(graphdefs["model"], abstracts["model"], params["model"])
    mtp = merge(graphdefs["mtp"], abstracts["mtp"], params["mtp"]) if "mtp" in params else None
    layers = model.cfg.num_hidden_layers

    def one(row_tokens, row_mask):
        out = sequence_forward(model, row_tokens, mode=mode, caches=caches)
        lm, right, predicted = _answer_terms(out.logits, row_tokens, row_mask)
        row = dict(lm=lm, indexer_kl=out.indexer_kl, accuracy=right)
        if mtp is not None:
            drafted = mtp_forward(model, mtp, row_tokens, out.hidden, mode=mode, caches=caches)
            # Aligned with the main model's: position q's of token q + 1 (MTP row q - 1); position 0 has none.
            aligned = jnp.concatenate([jnp.zeros_like(drafted.logits[:1]), drafted.logits])
            mtp_lm, mtp_right, draft = _answer_terms(aligned, row_tokens, row_mask)
            digits = _value_positions(row_mask)[:-1]
            row |= dict(mtp_lm=mtp_lm, mtp_accuracy=mtp_right,
                        mtp_acceptance=jnp.sum(digits & (draft == predicted)) / jnp.sum(digits),
                        indexer_kl=(out.indexer_kl * layers + drafted.indexer_kl) / (layers + 1))
        return row

    metrics = jax.tree.map(jnp.mean, jax.vmap(one)(tokens, mask))
    loss = metrics["lm"] + kl_weight * metrics["indexer_kl"] + mtp_weight * metrics.get("mtp_lm", 0.0)
    return loss, metrics


class Trainer:
    """The parameters, an AdamW optimizer (a warm-up of at most a tenth of the steps, then cosine decay to a tenth
    of the rate; gradients clipped to norm 1) and a jitted step per attention mode; the forward reads through
    `caches` (fp8: quantization-aware training for the fp8 caches)."""

    def __init__(self, cfg: ModelConfig, params: dict, *, learning_rate: float, total_steps: int,
                 kl_weight: float = 1.0, mtp_weight: float = MTP_WEIGHT, warmup_steps: int = 100,
                 caches: CacheFormats = CacheFormats()):
        self.params = params
        dtype = jax.tree.leaves(params)[0].dtype
        graphdefs, abstracts = {}, {}
        graphdefs["model"], abstracts["model"] = architecture.of(cfg).model.abstract_model(cfg, dtype)
        if "mtp" in params:
            graphdefs["mtp"], abstracts["mtp"] = architecture.of(cfg).model.abstract_mtp(cfg, dtype)
        loss = functools.partial(batch_loss, cfg=cfg, graphdefs=graphdefs, abstracts=abstracts, kl_weight=kl_weight,
                                 mtp_weight=mtp_weight, caches=caches)
        warmup = max(1, min(warmup_steps, total_steps // 10))
        self.schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup,
                                                           max(total_steps, warmup + 1), learning_rate / 10)
        # The rate is an input of the step (evaluated on the host): one compiled step serves every schedule.
        self.optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                                     optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=0.01))
        self.opt_state = self.optimizer.init(params)
        self.updates = 0  # optimizer steps taken (the schedule's position)
        self._steps = {mode: jax.jit(functools.partial(self._step, loss=functools.partial(loss, mode=mode)),
                                     donate_argnums=(0, 1), compiler_options=step_compiler_options())
                       for mode in (DENSE, SPARSE)}
        self._evals = {mode: jax.jit(functools.partial(loss, mode=mode)) for mode in (DENSE, SPARSE)}

    def _step(self, params, opt_state, tokens, mask, rate, *, loss):
        (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, tokens, mask)
        clip, adamw = opt_state
        opt_state = clip, adamw._replace(hyperparams=adamw.hyperparams | {"learning_rate": rate})
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    def step(self, tokens, mask, mode: str) -> dict[str, float]:
        """One optimizer step on a batch; returns its metrics (host floats)."""
        rate = np.float32(self.schedule(self.updates))
        self.params, self.opt_state, metrics = self._steps[mode](self.params, self.opt_state, tokens, mask, rate)
        self.updates += 1
        return {name: float(value) for name, value in metrics.items()}

    def save_state(self, path: str, meta: dict) -> None:
        """Write the parameters, the optimizer's state and `meta` (JSON) to `path` (an .npz) at once: a temporary
        file renamed over it, so a run killed meanwhile leaves the previous state whole."""
        leaves = [np.asarray(jax.device_get(leaf)) for leaf in jax.tree.leaves((self.params, self.opt_state))]
        temporary = f"{path}.tmp.npz"
        np.savez(temporary, *leaves, meta=np.array(json.dumps(meta)))
        os.replace(temporary, path)

    def load_state(self, path: str) -> dict:
        """Resume from `save_state`'s file (a trainer of the same model and optimizer); returns its `meta`."""
        abstract = jax.tree.leaves((self.params, self.opt_state))
        treedef = jax.tree.structure((self.params, self.opt_state))
        with np.load(path) as saved:
            leaves = [saved[f"arr_{i}"] for i in range(len(saved.files) - 1)]
            meta = json.loads(str(saved["meta"]))
        shapes = [(np.shape(a), np.dtype(a.dtype)) for a in abstract]
        if [(a.shape, a.dtype) for a in leaves] != shapes:
            raise ValueError(f"{path} holds another model's or optimizer's state")
        self.params, self.opt_state = jax.tree.map(jnp.asarray, jax.tree.unflatten(treedef, leaves))
        self.updates = int(self.opt_state[1].count)
        return meta

    def evaluate(self, tokens, mask, mode: str = SPARSE) -> dict[str, float]:
        """The batch's metrics without a step."""
        _, metrics = self._evals[mode](self.params, tokens, mask)
        return {name: float(value) for name, value in metrics.items()}
