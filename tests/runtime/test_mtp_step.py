"""The MTP layer in the step programs (`runtime/forward.py`, speculative decoding's draft): over a prompt's rows and
decode rows, with its own cache (the pools' last layer), it gives the training forward's MTP logits
(`train/forward.mtp_forward`) at every row, chunked or not, at DCP 1 and 2; each sampled row's argmax is its slot's
first draft in the device state, and with N >= 2 the chained passes' drafts are the layer run again on its own
output (a reference over the whole sequence)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcp_jax.config import TINY, EngineConfig, ParallelConfig
from dcp_jax.host.step_inputs import PROMPT
from dcp_jax.host.step_plan import ScheduledRows
from dcp_jax.model.deepseek_v32 import abstract_model, abstract_mtp, init_mtp_params, init_params, merge
from dcp_jax.model.mesh import make_mesh
from dcp_jax.model.rope import cos_sin, rope_tables
from dcp_jax.runtime import oracle
from dcp_jax.runtime.runner import ModelRunner
from dcp_jax.train.forward import SPARSE, decoder_layer_forward, mtp_forward, sequence_forward

ENGINE = EngineConfig(page_size=4, num_pages=32, max_num_seqs=2, max_model_len=64, bucket_ladder=(2, 16, 32),
                      max_num_batched_tokens=32, num_speculative_tokens=1)
PROMPT_IDS = np.random.default_rng(0).integers(2, TINY.vocab_size, 29).tolist()  # past index_topk 16


def _chunk(prompt, first, end, table, slot):
    n = end - first
    return ScheduledRows(slots=np.array([slot], np.int32), context_lens=np.array([end], np.int32),
                         num_queries=np.array([n], np.int32), block_tables=[table],
                         tokens=np.asarray(prompt[first:end], np.int32), roles=np.full(n, PROMPT, np.int32),
                         next_tokens=np.asarray((prompt[first + 1:end + 1] + [-1])[:n], np.int32),
                         is_fresh=np.array([first == 0]), samples=np.array([end == len(prompt)]))


def _served_mtp_logits(dcp: int, chunks: list[int], engine: EngineConfig):
    """The MTP logits of every prompt row and of one decode row through the details program, the tokens sampled
    after the prompt and after the decode row, and the slot's drafts after each step."""
    params, mtp_params = init_params(TINY, seed=1), init_mtp_params(TINY, seed=2)
    parallel = ParallelConfig(tp=dcp, dcp=dcp)
    runner = ModelRunner(TINY, params, parallel, engine, make_mesh(parallel), "reference", mtp_params=mtp_params)
    slot, table = 0, list(range(ENGINE.max_blocks_per_seq(dcp)))
    runner.set_sampling(slot, oracle.GREEDY_PARAMS, 0, len(PROMPT_IDS))
    logits, first = [], 0
    for end in chunks:
        sampled, details = oracle.run_details(runner, _chunk(PROMPT_IDS, first, end, table, slot))
        logits.append(details.mtp_logits[:end - first])
        first = end
    token = int(sampled.tokens[0])
    drafts = [np.asarray(runner.state.drafts)[slot].tolist()]
    decode = ScheduledRows.decode([slot], [len(PROMPT_IDS) + 1], np.asarray([table], np.int32), tokens=[token])
    sampled, details = oracle.run_details(runner, decode)
    logits.append(details.mtp_logits[:1])
    drafts.append(np.asarray(runner.state.drafts)[slot].tolist())
    return (np.concatenate(logits), [token, int(sampled.tokens[0])], drafts, (params, mtp_params),
            runner.state.kv_cache.entries("latent"))


def _chained_drafts(model, mtp, tokens, hidden, last_row: int, n: int) -> list[int]:
    """Reference: the n drafts after row `last_row` of tokens [T] (the main model's `hidden`): the MTP layer over
    rows 0..last_row, then again with each draft and the layer's output (before the head's norm) appended."""
    normed, following, drafts = model.final_hidden(hidden[:last_row + 1]), tokens[1:last_row + 2], []
    for _ in range(n):
        positions = jnp.arange(normed.shape[0])
        h = mtp.layer_input(model.embed_tokens(following), normed, positions == 0)
        h, _, _ = decoder_layer_forward(mtp.layer, h, *cos_sin(positions, *rope_tables(TINY)), cfg=TINY, mode=SPARSE)
        drafts.append(int(jnp.argmax(model.head(mtp.head_input(h[-1])))))
        normed, following = jnp.concatenate([normed, h[-1:]]), jnp.append(following, drafts[-1])
    return drafts


# Slow: test_chained_drafts_start_at_the_last_kept_draft checks the MTP logits over two chunks and a verify group at
# DCP 2, N = 3, and the chained passes after a verify that kept two drafts.
@pytest.mark.slow
@pytest.mark.parametrize("dcp, chunks, drafts", [(1, [29], 1), (2, [13, 29], 1), (2, [13, 29], 3)])
def test_mtp_rows_give_the_training_forwards_mtp_logits_and_drafts(dcp, chunks, drafts):
    engine = dataclasses.replace(ENGINE, num_speculative_tokens=drafts)
    served, generated, served_drafts, (params, mtp_params), layers = _served_mtp_logits(dcp, chunks, engine)
    assert layers == TINY.num_hidden_layers + 1  # the MTP layer's cache after the decoder layers'
    model = merge(*abstract_model(TINY), params)
    mtp = merge(*abstract_mtp(TINY), mtp_params)
    tokens = jnp.asarray(PROMPT_IDS + generated, jnp.int32)  # the prompt, the token after it, the next one
    hidden = sequence_forward(model, tokens, mode=SPARSE).hidden
    expected = np.asarray(mtp_forward(model, mtp, tokens, hidden, mode=SPARSE).logits)  # rows 0 .. T
    np.testing.assert_allclose(served, expected, atol=2e-4, rtol=0)
    last = len(PROMPT_IDS) - 1  # the prompt's last row, then the decode row
    assert [d[0] for d in served_drafts] == [int(np.argmax(expected[last])), int(np.argmax(expected[last + 1]))]
    if drafts > 1:
        assert served_drafts == [_chained_drafts(model, mtp, tokens, hidden, row, drafts) for row in (last, last + 1)]


def test_a_runner_drafts_exactly_with_mtp_params():
    parallel = ParallelConfig(tp=1, dcp=1)
    with pytest.raises(ValueError, match="needs the MTP layer's params"):
        ModelRunner(TINY, init_params(TINY, seed=1), parallel, ENGINE, make_mesh(parallel), "reference")


@pytest.mark.parametrize("kernels, drafts", [("reference", 3), pytest.param("reference", 1, marks=pytest.mark.slow),
                                             pytest.param("pallas", 3, marks=pytest.mark.slow)])
def test_no_drafting_program_derives_local_lengths_or_waits_for_the_device(kernels, drafts):
    """The MTP layer's rows, the verify groups and the chained passes keep the step's property: global positions
    reach RoPE alone (the position-0 embedding mask is the host's `is_position_zero`; a chained pass's row is
    picked among the host's, not computed), and no serving program holds a traced branch."""
    parallel = ParallelConfig(tp=2, dcp=2, interleave=2)
    engine = dataclasses.replace(ENGINE, num_speculative_tokens=drafts)
    runner = ModelRunner(TINY, init_params(TINY, seed=1), parallel, engine, make_mesh(parallel), kernels,
                         mtp_params=init_mtp_params(TINY, seed=2))
    for variant, step in runner.steps.items():
        for rows in step.buckets:
            assert step.length_derivations(runner.params, runner.state, rows) == [], (variant, rows)
            if variant != "details":
                assert step.host_syncs(runner.params, runner.state, rows) == [], (variant, rows)


def test_chained_drafts_start_at_the_last_kept_draft():
    """N = 3 at DCP 2 over a prompt in two chunks, then a verify group keeping a = 2 of its drafts (the third forced
    wrong): the MTP logits of every prompt row and every emitted verify row are the training forward's, and the
    group drafts again from its last emitted row, p + a: the chained passes pick the host's rows at p + a + j
    (column a + j - 1), as the reference gives."""
    engine = dataclasses.replace(ENGINE, num_speculative_tokens=3)
    params, mtp_params = init_params(TINY, seed=1), init_mtp_params(TINY, seed=2)
    parallel = ParallelConfig(tp=2, dcp=2, interleave=2)
    runner = ModelRunner(TINY, params, parallel, engine, make_mesh(parallel), "reference", mtp_params=mtp_params)
    slot, table = 0, list(range(engine.max_blocks_per_seq(2)))
    runner.set_sampling(slot, oracle.GREEDY_PARAMS, 0, len(PROMPT_IDS))
    served = [oracle.run_details(runner, _chunk(PROMPT_IDS, 0, 13, table, slot))[1].mtp_logits[:13]]
    sampled, details = oracle.run_details(runner, _chunk(PROMPT_IDS, 13, len(PROMPT_IDS), table, slot))
    served.append(details.mtp_logits[:len(PROMPT_IDS) - 13])
    model, mtp = merge(*abstract_model(TINY), params), merge(*abstract_mtp(TINY), mtp_params)
    tokens = PROMPT_IDS + [int(sampled.tokens[0])]
    # One compiled forward over the whole length: causal, so a prefix's rows ignore the zeros after it.
    width = len(tokens) + 3
    greedy_after = jax.jit(lambda row, last: jnp.argmax(model.logits(
        sequence_forward(model, row, mode=SPARSE).hidden[last])))
    for _ in range(3):  # the greedy continuation g1, g2, g3
        row = jnp.asarray(tokens + [0] * (width - len(tokens)), jnp.int32)
        tokens.append(int(greedy_after(row, len(tokens) - 1)))
    forced = tokens[-3:-1] + [(tokens[-1] + 1) % TINY.vocab_size]  # g1, g2 right, the third wrong
    runner.state = dataclasses.replace(runner.state, drafts=runner.state.drafts.at[slot].set(jnp.asarray(forced)))
    verify = ScheduledRows.verify([slot], [len(PROMPT_IDS) + 1], [3], np.asarray([table], np.int32))
    sampled, details = oracle.run_details(runner, verify)
    assert np.asarray(sampled.tokens)[:4].tolist() == tokens[-3:] + [-1]  # g1, g2 kept, then g3
    served.append(details.mtp_logits[:3])  # rows p .. p + a, each with the token emitted after it

    @jax.jit
    def forwards(row):
        hidden = sequence_forward(model, row, mode=SPARSE).hidden
        return hidden, mtp_forward(model, mtp, row, hidden, mode=SPARSE).logits

    hidden, expected = forwards(jnp.asarray(tokens, jnp.int32))
    expected = np.asarray(expected)
    np.testing.assert_allclose(np.concatenate(served), expected[:len(PROMPT_IDS) + 3], atol=2e-4, rtol=0)
    last = len(PROMPT_IDS) + 2  # the row of g2, whose next token g3 was emitted
    assert np.asarray(runner.state.drafts)[slot].tolist() == _chained_drafts(model, mtp, jnp.asarray(tokens), hidden,
                                                                             last, 3)
