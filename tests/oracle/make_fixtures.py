"""Record HF `DeepseekV32ForCausalLM`, `GlmMoeDsaForCausalLM` and `DeepseekV3ForCausalLM` outputs on tiny random
checkpoints as `.npz` oracle fixtures.

Needs torch + transformers (run it through `scripts/make_oracle_fixtures.sh`). For every config of
`hf_tiny.tiny_configs()` it searches seeds until no greedy choice is tie-fragile, and neither is any indexer top-k
boundary (V3.2 and GLM configs) or MoE routing choice (V3 configs, `v3_*`), then writes
`tests/fixtures/oracle/<config>.npz` (fields in `tests/oracle/README.md`). Everything recorded comes from HF; the
checkpoint bytes come from `hf_tiny.write_random_checkpoint`, which the JAX tests rerun without torch. An MXFP4
config (AMD Quark's
`quantization_config`, `glm52_mxfp4`) is recorded from HF on its dequantized float32 checkpoint
(`hf_tiny.dequantized`, written only into this script's temporary directory): HF reads Quark's fp4 only through the
quark package.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np
import torch
import transformers
from torch.overrides import TorchFunctionMode
from transformers import DeepseekV3ForCausalLM, DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_tiny  # noqa: E402

_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
_DENSE_TOPK = 1 << 30  # index_topk that keeps every causal token: HF takes min(index_topk, T)


# --------------------------------------------------------------------------------------------------------------
# Loading, with a strict check that HF holds exactly the tensors we wrote.


def _check_loaded(model: torch.nn.Module, tensors: dict[str, np.ndarray], info: dict) -> None:
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise RuntimeError(f"HF loading reported problems: {problems}")
    state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    covered = set()
    for name, want in tensors.items():
        m = _EXPERT_RE.match(name)
        if m is None:
            got, covered_key = state[name], name
        else:
            e, proj = int(m["e"]), m["proj"]
            if proj == "down":
                covered_key = m["prefix"] + ".down_proj"
                got = state[covered_key][e]
            else:
                covered_key = m["prefix"] + ".gate_up_proj"
                inter = state[covered_key].shape[1] // 2  # fused [E, 2I, H]: gate rows first, then up
                got = state[covered_key][e, :inter] if proj == "gate" else state[covered_key][e, inter:]
        if got.shape != want.shape or not np.array_equal(got, want):
            raise RuntimeError(f"HF holds a different {name}: {got.shape=} {want.shape=}")
        covered.add(covered_key)
    missed = sorted(set(state) - covered)
    if missed:
        raise RuntimeError(f"HF parameters not filled from the checkpoint: {missed}")


def _load(cls, ckpt_dir: str, tensors: dict[str, np.ndarray]):
    model, info = cls.from_pretrained(
        ckpt_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    _check_loaded(model, tensors, info)
    return model.eval()


# The HF class of each DSA architecture a tiny config names.
_DSA_CLASSES = {"DeepseekV32ForCausalLM": DeepseekV32ForCausalLM, "GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM}
# GLM's config fields of its layer schedules, which a V3 config does not take.
_GLM_ONLY = ("index_", "indexer_types", "mlp_layer_types")


def _v3_config(cfg: dict) -> dict:
    v3 = {k: v for k, v in cfg.items() if not k.startswith(_GLM_ONLY) and k != "quantization_config"}
    v3["architectures"] = ["DeepseekV3ForCausalLM"]
    v3["model_type"] = "deepseek_v3"
    v3["rope_interleave"] = True  # V3.2's MLA always uses interleaved rope; V3 makes it a switch
    return v3


# --------------------------------------------------------------------------------------------------------------
# Indexer capture: the HF indexer returns only indices; its scores are the one `Tensor.topk` input inside it.


class _TopkCapture(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.scores = None
        self.k = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.topk or func is torch.topk:
            if self.scores is not None:
                raise RuntimeError("the HF indexer called topk twice; update the capture")
            self.scores = args[0].detach().float().clone()
            self.k = args[1] if len(args) > 1 else kwargs["k"]
        return func(*args, **kwargs)


@dataclass
class _IndexerCall:
    layer: int
    scores: np.ndarray  # [S, T] float32, HF's masked index scores (batch 0)
    indices: np.ndarray  # [S, k] int64, what HF's indexer returned


@dataclass
class IndexerRecorder:
    """Wraps every layer's indexer forward (instance attribute) and records scores and returned indices."""

    model: torch.nn.Module
    calls: list = field(default_factory=list)

    def __enter__(self):
        self._saved = []
        for layer in self.model.model.layers:
            indexer = layer.self_attn.indexer
            if indexer is None:  # an IndexShare "shared" layer: the previous full layer's selection
                continue
            original = indexer.forward

            def wrapped(*args, _original=original, _layer=indexer.layer_idx, **kwargs):
                capture = _TopkCapture()
                with capture:
                    out = _original(*args, **kwargs)
                if capture.scores is None:
                    raise RuntimeError("the HF indexer never called topk; update the capture")
                self.calls.append(_IndexerCall(_layer, capture.scores[0].numpy(), out[0].long().numpy()))
                return out

            self._saved.append((indexer, original))
            indexer.forward = wrapped
        return self

    def __exit__(self, *exc):
        for indexer, original in self._saved:
            indexer.forward = original
        return False

    def take(self) -> list:
        calls, self.calls = self.calls, []
        return calls


def _set_index_topk(model: torch.nn.Module, k: int) -> None:
    model.config.index_topk = k
    for layer in model.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.index_topk = k


# --------------------------------------------------------------------------------------------------------------
# Per-row top-k summaries.


def _row_selection(scores: np.ndarray, indices: np.ndarray, row_pos: int, k: int):
    """Selected set and boundary gap of one query row at global position `row_pos` (keys 0..row_pos valid)."""
    chosen = np.sort(indices[indices <= row_pos])  # HF returns min(K, T) ids; ids > row_pos are masked padding
    n_valid = row_pos + 1
    if len(chosen) != min(k, n_valid) or len(np.unique(chosen)) != len(chosen):
        raise RuntimeError(f"row {row_pos}: HF selected {len(chosen)} tokens, expected min({k}, {n_valid})")
    valid = scores[:n_valid].astype(np.float64)
    if not np.all(np.isfinite(valid)):
        raise RuntimeError(f"row {row_pos}: non-finite index score among the causal keys")
    if n_valid <= k:
        gap = rel_gap = np.inf
    else:
        order = np.sort(valid)[::-1]
        gap = order[k - 1] - order[k]
        rel_gap = gap / max(order[0] - order[-1], 1e-30)
        ours = np.sort(np.argsort(-valid, kind="stable")[:k])
        if gap > 0 and not np.array_equal(ours, chosen):
            raise RuntimeError(f"row {row_pos}: HF's selected set is not the top-{k} of its own scores")
    out = np.full(k, -1, np.int16)
    out[: len(chosen)] = chosen
    return out, gap, rel_gap


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return (x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))).astype(np.float32)


def _margin(logits: np.ndarray) -> float:
    top2 = np.sort(logits.astype(np.float64))[-2:]
    return float(top2[1] - top2[0])


# --------------------------------------------------------------------------------------------------------------
# One seed: prefill + greedy decode on every prompt.


def _shared_from_full(topk: np.ndarray, gap: np.ndarray, rel_gap: np.ndarray, types: list[str]) -> None:
    """In place, along the leading layer axis: each "shared" layer's selection (and its gaps) is the most recent full
    layer's, what HF hands it (`prev_topk_indices`)."""
    for layer, kind in enumerate(types):
        if kind == "shared":
            topk[layer], gap[layer], rel_gap[layer] = topk[layer - 1], gap[layer - 1], rel_gap[layer - 1]


@torch.no_grad()
def _run_prompt(model, rec: IndexerRecorder | None, ids: np.ndarray, n_gen: int, k: int | None, n_layers: int,
                want_hidden: bool, types: list[str] | None = None):
    """Prefill `ids`, then greedy decode through HF's DynamicCache; `rec` None (a model without an indexer) records
    no top-k fields (they are None). `types`: each layer's indexer kind (`hf_tiny.indexer_types`); a shared layer's
    selection is recorded as the full layer's it reuses."""
    types = types or ["full"] * n_layers
    full_layers = [layer for layer, kind in enumerate(types) if kind == "full"]
    length = len(ids)
    hidden = []
    hooks = []
    if want_hidden:  # residual stream: embeddings, then each decoder layer's output (before the final norm)

        def keep(module, inputs, output):
            hidden.append((output[0] if isinstance(output, tuple) else output)[0].numpy())

        hooks.append(model.model.embed_tokens.register_forward_hook(lambda m, i, o: hidden.append(o[0].numpy())))
        hooks += [layer.register_forward_hook(keep) for layer in model.model.layers]
    try:
        out = model(input_ids=torch.from_numpy(ids[None].astype(np.int64)), use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    prefill_logits = out.logits[0].numpy().astype(np.float32)  # [L, V]
    cache = out.cache

    prefill_topk = prefill_gap = prefill_rel_gap = prefill_scores = None
    decode_topk = decode_gap = decode_rel_gap = None
    if rec is not None:
        calls = rec.take()
        assert [c.layer for c in calls] == full_layers, [c.layer for c in calls]
        prefill_topk = np.full((n_layers, length, k), -1, np.int16)
        prefill_gap = np.full((n_layers, length), np.inf)
        prefill_rel_gap = np.full((n_layers, length), np.inf)
        prefill_scores = np.full((n_layers, length, length), -np.inf, np.float32)
        for c in calls:
            for s in range(length):
                sel, gap, rel = _row_selection(c.scores[s], c.indices[s], s, k)
                prefill_topk[c.layer, s], prefill_gap[c.layer, s], prefill_rel_gap[c.layer, s] = sel, gap, rel
                prefill_scores[c.layer, s, : s + 1] = c.scores[s, : s + 1]
        _shared_from_full(prefill_topk, prefill_gap, prefill_rel_gap, types)
        decode_topk = np.full((n_layers, n_gen - 1, k), -1, np.int16)
        decode_gap = np.full((n_layers, n_gen - 1), np.inf)
        decode_rel_gap = np.full((n_layers, n_gen - 1), np.inf)

    # Greedy decode through HF's own DynamicCache; gen_logits[j] is the distribution that chose gen_tokens[j].
    gen_logits = [prefill_logits[-1]]
    gen_tokens = [int(np.argmax(gen_logits[0]))]
    for j in range(1, n_gen):
        out = model(input_ids=torch.tensor([[gen_tokens[-1]]]), cache=cache, use_cache=True)
        cache = out.cache
        logits = out.logits[0, -1].numpy().astype(np.float32)
        gen_logits.append(logits)
        gen_tokens.append(int(np.argmax(logits)))
        pos = length + j - 1  # position of the token fed at this step
        for c in rec.take() if rec is not None else []:
            if c.scores.shape != (1, pos + 1):
                raise RuntimeError(f"decode step {j}: index scores {c.scores.shape}, expected (1, {pos + 1})")
            sel, gap, rel = _row_selection(c.scores[0], c.indices[0], pos, k)
            decode_topk[c.layer, j - 1], decode_gap[c.layer, j - 1], decode_rel_gap[c.layer, j - 1] = sel, gap, rel
    gen_logits = np.stack(gen_logits)
    if rec is not None:
        _shared_from_full(decode_topk, decode_gap, decode_rel_gap, types)

    # The cached decode must equal a full recompute of the grown sequence (HF semantics: same mask rule).
    full = np.concatenate([ids, np.array(gen_tokens[:-1], ids.dtype)])
    recompute = model(input_ids=torch.from_numpy(full[None].astype(np.int64))).logits[0, length - 1 :].numpy()
    if rec is not None:
        rec.take()
    recompute_diff = float(np.abs(recompute - gen_logits).max())

    return {
        "prefill_logits": prefill_logits,
        "prefill_topk": prefill_topk,
        "prefill_gap": prefill_gap,
        "prefill_rel_gap": prefill_rel_gap,
        "prefill_scores": prefill_scores,
        "gen_tokens": np.array(gen_tokens, np.int32),
        "gen_logits": gen_logits,
        "decode_topk": decode_topk,
        "decode_gap": decode_gap,
        "decode_rel_gap": decode_rel_gap,
        "recompute_diff": recompute_diff,
        "hidden": np.stack(hidden) if want_hidden else None,
    }


def _prompts(cfg: dict, lengths: list[int], prompt_seed: int) -> list[np.ndarray]:
    rng = np.random.Generator(np.random.PCG64(prompt_seed))
    # Ids 0 and 1 are bos/eos; prompts avoid them so nothing special is implied.
    return [rng.integers(2, cfg["vocab_size"], size=n).astype(np.int32) for n in lengths]


def _hf_checkpoint(cfg: dict, tensors: dict[str, np.ndarray], ckpt: str) -> tuple[str, dict[str, np.ndarray], str]:
    """(directory, float32 tensors, sha256) of the checkpoint HF reads: `ckpt` itself, or for an MXFP4 config its
    dequantized copy beside it (`hf_tiny.dequantized`)."""
    hf_cfg, hf_tensors = hf_tiny.dequantized(cfg, tensors)
    if hf_cfg is cfg:
        return ckpt, tensors, ""
    hf_dir = ckpt + "-dequantized"
    return hf_dir, hf_tensors, hf_tiny.write_checkpoint(hf_cfg, hf_tensors, hf_dir)


def _try_seed(name: str, cfg: dict, seed: int, prompts: list[np.ndarray], args, workdir: str):
    ckpt = os.path.join(workdir, f"{name}-{seed}")
    tensors = hf_tiny.random_tensors(cfg, seed)
    sha = hf_tiny.write_checkpoint(cfg, tensors, ckpt)
    assert sha == hf_tiny.write_random_checkpoint(cfg, seed, ckpt)  # the public entry point writes these bytes
    hf_dir, tensors, hf_sha = _hf_checkpoint(cfg, tensors, ckpt)
    model = _load(_DSA_CLASSES[cfg["architectures"][0]], hf_dir, tensors)
    k, n_layers, types = cfg["index_topk"], cfg["num_hidden_layers"], hf_tiny.indexer_types(cfg)
    if getattr(model.config, "indexer_types", None) not in (None, types):
        raise RuntimeError(f"[{name}] HF derived indexer_types {model.config.indexer_types}, hf_tiny {types}")
    longest = int(np.argmax([len(p) for p in prompts]))
    with IndexerRecorder(model) as rec:
        runs = [
            _run_prompt(model, rec, p, args.gen_steps, k, n_layers, want_hidden=(i == longest), types=types)
            for i, p in enumerate(prompts)
        ]
    min_rel_gap = min(min(r["prefill_rel_gap"].min(), r["decode_rel_gap"].min()) for r in runs)
    min_margin = min(_margin(row) for r in runs for row in r["gen_logits"])
    return model, tensors, (sha, hf_sha), runs, float(min_rel_gap), float(min_margin)


# --------------------------------------------------------------------------------------------------------------


def _pad_stack(arrays: list[np.ndarray], axis_len: int, axis: int, fill) -> np.ndarray:
    out = []
    for a in arrays:
        pad = [(0, 0)] * a.ndim
        pad[axis] = (0, axis_len - a.shape[axis])
        out.append(np.pad(a, pad, constant_values=fill))
    return np.stack(out)


def _search_seeds(name: str, args, attempt):
    """The first seed from args.seed_start whose `attempt(seed)` -> (passes the tie rules, its summary line, what
    it made) passes, with what it made; each try printed; RuntimeError when none of args.max_seed_tries does."""
    for seed in range(args.seed_start, args.seed_start + args.max_seed_tries):
        ok, summary, made = attempt(seed)
        print(f"[{name}] seed {seed}: {summary} -> {'accept' if ok else 'reject'}", flush=True)
        if ok:
            return seed, made
    raise RuntimeError(f"[{name}] no seed in {args.max_seed_tries} tries passed the tie rules; relax them?")


def make_config_fixture(name: str, cfg: dict, args, workdir: str) -> str:
    k = cfg["index_topk"]
    lengths = args.prompt_lengths
    if max(lengths) <= k:
        raise ValueError(f"{lengths=}: at least one prompt must be longer than index_topk={k}")
    prompts = _prompts(cfg, lengths, args.prompt_seed)

    def attempt(seed):
        tried = _try_seed(name, cfg, seed, prompts, args, workdir)
        min_rel_gap, min_margin = tried[-2:]
        return (min_rel_gap >= args.min_rel_gap and min_margin >= args.min_margin,
                f"min top-k rel gap {min_rel_gap:.3g}, min greedy margin {min_margin:.3g}", tried)

    seed, (model, tensors, (sha, hf_sha), runs, min_rel_gap, min_margin) = _search_seeds(name, args, attempt)

    worst_recompute = max(r["recompute_diff"] for r in runs)
    if worst_recompute > args.recompute_tol:
        raise RuntimeError(f"[{name}] cached decode differs from full recompute by {worst_recompute:.3g}")

    # (d) sparse must differ from dense once a prompt is longer than index_topk; equal when it is not.
    sparse_dense_diff = []
    _set_index_topk(model, _DENSE_TOPK)
    with torch.no_grad():
        dense_v32 = [model(input_ids=torch.from_numpy(p[None].astype(np.int64))).logits[0].numpy() for p in prompts]
    _set_index_topk(model, k)
    for p, r, d in zip(prompts, runs, dense_v32):
        diff = float(np.abs(r["prefill_logits"] - d).max())
        sparse_dense_diff.append(diff)
        if len(p) > k and diff < 1e-3:
            raise RuntimeError(f"[{name}] prompt of length {len(p)} > {k}: sparse equals dense ({diff=:.3g})")
        if len(p) <= k and diff > 1e-6:
            raise RuntimeError(f"[{name}] prompt of length {len(p)} <= {k}: sparse differs from dense ({diff=:.3g})")

    # (e) V3 with the same weights minus the indexer equals V3.2 with index_topk >= T.
    longest = int(np.argmax(lengths))
    v3_tensors = {n: t for n, t in tensors.items() if ".indexer." not in n}
    v3_dir = os.path.join(workdir, f"{name}-{seed}-v3")
    hf_tiny.write_checkpoint(_v3_config(cfg), v3_tensors, v3_dir)
    v3 = _load(DeepseekV3ForCausalLM, v3_dir, v3_tensors)
    with torch.no_grad():
        dense_logits = v3(input_ids=torch.from_numpy(prompts[longest][None].astype(np.int64))).logits[0].numpy()
    v3_vs_v32 = float(np.abs(dense_logits - dense_v32[longest]).max())
    if v3_vs_v32 > args.v3_tol:
        raise RuntimeError(f"[{name}] DeepseekV3 differs from dense DeepseekV32 by {v3_vs_v32:.3g}")

    max_len = max(lengths)
    hf_rope = json.dumps(model.config.rope_parameters, sort_keys=True)
    fixture = {
        # provenance
        "config_name": np.array(name),
        "config_json": np.array(json.dumps(cfg, sort_keys=True)),
        "hf_rope_parameters_json": np.array(hf_rope),
        "seed": np.array(seed, np.int64),
        "prompt_seed": np.array(args.prompt_seed, np.int64),
        "checkpoint_sha256": np.array(sha),
        # an MXFP4 config's: the dequantized float32 checkpoint HF read ("" when HF read the checkpoint itself)
        "hf_checkpoint_sha256": np.array(hf_sha),
        "transformers_version": np.array(transformers.__version__),
        "torch_version": np.array(torch.__version__),
        "numpy_version": np.array(np.__version__),
        "hf_class": np.array(f"{type(model).__module__}.{type(model).__name__}"),
        "indexer_types": np.array(hf_tiny.indexer_types(cfg)),
        "attn_implementation": np.array("eager"),
        "decode_mode": np.array("hf_dynamic_cache"),
        "index_topk": np.array(k, np.int32),
        # what HF derived from the config (rope init and softmax scales), for unit tests of our own derivation
        "hf_rope_inv_freq": model.model.rotary_emb.inv_freq.numpy().astype(np.float32),
        "hf_rope_attention_scaling": np.array(model.model.rotary_emb.attention_scaling, np.float64),
        "hf_softmax_scale": np.array(model.model.layers[0].self_attn.scaling, np.float64),
        "hf_indexer_softmax_scale": np.array(model.model.layers[0].self_attn.indexer.softmax_scale, np.float64),
        # prompts and prefill
        "prompt_lens": np.array(lengths, np.int32),
        "prompt_ids": _pad_stack(prompts, max_len, 0, -1).astype(np.int32),
        "prefill_logits": _pad_stack([r["prefill_logits"] for r in runs], max_len, 0, np.nan).astype(np.float32),
        "prefill_topk": _pad_stack([r["prefill_topk"] for r in runs], max_len, 1, -1).astype(np.int16),
        "prefill_topk_gap": _pad_stack([r["prefill_gap"] for r in runs], max_len, 1, np.nan).astype(np.float32),
        "prefill_topk_rel_gap": _pad_stack([r["prefill_rel_gap"] for r in runs], max_len, 1, np.nan).astype(
            np.float32
        ),
        # greedy decode
        "gen_tokens": np.stack([r["gen_tokens"] for r in runs]),
        "gen_logprobs": np.stack(
            [np.take_along_axis(_log_softmax(r["gen_logits"]), r["gen_tokens"][:, None], 1)[:, 0] for r in runs]
        ),
        "gen_logsoftmax": np.stack([_log_softmax(r["gen_logits"]) for r in runs]),
        "decode_topk": np.stack([r["decode_topk"] for r in runs]),
        "decode_topk_gap": np.stack([r["decode_gap"] for r in runs]).astype(np.float32),
        "decode_topk_rel_gap": np.stack([r["decode_rel_gap"] for r in runs]).astype(np.float32),
        # layer-level detail for the longest prompt
        "detail_prompt_index": np.array(longest, np.int32),
        "detail_hidden": runs[longest]["hidden"].astype(np.float32),
        "detail_index_scores": runs[longest]["prefill_scores"],
        # dense equivalence (longest prompt)
        "dense_logits": dense_logits.astype(np.float32),
        # diagnostics
        "min_topk_rel_gap": np.array(min_rel_gap, np.float64),
        "min_greedy_margin": np.array(min_margin, np.float64),
        "sparse_dense_max_abs_diff": np.array(sparse_dense_diff, np.float64),
        "v3_vs_dense_v32_max_abs_diff": np.array(v3_vs_v32, np.float64),
        "cached_vs_recompute_max_abs_diff": np.array(worst_recompute, np.float64),
    }
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"{name}.npz")
    np.savez_compressed(path, **fixture)
    print(
        f"[{name}] wrote {path} ({os.path.getsize(path) / 1024:.0f} KiB): seed {seed}, "
        f"sparse-vs-dense {['%.3g' % d for d in sparse_dense_diff]}, V3-vs-dense {v3_vs_v32:.2g}, "
        f"cache-vs-recompute {worst_recompute:.2g}",
        flush=True,
    )
    return path


# --------------------------------------------------------------------------------------------------------------
# DeepseekV3ForCausalLM: dense MLA, so no indexer fields; seeds are screened for MoE routing near-ties instead.


@dataclass
class RouterRecorder:
    """Forward hooks on every MoE layer's router (`mlp.gate`): per token, the margin of HF's routing choice.

    The margin of one token is the smaller of the group stage gap (topk_group-th vs (topk_group+1)-th group score,
    a group scoring the sum of its top 2 biased scores; none with one group) and the expert stage gap (k-th vs
    (k+1)-th biased score among the chosen groups' experts), in sigmoid units. A near-tie there lets an fp32
    reimplementation pick another expert, which moves every later logit.
    """

    model: torch.nn.Module
    margins: list = field(default_factory=list)

    def __enter__(self):
        self._hooks = [
            layer.mlp.gate.register_forward_hook(self._record)
            for layer in self.model.model.layers
            if hasattr(layer.mlp, "gate")
        ]
        if not self._hooks:
            raise RuntimeError("no MoE router found; update the hook")
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return False

    def _record(self, router, inputs, output):
        logits, _, hf_ids = output
        choice = (logits.double().sigmoid() + router.e_score_correction_bias.double()).numpy()  # [T, E]
        n_tok, n_exp = choice.shape
        n_group, topk_group, k = router.num_group, router.topk_group, router.top_k
        groups = choice.reshape(n_tok, n_group, n_exp // n_group)
        group_scores = np.sort(groups, -1)[..., -2:].sum(-1)  # [T, G]
        margin = np.full(n_tok, np.inf)
        if n_group > topk_group:
            ordered = np.sort(group_scores, -1)[:, ::-1]
            margin = ordered[:, topk_group - 1] - ordered[:, topk_group]
        chosen_groups = np.argsort(-group_scores, -1, kind="stable")[:, :topk_group]
        allowed = np.full_like(groups, -np.inf)
        np.put_along_axis(allowed, chosen_groups[..., None], np.take_along_axis(groups, chosen_groups[..., None], 1), 1)
        allowed = allowed.reshape(n_tok, n_exp)
        ordered = np.sort(allowed, -1)[:, ::-1]
        if topk_group * (n_exp // n_group) > k:
            margin = np.minimum(margin, ordered[:, k - 1] - ordered[:, k])
        ours = np.sort(np.argsort(-allowed, -1, kind="stable")[:, :k], -1)
        if not np.array_equal(ours, np.sort(hf_ids.numpy(), -1)):
            raise RuntimeError("HF's routed experts are not the top-k of its own biased scores; update the recorder")
        self.margins.append(margin)

    def min_margin(self) -> float:
        return float(min(m.min() for m in self.margins))


def _register_v3_model_type(model_type: str) -> None:
    """Let `DeepseekV3ForCausalLM.from_pretrained` read a checkpoint whose config.json says `model_type` (Kimi-K2's
    `kimi_k2`, which HF knows only through remote code): HF picks the tensor-name conversion (per-expert tensors ->
    fused `gate_up_proj`) by model_type, so `model_type` gets `deepseek_v3`'s. The modeling code never reads it."""
    if model_type != "deepseek_v3" and get_checkpoint_conversion_mapping(model_type) is None:
        register_checkpoint_conversion_mapping(model_type, get_checkpoint_conversion_mapping("deepseek_v3"))


def _try_v3_seed(name: str, cfg: dict, seed: int, prompts: list[np.ndarray], args, workdir: str):
    _register_v3_model_type(cfg["model_type"])
    ckpt = os.path.join(workdir, f"{name}-{seed}")
    tensors = hf_tiny.random_tensors(cfg, seed)
    sha = hf_tiny.write_checkpoint(cfg, tensors, ckpt)
    assert sha == hf_tiny.write_random_checkpoint(cfg, seed, ckpt)  # the public entry point writes these bytes
    model = _load(DeepseekV3ForCausalLM, ckpt, tensors)
    with RouterRecorder(model) as router:
        runs = [_run_prompt(model, None, p, args.gen_steps, None, cfg["num_hidden_layers"], False) for p in prompts]
    min_margin = min(_margin(row) for r in runs for row in r["gen_logits"])
    return model, sha, runs, router.min_margin(), float(min_margin)


def make_v3_fixture(name: str, cfg: dict, args, workdir: str) -> str:
    """The fixture of a `DeepseekV3ForCausalLM` config: prefill logits, greedy decode, provenance, rope constants."""
    lengths = args.prompt_lengths
    prompts = _prompts(cfg, lengths, args.prompt_seed)
    def attempt(seed):
        tried = _try_v3_seed(name, cfg, seed, prompts, args, workdir)
        min_router_gap, min_margin = tried[-2:]
        return (min_router_gap >= args.min_router_gap and min_margin >= args.min_margin,
                f"min routing gap {min_router_gap:.3g}, min greedy margin {min_margin:.3g}", tried)

    seed, (model, sha, runs, min_router_gap, min_margin) = _search_seeds(name, args, attempt)

    worst_recompute = max(r["recompute_diff"] for r in runs)
    if worst_recompute > args.recompute_tol:
        raise RuntimeError(f"[{name}] cached decode differs from full recompute by {worst_recompute:.3g}")
    if model.config.rope_interleave is not True or model.config.q_lora_rank != cfg["q_lora_rank"]:
        raise RuntimeError(f"[{name}] HF read {model.config.rope_interleave=}, {model.config.q_lora_rank=}")
    direct_q = cfg["q_lora_rank"] is None  # HF's q_proj alone, or q_a_proj + q_a_layernorm + q_b_proj
    for layer in model.model.layers:
        attn = layer.self_attn
        if (attn.q_proj is not None) != direct_q or (attn.q_a_proj is not None) == direct_q:
            raise RuntimeError(f"[{name}] HF built {attn.q_proj=}, {attn.q_a_proj=} for {direct_q=}")

    max_len = max(lengths)
    fixture = {
        # provenance
        "config_name": np.array(name),
        "config_json": np.array(json.dumps(cfg, sort_keys=True)),
        "hf_rope_parameters_json": np.array(json.dumps(model.config.rope_parameters, sort_keys=True)),
        "seed": np.array(seed, np.int64),
        "prompt_seed": np.array(args.prompt_seed, np.int64),
        "checkpoint_sha256": np.array(sha),
        "transformers_version": np.array(transformers.__version__),
        "torch_version": np.array(torch.__version__),
        "numpy_version": np.array(np.__version__),
        "hf_class": np.array("transformers.models.deepseek_v3.DeepseekV3ForCausalLM"),
        "attn_implementation": np.array("eager"),
        "decode_mode": np.array("hf_dynamic_cache"),
        # what HF derived from the config (rope init, softmax scale, rope layout), for unit tests of our own
        "hf_rope_inv_freq": model.model.rotary_emb.inv_freq.numpy().astype(np.float32),
        "hf_rope_attention_scaling": np.array(model.model.rotary_emb.attention_scaling, np.float64),
        "hf_softmax_scale": np.array(model.model.layers[0].self_attn.scaling, np.float64),
        "hf_rope_interleave": np.array(model.config.rope_interleave),
        # prompts and prefill
        "prompt_lens": np.array(lengths, np.int32),
        "prompt_ids": _pad_stack(prompts, max_len, 0, -1).astype(np.int32),
        "prefill_logits": _pad_stack([r["prefill_logits"] for r in runs], max_len, 0, np.nan).astype(np.float32),
        # greedy decode
        "gen_tokens": np.stack([r["gen_tokens"] for r in runs]),
        "gen_logprobs": np.stack(
            [np.take_along_axis(_log_softmax(r["gen_logits"]), r["gen_tokens"][:, None], 1)[:, 0] for r in runs]
        ),
        "gen_logsoftmax": np.stack([_log_softmax(r["gen_logits"]) for r in runs]),
        # diagnostics
        "min_router_gap": np.array(min_router_gap, np.float64),
        "min_greedy_margin": np.array(min_margin, np.float64),
        "cached_vs_recompute_max_abs_diff": np.array(worst_recompute, np.float64),
    }
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"{name}.npz")
    np.savez_compressed(path, **fixture)
    print(
        f"[{name}] wrote {path} ({os.path.getsize(path) / 1024:.0f} KiB): seed {seed}, "
        f"cache-vs-recompute {worst_recompute:.2g}",
        flush=True,
    )
    return path


def main(argv=None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=os.path.normpath(os.path.join(here, "..", "fixtures", "oracle")))
    p.add_argument("--configs", nargs="*", default=None, help="config names (default: all of hf_tiny.tiny_configs)")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[9, 16, 23, 40])
    p.add_argument("--prompt-seed", type=int, default=20251101)
    p.add_argument("--gen-steps", type=int, default=10, help="greedy tokens per prompt (decode forwards = this - 1)")
    p.add_argument("--seed-start", type=int, default=0)
    p.add_argument("--max-seed-tries", type=int, default=200)
    p.add_argument(
        "--min-rel-gap",
        type=float,
        default=3e-4,
        help="reject seeds with an indexer top-k boundary gap below this fraction of the row's score range",
    )
    p.add_argument(
        "--min-margin", type=float, default=1e-3, help="reject seeds with a greedy top-1/top-2 logit gap below this"
    )
    p.add_argument(
        "--min-router-gap",
        type=float,
        default=3e-4,
        help="V3 configs: reject seeds with a MoE group or expert choice gap (biased sigmoid scores) below this",
    )
    p.add_argument("--recompute-tol", type=float, default=1e-4)
    p.add_argument("--v3-tol", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps reductions reproducible)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    configs = hf_tiny.tiny_configs()
    names = args.configs or list(configs)
    unknown = sorted(set(names) - set(configs))
    if unknown:
        p.error(f"unknown configs {unknown}; known: {sorted(configs)}")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, numpy {np.__version__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="oracle-ckpt-") as workdir:
        paths = [
            (make_config_fixture if hf_tiny.has_indexer(configs[n]) else make_v3_fixture)(n, configs[n], args, workdir)
            for n in names
        ]
    total = sum(os.path.getsize(x) for x in paths)
    print(f"done: {len(paths)} fixtures, {total / 1024:.0f} KiB in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
