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
from dcp_jax.model.deepseek_v32 import abstract_model, merge
from dcp_jax.train.forward import DENSE, SPARSE, sequence_forward
from dcp_jax.train.retrieval import encode_batch, make_example, records_for

# The shipped model's shape: DeepSeek-V3.2's architecture (MLA with q_lora and the latent cache, the lightning
# indexer, one dense layer then MoE layers with shared experts and group routing), byte vocabulary (2 specials +
# 256 bytes, rounded up), index_topk 64 so 1K-16K contexts are far past it.
DSA_TINY = dataclasses.replace(TINY, vocab_size=264, num_hidden_layers=4, index_topk=64,
                               max_position_embeddings=16384)


@dataclasses.dataclass(frozen=True)
class Stage:
    """`steps` optimizer steps attending as `mode` on batches of `batch` prompts of `context` tokens."""

    mode: str
    steps: int
    context: int
    batch: int


def batches(tokenizer, rng: np.random.Generator, *, context: int,
            batch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless (tokens, answer_mask) batches of retrieval prompts filling `context` tokens."""
    records = records_for(context)
    while True:
        yield encode_batch(tokenizer, [make_example(rng, records) for _ in range(batch)])


def batch_loss(params, tokens, mask, *, graphdef, abstract, mode: str, kl_weight: float):
    """(loss, metrics) of a batch: the mean answer cross-entropy plus kl_weight times the indexer's KL."""
    model = merge(graphdef, abstract, params)

    def one(row_tokens, row_mask):
        out = sequence_forward(model, row_tokens, mode=mode)
        logits, targets, answer = out.logits[:-1], row_tokens[1:], row_mask[:-1]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], axis=-1)[:, 0]
        right = jnp.all(jnp.where(answer, jnp.argmax(logits, axis=-1) == targets, True))
        return jnp.sum(nll * answer) / jnp.sum(answer), out.indexer_kl, right

    lm, kl, right = jax.vmap(one)(tokens, mask)
    metrics = dict(lm=lm.mean(), indexer_kl=kl.mean(), accuracy=right.mean())
    return metrics["lm"] + kl_weight * metrics["indexer_kl"], metrics


class Trainer:
    """The parameters, an AdamW optimizer (a warm-up of at most a tenth of the steps, then cosine decay to a tenth
    of the rate; gradients clipped to norm 1) and a jitted step per attention mode."""

    def __init__(self, cfg: ModelConfig, params: dict, *, learning_rate: float, total_steps: int,
                 kl_weight: float = 1.0, warmup_steps: int = 100):
        self.params, self.kl_weight = params, kl_weight
        self.graphdef, self.abstract = abstract_model(cfg, jax.tree.leaves(params)[0].dtype)
        warmup = max(1, min(warmup_steps, total_steps // 10))
        schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, max(total_steps, warmup + 1),
                                                      learning_rate / 10)
        self.optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
        self.opt_state = self.optimizer.init(params)
        self._steps = {mode: jax.jit(functools.partial(self._step, mode=mode), donate_argnums=(0, 1))
                       for mode in (DENSE, SPARSE)}
        self._evals = {mode: jax.jit(functools.partial(batch_loss, graphdef=self.graphdef, abstract=self.abstract,
                                                       mode=mode, kl_weight=kl_weight))
                       for mode in (DENSE, SPARSE)}

    def _step(self, params, opt_state, tokens, mask, *, mode: str):
        loss = functools.partial(batch_loss, graphdef=self.graphdef, abstract=self.abstract, mode=mode,
                                 kl_weight=self.kl_weight)
        (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, tokens, mask)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    def step(self, tokens, mask, mode: str) -> dict[str, float]:
        """One optimizer step on a batch; returns its metrics (host floats)."""
        self.params, self.opt_state, metrics = self._steps[mode](self.params, self.opt_state, tokens, mask)
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
        return meta

    def evaluate(self, tokens, mask, mode: str = SPARSE) -> dict[str, float]:
        """The batch's metrics without a step."""
        _, metrics = self._evals[mode](self.params, tokens, mask)
        return {name: float(value) for name, value in metrics.items()}
