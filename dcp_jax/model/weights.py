"""HF safetensors in and out for any architecture of the registry: one layer converted at a time, strict, placed
sharded.

The architecture's model file names the HF tensors and converts them (`ModelFunctions.checkpoint`: HF's `[out, in]`
linear weights under their on-disk names, experts one tensor each, to our `[in, out...]` layouts and back); here
each lands in the dtype of the model's leaf (the load dtype, but f32 for the router, its bias and the indexer's
weights_proj, which HF keeps in fp32). Loading checks the files hold exactly the expected tensors (a missing or
unexpected tensor, or a shape mismatch, is a ValueError naming them), converts one layer at a time and places
each parameter on the mesh with the step's sharding (`ModelFunctions.param_specs`: heads, MLP widths and routed
experts split, the rest replicated).

Block-fp8 checkpoints (DeepSeek's release format: `quantization_config` {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [bn, bk]}, e4m3 `X.weight` beside an f32 `X.weight_scale_inv` of one scale per bn x bk block)
load by `quantization` (vLLM's word): "auto" (and "fp8") keeps the projections DeepSeek stores in fp8
(`fp8_linear.FP8_AXES`) in fp8, as `fp8_linear.Fp8BlockWeight`s of their e4m3 values and scales; "none" dequantizes
them (weight = e4m3 value x its block's scale) into the load dtype. "fp8" quantizes an unquantized checkpoint's
projections to block fp8 (`config.ONLINE_FP8_BLOCK`) as each layer loads, on the host. Malformed scales (a wrong
grid, a missing one, a non-finite or non-positive value) and a rank's slice of a split fp8 weight that is not whole
blocks are ValueErrors naming the tensor, raised before anything is placed. `load_hf_params` does not read layers
the config does not use: the multi-token-prediction layer (`num_nextn_predict_layers`, numbered after the decoder
layers; `load_mtp_params` reads it, in fp8 alike), and decoder layers past a `num_hidden_layers` lowered to load
only the first ones.

AMD Quark MXFP4 checkpoints (`quantization_config` {"quant_method": "quark", ...}: which modules, what scheme and
what is refused: `quark.py`) store each MXFP4 module X as `X.weight` uint8 [out, in / 2] beside `X.weight_scale`
uint8 [out, in / 32] (e8m0). Under "auto" the decoder layers' routed experts stay MXFP4, as `mxfp4.Mxfp4Experts` of
the checkpoint's own bytes stacked per layer (`load_hf_params` places them split like the experts: a rank's input
slice must be whole scale blocks of 32, `check_fp8_shardable`); the other MXFP4 modules (shared experts, the MTP
layer's experts) and, under "none", all of them are dequantized (exact: e2m1 value x 2^(scale - 127)) into the
load dtype; "fp8" is refused. Everything the config declares and this engine does not implement is a ValueError
before any file is opened; a tensor whose dtype or shape contradicts the config (a quantized module not uint8, an
excluded one in uint8, a missing weight_scale) one before any weight is read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import struct
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np
from jax.sharding import Mesh

from dcp_jax.config import ONLINE_FP8_BLOCK, QUANTIZATION_CHOICES, ModelConfig
from dcp_jax.model import architecture, fp8_linear, mxfp4, quark
from dcp_jax.model.mesh import sharding
from pallas_kernels.formats import MX_BLOCK, dequantize_mxfp4

FP8 = "F8_E4M3"  # the safetensors dtype of DeepSeek's fp8 weights
U8 = "U8"  # the safetensors dtype of MXFP4 codes and scales
MXFP4_SCALE = "_scale"  # X.weight's e8m0 scales are X.weight_scale


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    return files


class _Reader:
    """Lazy access to tensors spread over several safetensors files (one tensor read at a time)."""

    def __init__(self, files: list[str]):
        from safetensors import safe_open

        self._handles = [safe_open(f, framework="numpy") for f in files]
        self.location: dict[str, object] = {}
        self._file: dict[str, str] = {}
        for path, handle in zip(files, self._handles):
            for name in handle.keys():
                self.location[name] = handle
                self._file[name] = path

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.location[name].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype string ("F32", "BF16", "F8_E4M3", ...)."""
        return self.location[name].get_slice(name).get_dtype()

    def get(self, name: str) -> np.ndarray:
        if self.dtype(name) == FP8:
            return self._get_fp8(name)
        return self.location[name].get_tensor(name)

    def _get_fp8(self, name: str) -> np.ndarray:
        """numpy has no float8 type, so safetensors' numpy reader refuses e4m3: read the tensor's bytes from the
        file (offsets from its header) and view them as ml_dtypes' float8_e4m3fn."""
        import ml_dtypes

        path = self._file[name]
        with open(path, "rb") as f:
            (header_size,) = struct.unpack("<Q", f.read(8))
            meta = json.loads(f.read(header_size))[name]
            begin, end = meta["data_offsets"]
            f.seek(8 + header_size + begin)
            data = np.frombuffer(f.read(end - begin), np.uint8)
        return data.view(ml_dtypes.float8_e4m3fn).reshape(meta["shape"])


def _quantization_config(path: str) -> dict | None:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f).get("quantization_config") or None


def fp8_block_size(path: str) -> tuple[int, int] | None:
    """(bn, bk) of a block-fp8 checkpoint directory's `quantization_config`, None when it has none or is AMD
    Quark's (`quark_config`); ValueError for any other quantization."""
    quantization = _quantization_config(path)
    if not quantization or quark.is_quark(quantization):
        return None
    block = quantization.get("weight_block_size")
    if (quantization.get("quant_method") != "fp8" or quantization.get("fmt", "e4m3") != "e4m3"
            or not isinstance(block, list) or len(block) != 2 or min(block) < 1):
        raise ValueError(f"unsupported quantization_config {quantization}: only block fp8 (quant_method 'fp8', "
                         "fmt 'e4m3', weight_block_size [bn, bk]) and AMD Quark's MXFP4 (quant_method 'quark') "
                         "are read")
    return int(block[0]), int(block[1])


def quark_config(path: str) -> quark.QuarkMxfp4 | None:
    """A checkpoint directory's Quark `quantization_config` after `quark.read`'s checks (None: not Quark)."""
    quantization = _quantization_config(path)
    return quark.read(quantization) if quark.is_quark(quantization) else None


def linear_modules(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The HF linear modules among a checkpoint's tensors (name -> plain shape): each 2-D `X.weight` but the
    embeddings, as X."""
    return [n[: -len(".weight")] for n, shape in shapes.items()
            if n.endswith(".weight") and len(shape) == 2 and not n.endswith("embed_tokens.weight")]


def mxfp4_plan(path: str, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> quark.Mxfp4Plan | None:
    """The MXFP4 modules among the tensors `shapes` (name -> plain shape) of a Quark checkpoint directory and what
    they become (`quark.QuarkMxfp4.plan`: ValueError for what is not implemented); None for another checkpoint."""
    config = quark_config(path)
    if config is None:
        return None
    moe_layers = [layer for layer in range(cfg.num_hidden_layers) if cfg.is_moe_layer(layer)]
    return config.plan(linear_modules(shapes), num_hidden_layers=cfg.num_hidden_layers, moe_layers=moe_layers,
                       num_experts=cfg.n_routed_experts)


def loaded_mxfp4_experts(path: str, cfg: ModelConfig, quantization: str) -> mxfp4.ExpertsFormat | None:
    """The format of the MXFP4 routed experts a load of `cfg` from `path` under `quantization` keeps: a Quark
    checkpoint's under "auto" (None: the experts load plain). ValueError for a Quark config not implemented."""
    kept_fp8_block(path, quantization)  # refuses an unknown quantization, and "fp8" of a Quark checkpoint
    plan = mxfp4_plan(path, cfg, architecture.of(cfg).model.checkpoint.tensor_shapes(cfg))
    if quantization != "auto" or plan is None or not plan.routed:
        return None
    return mxfp4.ExpertsFormat(plan.activations, plan.scale_mode)


def checkpoint_weight_format(path: str, cfg: ModelConfig) -> str:
    """The `config.WEIGHT_FORMATS` entry a load under "auto" gives (`memory_plan`'s): "fp8" for a block fp8
    checkpoint, "mxfp4" for a Quark one whose routed experts are MXFP4, else "model_dtype"."""
    if fp8_block_size(path):
        return "fp8"
    return "mxfp4" if loaded_mxfp4_experts(path, cfg, "auto") is not None else "model_dtype"


def abstract_params(cfg: ModelConfig, path: str, dtype, quantization: str) -> dict:
    """The pure-dict abstract state (ShapeDtypeStructs) `load_hf_params` fills for `quantization`: block fp8 leaves
    kept or quantized on load (`loaded_fp8_block`), MXFP4 routed experts kept (`loaded_mxfp4_experts`), the rest in
    `dtype` (f32 where the model keeps f32)."""
    _, abstract = architecture.of(cfg).model.abstract_model(cfg, dtype, loaded_fp8_block(path, quantization))
    return mxfp4.with_mxfp4_experts(nnx.to_pure_dict(abstract), loaded_mxfp4_experts(path, cfg, quantization))


def _stored_shapes(shapes: dict[str, tuple[int, ...]], plan: quark.Mxfp4Plan | None) -> dict[str, tuple[int, ...]]:
    """The tensors (name -> shape) a checkpoint of these plain `shapes` stores: an MXFP4 module's weight as packed
    codes [out, in / 2] with its e8m0 scales [out, in / 32]."""
    if plan is None:
        return dict(shapes)
    stored = {}
    for name, shape in shapes.items():
        if name[: -len(".weight")] in plan.modules and name.endswith(".weight"):
            out, depth = shape
            stored |= {name: (out, depth // 2), name + MXFP4_SCALE: (out, -(-depth // MX_BLOCK))}
        else:
            stored[name] = shape
    return stored


def _mxfp4_type_problems(reader: "_Reader", shapes: dict[str, tuple[int, ...]],
                         plan: quark.Mxfp4Plan | None) -> list[str]:
    """Tensors whose dtype contradicts the Quark config: MXFP4 codes and scales not uint8, or plain tensors in
    uint8; and MXFP4 modules whose input width is not whole scale blocks."""
    if plan is None:
        return []
    names = {n + ".weight" for n in plan.modules}
    problems = [f"{n}: in {shapes[n][1]} is not a multiple of {MX_BLOCK}" for n in sorted(names)
                if shapes[n][1] % MX_BLOCK]
    for name in shapes:
        want_u8 = name in names
        for stored in (name, name + MXFP4_SCALE) if want_u8 else (name,):
            if stored in reader.location and (reader.dtype(stored) == U8) != want_u8:
                problems.append(f"{stored}: {reader.dtype(stored)}, the Quark config says "
                                f"{'MXFP4 (U8)' if want_u8 else 'unquantized (excluded)'}")
    return problems


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """f32 weight [out, in] from e4m3 values and one f32 scale per block of bn x bk (edge blocks partial)."""
    scales = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block[0], axis=0), block[1], axis=1)
    return weight.astype(np.float32) * scales[: weight.shape[0], : weight.shape[1]]


def kept_fp8_block(path: str, quantization: str) -> tuple[int, int] | None:
    """The block of the fp8 weights `load_hf_params` keeps for `quantization` (`config.QUANTIZATION_CHOICES`): the
    checkpoint's under "auto" or "fp8" when it is block fp8; None when the weights load in the load dtype."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization={quantization!r} must be one of {QUANTIZATION_CHOICES}")
    if quantization == "fp8" and quark_config(path) is not None:
        raise ValueError("quantization='fp8' does not apply to an AMD Quark MXFP4 checkpoint: 'auto' keeps its "
                         "routed experts in MXFP4, 'none' dequantizes them")
    return fp8_block_size(path) if quantization != "none" else None


def online_fp8_block(path: str, quantization: str) -> tuple[int, int] | None:
    """The block `quantization` "fp8" quantizes an unquantized checkpoint's `fp8_linear.FP8_AXES` leaves to on load
    (None otherwise: a block fp8 checkpoint's are kept as they are)."""
    return ONLINE_FP8_BLOCK if quantization == "fp8" and not fp8_block_size(path) else None


def loaded_fp8_block(path: str, quantization: str) -> tuple[int, int] | None:
    """The block of the fp8 weights a load under `quantization` gives: kept or quantized on load (None: plain)."""
    return kept_fp8_block(path, quantization) or online_fp8_block(path, quantization)


@functools.partial(jax.jit, static_argnums=1)
def _quantized_on_host(params: dict, block: tuple[int, int]) -> dict:
    """`fp8_linear.quantize_params` compiled (fused, so without eager full-size temporaries); the caller runs it on
    the host's CPU device, so a layer's f32 copy never lands on an accelerator."""
    return fp8_linear.quantize_params(params, block)


def _with_scales(ours: dict, scales: dict, block: tuple[int, int]) -> dict:
    """`ours` with each leaf that `scales` (nested alike) names an Fp8BlockWeight of its e4m3 values (our layout,
    reordered K-major) and scales."""
    out = dict(ours)
    for key, s in scales.items():
        out[key] = (_with_scales(ours[key], s, block) if isinstance(s, dict)
                    else fp8_linear.from_plain_layout(ours[key], s, block, *fp8_linear.FP8_AXES[key]))
    return out


def _checked_fp8_scales(path: str, cfg: ModelConfig, reader: _Reader, expected: dict[str, tuple[int, ...]],
                        block: tuple[int, int] | None, is_kept: bool) -> dict[str, np.ndarray]:
    """The weight_scale_inv grid of each tensor of `expected` (name -> shape) stored in block fp8 (none without a
    block). ValueError, before anything is converted, for a scale of the wrong shape, an e4m3 tensor without a
    scale or a scale beside a tensor of another dtype, and what `_fp8_problems` finds."""
    scales = {n: n + "_scale_inv" for n, shape in expected.items()
              if block and len(shape) == 2 and n + "_scale_inv" in reader.location}
    wrong = []
    for name, scale in scales.items():
        rows, cols = expected[name]
        want = (-(-rows // block[0]), -(-cols // block[1]))
        if reader.shape(scale) != want:
            wrong.append(f"{scale}: file {reader.shape(scale)} != expected {want} (blocks of {block})")
    wrong += [f"{n}: {reader.dtype(n)} " + ("without a weight_scale_inv" if n not in scales else "with a scale")
              for n in expected if (reader.dtype(n) == FP8) != (n in scales)]
    if wrong:
        raise ValueError(f"checkpoint {path} has tensors of the wrong shape or type: {wrong[:20]}")
    scale_values = {n: reader.get(s) for n, s in scales.items()}
    wrong = _fp8_problems(cfg, reader, expected, scales, scale_values, block, is_kept)
    if wrong:
        raise ValueError(f"checkpoint {path} has malformed fp8 weights: {wrong[:20]}")
    return scale_values


def _fp8_problems(cfg: ModelConfig, reader: _Reader, expected: dict[str, tuple[int, ...]], scales: dict[str, str],
                  scale_values: dict[str, np.ndarray], block: tuple[int, int], is_kept: bool) -> list[str]:
    """What stops a block fp8 checkpoint from loading: scales that are not finite and positive (the weight would
    be NaN or zero), and when kept in fp8, an fp8 leaf's tensor stored without a scale, or what the model file finds
    (`DeepseekCheckpoint.fp8_problems`: kv_b_proj blocks that straddle the k_nope / v rows of a head, q_a_proj rows
    that end mid-block)."""
    problems = [f"{scales[n]}: a non-finite or non-positive scale" for n, s in scale_values.items()
                if not np.all(np.isfinite(s) & (s > 0))]
    if is_kept:
        checkpoint = architecture.of(cfg).model.checkpoint
        fp8_tensors = checkpoint.fp8_tensors(cfg)
        problems += [f"{n}: {reader.dtype(n)} without a weight_scale_inv; load with quantization='none'"
                     for n in expected if n.endswith(fp8_tensors) and n not in scales]
        problems += checkpoint.fp8_problems(cfg, block)
    return problems


def _unused_layer_names(path: str, cfg: ModelConfig, names) -> set[str]:
    """Tensors of the checkpoint's layers that `cfg` does not use: decoder layers past a truncated
    `cfg.num_hidden_layers`, and the multi-token-prediction layers numbered after the decoder's."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    end = int(raw.get("num_hidden_layers", cfg.num_hidden_layers)) + int(raw.get("num_nextn_predict_layers") or 0)
    checkpoint = architecture.of(cfg).model.checkpoint
    prefixes = tuple(checkpoint.layer_prefix(layer) for layer in range(cfg.num_hidden_layers, end))
    return {n for n in names if prefixes and n.startswith(prefixes)}


def _place(tree, specs, abstract, mesh: Mesh | None):
    """Each tensor cast to the dtype of its leaf in `abstract` (the model's: f32 router / router_bias /
    index_weights whatever the load dtype) and placed with its spec."""

    def put(x, spec, want):
        x = np.asarray(x, dtype=want.dtype)
        return jax.device_put(x, sharding(mesh, spec)) if mesh is not None else jnp.asarray(x)

    return jax.tree.map(put, tree, specs, abstract)


def _zero_stack(abstract: dict, specs: dict, mesh: Mesh | None) -> dict:
    """A layer stack's zero weights, created in their placement (each layer is written in by `_write_layer`)."""
    def zeros():
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)

    if mesh is None:
        return zeros()
    return jax.jit(zeros, out_shardings=jax.tree.map(lambda spec: sharding(mesh, spec), specs))()


@functools.partial(jax.jit, donate_argnums=0)
def _write_layer(stack: dict, layer: dict, index: int) -> dict:
    """The stack with `layer` (its weights, each with a leading axis of 1) written at `index`, in place."""
    return jax.tree.map(lambda s, x: jax.lax.dynamic_update_slice_in_dim(s, x, index, 0), stack, layer)


def load_hf_params(cfg: ModelConfig, path: str | os.PathLike, mesh: Mesh | None = None, dtype=jnp.float32,
                   progress: Callable | None = None, *, expert_parallel: bool = False,
                   quantization: str = "auto") -> dict:
    """Read a HF checkpoint directory into our pure-dict params, placed on `mesh` with the model's `param_specs` (routed
    experts split along X when `expert_parallel`, else along F; default device when `mesh` is None). A block fp8
    checkpoint's fp8 weights stay fp8 under `quantization` "auto" (or "fp8") and load in `dtype` under "none"; an
    unquantized checkpoint's `fp8_linear.FP8_AXES` leaves are quantized to `config.ONLINE_FP8_BLOCK` under "fp8". A
    Quark MXFP4 checkpoint's routed experts stay MXFP4 under "auto" (`mxfp4.Mxfp4Experts`), its other MXFP4
    modules (and all under "none") load dequantized in `dtype`. Raises ValueError for a quantization not
    implemented before any file is opened, and listing missing / unexpected tensors, shape or dtype mismatches or
    malformed fp8 scales before any conversion. `progress(iterable)` may wrap the per-layer loop (e.g. tqdm)."""
    path = os.fspath(path)
    model = architecture.of(cfg).model
    expected = model.checkpoint.tensor_shapes(cfg)
    plan = mxfp4_plan(path, cfg, expected)
    kept_experts = loaded_mxfp4_experts(path, cfg, quantization)
    reader = _Reader(_safetensors_files(path))
    block = fp8_block_size(path)
    scale_names = {n + "_scale_inv" for n, shape in expected.items() if len(shape) == 2} if block else set()
    stored = _stored_shapes(expected, plan)
    ignored = _unused_layer_names(path, cfg, reader.location)
    missing = sorted(set(stored) - set(reader.location))
    unexpected = sorted(set(reader.location) - set(stored) - scale_names - ignored)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the config: missing tensors {missing[:20]}"
                         f"{' ...' if len(missing) > 20 else ''}, unexpected tensors {unexpected[:20]}"
                         f"{' ...' if len(unexpected) > 20 else ''}")
    wrong = [f"{n}: file {reader.shape(n)} != expected {s}" for n, s in stored.items() if reader.shape(n) != s]
    wrong += _mxfp4_type_problems(reader, expected, plan)
    if wrong:
        raise ValueError(f"checkpoint {path} has tensors of the wrong shape or type: {wrong[:20]}")
    read, read_layer = _readers(path, cfg, reader, expected, quantization, plan, kept_experts)

    abstract = abstract_params(cfg, path, dtype, quantization)
    specs = model.param_specs(cfg, abstract, expert_parallel=expert_parallel)
    if mesh is not None:
        check_fp8_shardable(abstract, specs, mesh)
    stacks = {stack.name: _zero_stack(abstract[stack.name], specs[stack.name], mesh)
              for stack in model.layer_stacks(cfg)}
    layers = range(cfg.num_hidden_layers)
    for layer in progress(layers) if progress else layers:
        ours = read_layer(layer)
        stack = model.stack_of(cfg, layer)
        placed = _place(jax.tree.map(lambda x: x[None], ours), specs[stack.name], abstract[stack.name], mesh)
        stacks[stack.name] = _write_layer(stacks[stack.name], placed, stack.index_of(layer))
    top = {ours: read(name).T if transposed else read(name)
           for ours, (name, transposed) in model.checkpoint.TOP.items()}
    params = stacks | {k: _place(v, specs[k], abstract[k], mesh) for k, v in top.items()}
    _check_filled(abstract, params)
    return params


def _readers(path: str, cfg: ModelConfig, reader: _Reader, expected: dict[str, tuple[int, ...]],
             quantization: str, plan: quark.Mxfp4Plan | None,
             kept_experts: mxfp4.ExpertsFormat | None) -> tuple[Callable[[str], np.ndarray], Callable[[int], dict]]:
    """(read(name), read_layer(layer)) of the checkpoint under `quantization` (`_fp8_reader`, `_read_layer`), once
    its fp8 scales pass `_checked_fp8_scales`; a Quark checkpoint's MXFP4 modules of `plan` dequantized but the
    routed experts kept in `kept_experts`'s format (when not None)."""
    block, kept_block = fp8_block_size(path), kept_fp8_block(path, quantization)
    scale_values = _checked_fp8_scales(path, cfg, reader, expected, block, kept_block is not None)
    fp8_tensors = architecture.of(cfg).model.checkpoint.fp8_tensors(cfg)
    mxfp4_weights = {n + ".weight" for n in plan.modules} if plan is not None else set()
    read = _fp8_reader(reader, scale_values, block, kept_block, fp8_tensors, mxfp4_weights)
    return read, functools.partial(_read_layer, cfg, read=read, scale_values=scale_values, kept_block=kept_block,
                                   online_block=online_fp8_block(path, quantization), fp8_tensors=fp8_tensors,
                                   reader=reader, kept_experts=kept_experts)


def _kept(name: str, kept_block: tuple[int, int] | None, fp8_tensors: tuple[str, ...]) -> bool:
    """Whether the tensor `name` of a block fp8 checkpoint stays fp8: one of the leaves the model file's checkpoint
    stores in fp8 (names ending in one of `fp8_tensors`), with kept_block set."""
    return kept_block is not None and name.endswith(fp8_tensors)


def _fp8_reader(reader: _Reader, scale_values: dict[str, np.ndarray], block: tuple[int, int] | None,
                kept_block: tuple[int, int] | None, fp8_tensors: tuple[str, ...],
                mxfp4_weights: set[str]) -> Callable[[str], np.ndarray]:
    """read(name): the tensor as stored, dequantized from fp8 unless it is kept (`_kept`), dequantized to f32 from
    MXFP4 (codes and `X.weight_scale`) when it is one of `mxfp4_weights`."""

    def read(name: str) -> np.ndarray:
        if name in mxfp4_weights:
            return dequantize_mxfp4(reader.get(name), reader.get(name + MXFP4_SCALE), np.float32)
        if name in scale_values and not _kept(name, kept_block, fp8_tensors):
            return dequantize_fp8(reader.get(name), scale_values[name], block)
        return reader.get(name)

    return read


def _read_layer(cfg: ModelConfig, layer: int, read: Callable[[str], np.ndarray], scale_values: dict[str, np.ndarray],
                kept_block: tuple[int, int] | None, online_block: tuple[int, int] | None,
                fp8_tensors: tuple[str, ...], reader: _Reader, kept_experts: mxfp4.ExpertsFormat | None) -> dict:
    """Decoder layer `layer` (a main one or the MTP layer) as our params: its kept fp8 leaves `Fp8BlockWeight`s, or
    with `online_block` its fp8 leaves quantized to that block here; with `kept_experts` a main MoE layer's routed
    experts `mxfp4.Mxfp4Experts` of the checkpoint's bytes (`_kept_experts`)."""
    checkpoint = architecture.of(cfg).model.checkpoint
    prefix = checkpoint.layer_prefix(layer)
    names = [prefix + name for name in checkpoint.layer_tensor_shapes(cfg, layer)]
    keeps_experts = kept_experts is not None and layer < cfg.num_hidden_layers and cfg.is_moe_layer(layer)
    # Kept experts reach `layer_to_ours` as empty placeholders: its plain stacks of them are replaced below.
    ours = checkpoint.layer_to_ours(cfg, layer, {
        n[len(prefix):]: _PLACEHOLDER if keeps_experts and n[len(prefix):].startswith(_ROUTED) else read(n)
        for n in names})
    if keeps_experts:
        ours["mlp"] |= _kept_experts(cfg, reader, prefix, kept_experts)
    if online_block:
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            return jax.tree.map(np.asarray, _quantized_on_host(ours, online_block))
    if not kept_block:
        return ours
    layer_scales = {n[len(prefix):]: scale_values[n] for n in names
                    if n in scale_values and _kept(n, kept_block, fp8_tensors)}
    return _with_scales(ours, checkpoint.layer_scales_to_ours(cfg, layer, layer_scales, kept_block), kept_block)


_ROUTED = "mlp.experts."  # a layer's routed experts' tensors (relative names)
_PLACEHOLDER = np.empty((0, 0), np.uint8)


def _kept_experts(cfg: ModelConfig, reader: _Reader, prefix: str, fmt: mxfp4.ExpertsFormat) -> dict:
    """One MoE layer's routed experts as `Mxfp4Experts`: each kind's HF tensors (packed [out, in / 2], scales [out,
    in / 32], uint8) stacked over the experts, the bytes as stored."""
    def stacked(kind: str, suffix: str) -> np.ndarray:
        return np.stack([reader.get(f"{prefix}{_ROUTED}{x}.{kind}_proj.weight{suffix}")
                         for x in range(cfg.n_routed_experts)])

    return {f"experts_{kind}": mxfp4.from_checkpoint(stacked(kind, ""), stacked(kind, MXFP4_SCALE), fmt)
            for kind in ("gate", "up", "down")}


def check_fp8_shardable(abstract: dict, specs: dict, mesh: Mesh) -> None:
    """ValueError naming the first quantized leaf of `abstract` whose rank slice under `specs` on `mesh` is not
    whole blocks: block fp8 (`fp8_linear.check_shardable`) and MXFP4 experts' scale blocks of 32 inputs
    (`mxfp4.check_shardable`)."""
    flat = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=fp8_linear.is_quantized)[0]
    for (path, leaf), spec in zip(flat, jax.tree.leaves(specs, is_leaf=fp8_linear.is_quantized)):
        if fp8_linear.is_fp8(leaf):
            fp8_linear.check_shardable(jax.tree_util.keystr(path), leaf, fp8_linear.plain_spec(leaf, spec.values),
                                       dict(mesh.shape))
        elif mxfp4.is_mxfp4(leaf):
            mxfp4.check_shardable(jax.tree_util.keystr(path), leaf, mxfp4.plain_spec(leaf, spec.packed),
                                  dict(mesh.shape))


def _check_filled(abstract: dict, params: dict) -> None:
    want = jax.tree_util.tree_flatten_with_path(abstract)
    got = jax.tree_util.tree_flatten_with_path(params)
    if jax.tree.structure(abstract) != jax.tree.structure(params):
        raise ValueError(f"converted params do not fill the model: {jax.tree.structure(params)}")
    for (path, a), (_, b) in zip(want[0], got[0]):
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(f"{jax.tree_util.keystr(path)}: converted shape {b.shape} != model shape {a.shape}")
        if a.dtype != b.dtype:
            raise ValueError(f"{jax.tree_util.keystr(path)}: converted dtype {b.dtype} != model dtype {a.dtype}")


def save_hf(cfg: ModelConfig, params: dict, path: str | os.PathLike, *, mtp: dict | None = None) -> None:
    """Write `config.json` (`cfg`'s) and `model.safetensors` (HF names; bfloat16 when cfg.torch_dtype says so,
    else float32) that `load_hf_params` and HF read; with `mtp` (an `MtpLayer`'s pure dict) its layer too. The
    written config's num_nextn_predict_layers counts the MTP layers written (1 or 0)."""
    import ml_dtypes

    from safetensors.numpy import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    model = architecture.of(cfg).model
    checkpoint = model.checkpoint
    host = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), params)
    tensors = {name: host[ours].T if transposed else host[ours]
               for ours, (name, transposed) in checkpoint.TOP.items()}
    for layer in range(cfg.num_hidden_layers):
        tensors |= {checkpoint.layer_prefix(layer) + k: v
                    for k, v in checkpoint.layer_to_hf(cfg, layer, model.layer_params(cfg, host, layer)).items()}
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=int(mtp is not None))  # the layers written
    if mtp is not None:
        tensors |= checkpoint.mtp_to_hf(cfg, jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), mtp),
                                        host)
    dtype = ml_dtypes.bfloat16 if cfg.torch_dtype == "bfloat16" else np.float32
    save_file({k: np.ascontiguousarray(v.astype(dtype)) for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(architecture.config_to_hf(cfg), f, indent=2, sort_keys=True)


def load_mtp_params(cfg: ModelConfig, path: str | os.PathLike, quantization: str = "auto") -> dict:
    """The MTP layer of a HF checkpoint directory as an `MtpLayer`'s pure dict of numpy arrays, f32; a block fp8
    checkpoint's as `load_hf_params` reads its layers: its decoder layer's fp8 leaves stay fp8 under quantization
    "auto" or "fp8", the rest (eh_proj among them, if stored in fp8) dequantized; an unquantized checkpoint's
    decoder-layer fp8 leaves quantized under "fp8"; a Quark checkpoint's MXFP4 modules of the layer (its experts)
    dequantized. Strict: ValueError naming missing tensors, wrong shapes or dtypes, malformed fp8 scales or a
    Quark scheme not implemented; its copies of the embedding and the head must equal the main model's."""
    path = os.fspath(path)
    checkpoint = architecture.of(cfg).model.checkpoint
    expected = checkpoint.mtp_tensor_shapes(cfg)
    kept_fp8_block(path, quantization)  # refuses an unknown quantization, and "fp8" of a Quark checkpoint
    plan = mxfp4_plan(path, cfg, expected)
    reader = _Reader(_safetensors_files(path))
    stored = _stored_shapes(expected, plan)
    missing = sorted(set(stored) - set(reader.location))
    wrong = [f"{n}: file {reader.shape(n)} != expected {s}" for n, s in stored.items()
             if n in reader.location and reader.shape(n) != s]
    wrong += _mxfp4_type_problems(reader, expected, plan) if not missing else []
    if missing or wrong:
        raise ValueError(f"checkpoint {path}: MTP layer missing tensors {missing[:20]}, wrong shapes or types "
                         f"{wrong[:20]}")
    read, read_layer = _readers(path, cfg, reader, expected, quantization, plan, None)
    prefix = checkpoint.layer_prefix(cfg.num_hidden_layers)

    def own(name: str) -> np.ndarray:
        return np.asarray(read(prefix + name), np.float32)

    for copy, main in checkpoint.MTP_COPIES.items():
        if not np.array_equal(np.asarray(reader.get(prefix + copy), np.float32),
                              np.asarray(reader.get(main), np.float32)):
            raise ValueError(f"checkpoint {path}: {prefix}{copy} differs from {main} (the MTP layer shares it)")

    def f32(x):  # an fp8 leaf keeps its e4m3 values, its scales f32 as the model's
        if fp8_linear.is_fp8(x):
            return dataclasses.replace(x, scales=np.asarray(x.scales, np.float32))
        return np.asarray(x, np.float32)

    layer = read_layer(cfg.num_hidden_layers)
    return {**checkpoint.mtp_own_to_ours(own), "layer": jax.tree.map(f32, layer, is_leaf=fp8_linear.is_fp8)}
