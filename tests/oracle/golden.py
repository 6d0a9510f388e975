"""What a model-level oracle test does with a golden fixture (`tests/fixtures/oracle/<name>.npz`): read it, rebuild
the checkpoint HF read, feed its prompts and HF's greedy tokens through a `ModelRunner`, and compare logits, greedy
tokens, logprobs and selected sets with HF's. Used by `tests/model/test_deepseek_v3_oracle.py` and
`test_glm_moe_dsa_oracle.py` (and the set comparison by `test_deepseek_v32_oracle.py`); the comparisons are those of
`test_deepseek_v32_oracle.py` (prefill log-softmax at every position, greedy tokens, chosen-token logprobs and
whole log-softmax rows at every step, one absolute tolerance).

numpy here; the runner's helpers (`dcp_jax.runtime.oracle`) are imported when a case runs.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from tests.oracle import hf_tiny

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "oracle"


@functools.cache
def fixture(name: str) -> dict[str, np.ndarray]:
    """The fixture `name` (its fields: `tests/oracle/README.md`), read once."""
    with np.load(FIXTURES / f"{name}.npz") as f:
        return dict(f)


def write_checkpoint(name: str, out_dir: str | os.PathLike) -> str:
    """Rebuild the checkpoint of fixture `name` from its config and seed into `out_dir`; returns its sha256 (the
    fixture's `checkpoint_sha256` when the bytes are the ones HF read)."""
    return hf_tiny.write_random_checkpoint(hf_tiny.tiny_configs()[name], int(fixture(name)["seed"]), out_dir)


def write_checkpoints(tmp_path_factory, names) -> dict[str, tuple]:
    """Each fixture's checkpoint rebuilt in a temporary directory: name -> (path, sha256)."""
    out = {}
    for name in names:
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, write_checkpoint(name, path))
    return out


_RUNS: dict = {}


def case_ids(cases) -> list[str]:
    """The pytest ids of oracle cases (config, dcp, interleave, kernels, prefill chunk), pytest.params included."""
    return [f"{c}-dcp{w}-S{s}-{k}-chunk{n}" for c, w, s, k, n in (getattr(case, "values", case) for case in cases)]


def run_case(path, name: str, engine, dcp: int, interleave: int, kernels: str, chunk: int, *,
             selected: bool = False, hf_overrides: tuple = ()) -> dict:
    """`run_greedy` of fixture `name` on a runner of the checkpoint at `path` (read by `config_from_hf`, with the
    config.json fields of `hf_overrides` (name, value) pairs replaced; loaded by `load_hf_params`) at tp = dcp,
    cached per case (a case's tests share one run)."""
    key = (str(path), name, engine, dcp, interleave, kernels, chunk, selected, tuple(hf_overrides))
    if key not in _RUNS:
        from dcp_jax.config import ParallelConfig
        from dcp_jax.model.architecture import config_from_hf, with_hf_overrides
        from dcp_jax.model.mesh import make_mesh
        from dcp_jax.model.weights import load_hf_params
        from dcp_jax.runtime.runner import ModelRunner

        cfg = with_hf_overrides(config_from_hf(path), dict(hf_overrides) or None)
        parallel = ParallelConfig(tp=dcp, dcp=dcp, interleave=interleave)
        mesh = make_mesh(parallel)
        runner = ModelRunner(cfg, load_hf_params(cfg, path, mesh), parallel, engine, mesh, kernels)
        fx = fixture(name)
        tables = block_tables(engine, dcp, len(fx["prompt_lens"]), seed=dcp * 10 + interleave)
        _RUNS[key] = run_greedy(runner, fx, tables, chunk, selected=selected)
    return _RUNS[key]


def mismatching_sets(ours: np.ndarray, theirs: np.ndarray, rel_gap: np.ndarray, min_rel_gap: float):
    """ours / theirs [..., K] selected ids (-1 padded), rel_gap [...] HF's relative top-k boundary gap of each row:
    (rows compared: those not tie-fragile, gap >= min_rel_gap; the rows whose sets differ, with the difference)."""
    compared, bad = 0, []
    for idx in np.ndindex(rel_gap.shape):
        if np.isnan(rel_gap[idx]) or rel_gap[idx] < min_rel_gap:
            continue
        compared += 1
        a, b = set(ours[idx][ours[idx] >= 0].tolist()), set(theirs[idx][theirs[idx] >= 0].tolist())
        if a != b:
            bad.append((idx, sorted(a ^ b)))
    return compared, bad


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def prompts_of(fx: dict) -> list[list[int]]:
    return [fx["prompt_ids"][i, :n].tolist() for i, n in enumerate(fx["prompt_lens"])]


def block_tables(engine, dcp: int, rows: int, seed: int) -> list[list[int]]:
    """Each row gets its own pages of `engine`'s pool, scattered over it."""
    blocks = engine.max_blocks_per_seq(dcp)
    pages = np.random.default_rng(seed).permutation(engine.num_pages)[: rows * blocks]
    return pages.reshape(rows, blocks).tolist()


def run_greedy(runner, fx: dict, tables: list[list[int]], chunk: int, *,
               selected: bool = False) -> dict[str, np.ndarray | list]:
    """Prefill the fixture's prompts in chunks of `chunk` tokens (logits at every position), then one decode step per
    later greedy token, each fed HF's previous token. Returns `prefill_logits` [P, Lmax, V] (NaN padded),
    `decode_logits` (N-1 arrays [P, V]) and `sampled` [P, N] (the tokens the device sampled greedily); with
    `selected`, also each layer's selections: `prefill_selected` [layers, P, Lmax, K] and `decode_selected` (N-1
    arrays [layers, P, K])."""
    from dcp_jax.runtime import oracle

    prompts = prompts_of(fx)
    prefill_logits, prefill_selected, first_tokens = oracle.prefill(runner, prompts, tables, chunk_size=chunk,
                                                                    all_logits=True, return_selected=selected)
    decode_logits, decode_selected, sampled = [], [], [first_tokens]
    context = np.array([len(p) for p in prompts])
    for j in range(1, fx["gen_tokens"].shape[1]):
        context = context + 1
        logits, layer_selected, tokens = oracle.decode(runner, fx["gen_tokens"][:, j - 1].tolist(), context.tolist(),
                                                       tables, return_selected=selected)
        decode_logits.append(logits)
        decode_selected.append(layer_selected)
        sampled.append(tokens)
    result = dict(prefill_logits=prefill_logits, decode_logits=decode_logits, sampled=np.stack(sampled, axis=1))
    if selected:
        result |= dict(prefill_selected=prefill_selected, decode_selected=decode_selected)
    return result


def assert_rope_constants(fx: dict, cfg) -> None:
    """The engine's rope frequencies, cos/sin factor and softmax scale of `cfg` (a ModelConfig) equal HF's."""
    from dcp_jax.model.rope import rope_tables

    inv_freq, attention_factor = rope_tables(cfg)
    np.testing.assert_allclose(inv_freq, fx["hf_rope_inv_freq"], rtol=1e-6)
    assert abs(attention_factor - float(fx["hf_rope_attention_scaling"])) <= 1e-6 * abs(attention_factor)
    assert abs(cfg.softmax_scale - float(fx["hf_softmax_scale"])) <= 1e-12 * cfg.softmax_scale


def assert_prefill_equal(fx: dict, prefill_logits: np.ndarray, tol: float) -> None:
    """Every prompt position: log-softmax within `tol` of HF's (absolute), and the same argmax."""
    for i, n in enumerate(fx["prompt_lens"]):
        want = log_softmax(fx["prefill_logits"][i, :n])
        got = log_softmax(prefill_logits[i, :n])
        np.testing.assert_allclose(got, want, atol=tol, rtol=0, err_msg=f"prompt {i}")
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1), err_msg=f"prompt {i}")


def assert_greedy_equal(fx: dict, result: dict, tol: float) -> None:
    """The greedy tokens equal HF's (the device sampler's and the argmax of our logits at every step: the prefill's
    last position, then each decode step), the chosen tokens' logprobs and whole log-softmax rows within `tol`."""
    prompt_lens = fx["prompt_lens"]
    last = np.stack([result["prefill_logits"][i, n - 1] for i, n in enumerate(prompt_lens)])
    steps = [last] + list(result["decode_logits"])
    assert len(steps) == fx["gen_tokens"].shape[1]
    np.testing.assert_array_equal(result["sampled"], fx["gen_tokens"])
    for j, logits in enumerate(steps):
        logprobs = log_softmax(logits)
        np.testing.assert_array_equal(logprobs.argmax(-1), fx["gen_tokens"][:, j], err_msg=f"step {j}")
        chosen = np.take_along_axis(logprobs, fx["gen_tokens"][:, j, None], axis=1)[:, 0]
        np.testing.assert_allclose(chosen, fx["gen_logprobs"][:, j], atol=tol, rtol=0, err_msg=f"step {j}")
        np.testing.assert_allclose(logprobs, fx["gen_logsoftmax"][:, j], atol=tol, rtol=0, err_msg=f"step {j}")
