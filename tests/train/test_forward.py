"""dcp_jax/train/forward.py: the whole-sequence training forward is the serving model (its sparse logits and
selected sets are the serving prefill's), dense equals sparse while no query has more than index_topk keys, and
the indexer's KL trains the indexer alone while the LM loss never reaches it."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcp_jax.config import TINY, EngineConfig, ParallelConfig
from dcp_jax.model.deepseek_v32 import abstract_model, init_params, merge
from dcp_jax.model.attention import cache_formats
from dcp_jax.model.mesh import make_mesh
from dcp_jax.runtime.runner import ModelRunner
from dcp_jax.train.forward import (DENSE, SPARSE, CacheFormats, indexer_kl, sequence_forward,
                                   through_fp8_index_cache, through_latent_cache)
from dcp_jax.runtime import oracle
from pallas_kernels import formats

ENGINE = EngineConfig(page_size=4, num_pages=32, max_num_seqs=2, max_model_len=64, bucket_ladder=(2, 16),
                      max_num_batched_tokens=16)
INDEXER_FIELDS = {"index_wq", "index_wk", "index_k_norm", "index_k_norm_bias", "index_weights"}
PROMPTS = [list(np.random.default_rng(0).integers(2, TINY.vocab_size, 41)), [7, 300, 12, 6, 77]]


def forward(params, tokens, mode, caches=CacheFormats()):
    """The training forward of TINY, jitted (one compile a mode and length; module constants such as
    SELECTION_CHUNK are read when it traces)."""
    graphdef, abstract = abstract_model(TINY)
    run = jax.jit(lambda params, tokens: sequence_forward(merge(graphdef, abstract, params), tokens, mode=mode,
                                                          caches=caches))
    return run(params, jnp.asarray(tokens, jnp.int32))


@pytest.mark.parametrize("dcp, caches", [
    (1, CacheFormats()), pytest.param(1, CacheFormats("fp8", "fp8"), marks=pytest.mark.slow),
    pytest.param(1, CacheFormats("exact", "fp8"), marks=pytest.mark.slow),
    (2, CacheFormats()), (2, CacheFormats("fp8", "fp8")), (2, CacheFormats("exact", "fp8"))],
    ids=["1-exact", "1-fp8", "1-fp8-latent", "2-exact", "2-fp8", "2-fp8-latent"])  # the fp8 ones at one size
def test_the_sparse_forward_is_the_serving_prefill(dcp, caches):
    """A prompt past index_topk (41 > 16) and a short one: every position's logits and each layer's selected set
    equal the serving step's (reference kernels, chunks of 16, DCP 1 and 2), the serving caches in the formats the
    forward reads through."""
    params = init_params(TINY, seed=5)
    parallel = ParallelConfig(tp=dcp, dcp=dcp)
    engine = dataclasses.replace(ENGINE, index_cache=caches.index, latent_cache=caches.latent)
    runner = ModelRunner(TINY, params, parallel, engine, make_mesh(parallel), "reference")
    blocks = engine.max_blocks_per_seq(dcp)
    served, selected, _ = oracle.prefill(runner, PROMPTS, [list(range(blocks)), list(range(blocks, 2 * blocks))],
                                         all_logits=True, return_selected=True)
    for i, prompt in enumerate(PROMPTS):
        out = forward(params, prompt, SPARSE, caches)
        np.testing.assert_allclose(np.asarray(out.logits), served[i, : len(prompt)], atol=2e-4, rtol=0)
        for layer in range(TINY.num_hidden_layers):
            for row, ids in enumerate(selected[layer, i, : len(prompt)]):  # -1 padded, any order
                got = np.asarray(out.selected[layer, row])
                assert set(got[got >= 0].tolist()) == set(ids[ids >= 0].tolist()), (layer, row)


def test_dense_is_sparse_up_to_index_topk_keys_and_not_past_them():
    params = init_params(TINY, seed=1)
    short, long = PROMPTS[0][: TINY.indexer.topk], PROMPTS[0]
    # The same attention in two forms (explicit per-head keys; the latents gathered, absorbed): f32 rounding apart.
    np.testing.assert_allclose(forward(params, short, DENSE).logits, forward(params, short, SPARSE).logits, atol=1e-5)
    dense, sparse = forward(params, long, DENSE), forward(params, long, SPARSE)
    counts = (np.asarray(sparse.selected) >= 0).sum(axis=-1)
    assert (counts == np.minimum(np.arange(1, len(long) + 1), TINY.indexer.topk)).all()
    assert dense.selected.shape[-1] == 0
    assert np.abs(np.asarray(dense.logits[-1] - sparse.logits[-1])).max() > 1e-3
    with pytest.raises(ValueError, match="mode must be"):
        forward(params, short, "causal")


def test_the_kl_trains_the_indexer_alone_and_the_lm_loss_everything_else():
    params = init_params(TINY, seed=2)
    tokens = jnp.asarray(PROMPTS[0], jnp.int32)

    def losses(p):
        out = forward(p, tokens, SPARSE)
        lm = -jnp.mean(jax.nn.log_softmax(out.logits[:-1])[jnp.arange(len(tokens) - 1), tokens[1:]])
        return lm, out.indexer_kl

    lm_grads = jax.grad(lambda p: losses(p)[0])(params)
    kl_grads = jax.grad(lambda p: losses(p)[1])(params)
    paths = [(jax.tree_util.keystr(path), np.abs(np.asarray(lm)).max(), np.abs(np.asarray(kl)).max())
             for (path, lm), kl in zip(jax.tree_util.tree_leaves_with_path(lm_grads), jax.tree.leaves(kl_grads))]
    for path, lm, kl in paths:  # every weight of the model: embedding, norms, attention, MLP, MoE, head
        is_indexer = any(f"'{name}'" in path for name in INDEXER_FIELDS)
        if is_indexer:
            assert lm == 0, f"the LM loss reaches {path}"
        else:
            assert kl == 0, f"the KL loss reaches {path}"
    assert all(kl > 0 for path, _, kl in paths if "'index_wq'" in path or "'index_wk'" in path)
    assert sum(lm > 0 for _, lm, _ in paths) > len(paths) // 2


def test_the_kl_is_zero_at_the_target_and_positive_elsewhere():
    probs = jnp.asarray(np.random.default_rng(3).dirichlet(np.ones(5), size=(2, 4)), jnp.float32)  # [heads, S, T]
    keep = jnp.ones((4, 5), bool)
    target = probs.sum(axis=0) / 2
    assert float(indexer_kl(jnp.log(target), probs, keep)) == pytest.approx(0.0, abs=1e-6)
    assert float(indexer_kl(jnp.zeros((4, 5)), probs, keep)) > 1e-3
    # Keys outside `keep` count for neither side.
    keep = keep.at[:, 4].set(False)
    kept = probs.sum(axis=0).at[:, 4].set(0.0)
    scores = jnp.log(kept / kept.sum(axis=-1, keepdims=True) + 1e-30).at[:, 4].set(100.0)
    assert float(indexer_kl(scores, probs, keep)) == pytest.approx(0.0, abs=1e-5)


def test_the_mtp_layer_predicts_one_token_further_causally():
    """At row (position) r the MTP layer reads the main model's state of r and token r + 1: its logits there change
    with token r + 1 and never with a later token; its loss trains the main model's embedding and head (shared)."""
    from dcp_jax.model.deepseek_v32 import abstract_mtp, init_mtp_params
    from dcp_jax.train.forward import mtp_forward

    cfg = dataclasses.replace(TINY, num_nextn_predict_layers=1)
    graphdef, abstract = abstract_model(cfg)
    mtp_graphdef, mtp_abstract = abstract_mtp(cfg)

    @functools.partial(jax.jit, static_argnames="hidden_change")
    def mtp_logits(params, mtp_params, tokens, hidden_change=None):
        model = merge(graphdef, abstract, params)
        tokens = jnp.asarray(tokens, jnp.int32)
        hidden = sequence_forward(model, tokens, mode=SPARSE).hidden
        if hidden_change is not None:
            hidden = hidden.at[hidden_change].add(1.0)
        return mtp_forward(model, merge(mtp_graphdef, mtp_abstract, mtp_params), tokens, hidden, mode=SPARSE).logits

    params, mtp_params = init_params(cfg, seed=3), init_mtp_params(cfg, seed=4)
    tokens = np.array(PROMPTS[0][:24])
    base = np.asarray(mtp_logits(params, mtp_params, tokens))
    assert base.shape == (23, cfg.vocab_size)
    # Row r reads token r + 1, but row 0 none (its embedding is zeroed): token 1 first moves row 1 (its state).
    for changed_token, first_moved in ((10, 9), (1, 1)):
        changed = tokens.copy()
        changed[changed_token] = (changed[changed_token] + 1) % cfg.vocab_size
        moved = np.asarray(mtp_logits(params, mtp_params, changed))
        np.testing.assert_array_equal(moved[:first_moved], base[:first_moved])
        assert np.abs(moved[first_moved] - base[first_moved]).max() > 1e-4
    moved = np.asarray(mtp_logits(params, mtp_params, tokens, hidden_change=10))  # row 10 reads the state of 10
    np.testing.assert_array_equal(moved[:10], base[:10])
    assert np.abs(moved[10] - base[10]).max() > 1e-4
    grads = jax.grad(lambda p: mtp_logits(p, mtp_params, tokens)[-1, 5])(params)
    assert float(jnp.abs(grads["embed"]).max()) > 0 and float(jnp.abs(grads["lm_head"]).max()) > 0


def test_the_selection_by_chunks_of_queries_is_the_whole_selection(monkeypatch):
    """SELECTION_CHUNK queries at a time (the last chunk padded) select what all queries at once select."""
    from dcp_jax.train import forward as forward_module

    params = init_params(TINY, seed=6)
    whole = forward(params, PROMPTS[0], SPARSE)
    monkeypatch.setattr(forward_module, "SELECTION_CHUNK", 16)  # 41 queries: chunks of 16, 16 and 9 + 7 pads
    chunked = forward(params, PROMPTS[0], SPARSE)
    np.testing.assert_array_equal(np.asarray(chunked.selected), np.asarray(whole.selected))
    np.testing.assert_array_equal(np.asarray(chunked.logits), np.asarray(whole.logits))


def test_the_fp8_roundings_score_and_read_as_the_fp8_caches_and_pass_the_gradient_straight_through():
    """Index scores through `through_fp8_index_cache` are the fp8 index cache's (keys and queries quantized as the
    serving step quantizes them), latents through `through_latent_cache` are the fp8 latent cache's values, and the
    gradient of either rounding is the identity."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((5, TINY.indexer.heads, TINY.indexer.head_dim)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((5, TINY.indexer.heads)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((9, TINY.indexer.head_dim)) * 3, jnp.float32)
    fp8_keys = cache_formats.zero_index_keys(keys.shape, "fp8", jnp.float32)
    served_q, served_weights = cache_formats.encode_index_queries(q, weights, fp8_keys)
    served_keys = jax.tree.map(lambda a: a[None], cache_formats.encode_index_keys(keys, fp8_keys))
    served = cache_formats.dense_index_scores(served_q[None], served_weights[None], served_keys)
    trained = cache_formats.dense_index_scores(through_fp8_index_cache(q)[None], weights[None],
                                               through_fp8_index_cache(keys)[None])
    exact = cache_formats.dense_index_scores(q[None], weights[None], keys[None])
    np.testing.assert_allclose(trained, served, rtol=1e-5, atol=1e-5)
    assert not np.allclose(trained, exact, rtol=1e-3, atol=1e-3)  # the rounding is there

    latents = jnp.asarray(rng.standard_normal((9, TINY.latent_dim)), jnp.float32)
    cache = cache_formats.encode_latents(latents, cache_formats.zero_latents((9,), TINY, "fp8", jnp.float32))
    rounded = through_latent_cache(latents, TINY, "fp8")
    np.testing.assert_array_equal(rounded, cache_formats.latent_values(cache))
    assert through_latent_cache(latents, TINY, "exact") is latents

    cotangent = jnp.asarray(rng.standard_normal(latents.shape), jnp.float32)
    grad = jax.grad(lambda x: jnp.sum(through_latent_cache(x, TINY, "fp8") * cotangent))(latents)
    np.testing.assert_array_equal(grad, cotangent)
    hadamard_cotangent = jnp.asarray(rng.standard_normal(keys.shape), jnp.float32)
    grad = jax.grad(lambda k: jnp.sum(through_fp8_index_cache(k) * hadamard_cotangent))(keys)
    np.testing.assert_allclose(grad, formats.hadamard(hadamard_cotangent), rtol=1e-5, atol=1e-6)  # symmetric H
