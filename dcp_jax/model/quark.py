"""AMD Quark's `quantization_config` (quant_method "quark"): which HF linear modules a checkpoint stores in OCP
MXFP4 and what this engine does with them. Host only: no jax (the loader and `dcp-jax plan` read it before any
weight).

What the export looks like, from what was read for this module: the amd/GLM-5.2-MXFP4 model card (AMD Quark 0.11,
`--quant_scheme mxfp4 --exclude_layers "*self_attn*" "*mlp.gate" "*lm_head" "*mlp.gate_proj" "*mlp.up_proj"
"*mlp.down_proj" "*layers.78.*"`: "MOE-only (shared experts quantized), OCP MXFP4" weights (static) and activations
(dynamic)); a public Quark MXFP4 export script's `build_quantization_config` (quant_method, version, quant_mode,
export {kv_cache_group, min_kv_scale, pack_method, weight_format, weight_merge_groups}, global_quant_config {weight,
input_tensors, output_tensors, bias, target_device}, layer_quant_config, layer_type_quant_config, exclude,
algo_config, kv_cache_quant_config, softmax_quant_spec; a tensor spec {dtype "fp4", qscheme "per_group", group_size
32, ch_axis -1, scale_format "e8m0", scale_calculation_mode "even", round_method "half_even", is_dynamic, ...}); and
vLLM's Quark tests (`ocp_mx_mxfp4_activation`: the same weight spec with input_tensors the dynamic one). A quantized
module X stores `X.weight` uint8 [out, in / 2] (two e2m1 codes a byte, input 2i in the low nibble) and
`X.weight_scale` uint8 [out, in / 32] (e8m0): `pallas_kernels/formats.py`.

How a module's scheme is found follows vLLM's Quark loader (vllm/model_executor/layers/quantization/quark/quark.py,
`QuarkConfig.get_quant_method` / `_find_matched_config`, and quark/utils.py `should_ignore_layer`):
- a module named by `exclude` is unquantized. An entry matches a module name when equal to it, when it starts with
  "re:" and the rest `re.match`es it (vLLM's rule), or when it holds a wildcard (* ? [) and `fnmatch`es it (the
  spelling of Quark's `--exclude_layers`, as in the GLM-5.2 recipe);
- else the first `layer_quant_config` pattern that matches it (fnmatch with a wildcard, else the exact name), else
  `global_quant_config`. `layer_type_quant_config` keys are torch module types, which a checkpoint does not name:
  a non-empty one is refused.
A scheme is MXFP4 as vLLM's `_is_w_ocp_mx_a_x` reads it, with dtype fp4: weight {dtype "fp4", qscheme
"per_group", group_size 32, scale_format "e8m0", not dynamic, ch_axis -1 / 1 / absent (groups along the input),
round_method "half_even" / absent}; input_tensors None (the activations as they are) or the same with is_dynamic
true (the activations quantize-dequantized per 32 inputs before the product, `mxfp4.quantize_dequantize`:
scale_calculation_mode "even" is Quark's scale rule, absent the OCP rule); output_tensors and bias None (vLLM
raises NotImplementedError on them too). A weight None: the module is unquantized.

What is implemented (`QuarkMxfp4.plan`): the decoder layers' routed experts in MXFP4 (kept so under load quantization
"auto": `mxfp4.Mxfp4Experts`), and the shared experts and the MTP layer's experts in MXFP4 (their values
dequantized on load into the load dtype: exact, the model has no MXFP4 path for them; their activations, if
declared MXFP4, are not quantized: W4A16 where vLLM emulates W4A4). Refused before any weight is read, naming the
modules or fields: any other module in MXFP4 (attention, the dense MLPs, the router, lm_head), any other scheme
(other dtypes such as fp8_e4m3 or fp6, per-tensor or per-channel scales, other group sizes, static or fp8 input
scales, quantized outputs or biases), KV-cache quantization (`export.kv_cache_group`, `kv_cache_quant_config`),
`softmax_quant_spec`, fake-quantized exports, algorithms that change the computation at run time (rotations: only
those folded into the weights at export, `FOLDED_ALGORITHMS`, pass), routed experts whose MXFP4 covers some layers or
experts and not others, and routed experts with mixed activation schemes.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Iterable, Mapping
from typing import Any

QUANT_METHOD = "quark"
GROUP_SIZE = 32  # OCP MX: inputs per e8m0 scale
# Quark algorithms applied to the weights before export (smoothing scales folded into the neighbouring weights,
# weight rounding): nothing of them is left to run.
FOLDED_ALGORITHMS = frozenset({"smooth", "autosmoothquant", "awq", "gptq", "qronos"})
# The activation schemes of MXFP4 routed experts: "model_dtype" (as they are) or "mxfp4" (quantize-dequantized).
ACTIVATIONS = ("model_dtype", "mxfp4")
# Quark's scale rules for dynamic MXFP4 activations this engine emulates: None (the OCP spec's) and "even".
SCALE_MODES = (None, "even")
# HF names (DeepSeek family, `deepseek_v32.DeepseekCheckpoint`) of the expert modules.
_ROUTED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj")
_SHARED = re.compile(r"model\.layers\.(\d+)\.mlp\.shared_experts\.(gate|up|down)_proj")


def is_quark(quantization_config: Mapping[str, Any] | None) -> bool:
    """Whether a config.json's `quantization_config` is Quark's."""
    return bool(quantization_config) and quantization_config.get("quant_method") == QUANT_METHOD


@dataclasses.dataclass(frozen=True)
class Mxfp4Plan:
    """What a checkpoint's MXFP4 modules become (`QuarkMxfp4.plan`)."""

    # Routed-expert modules of the decoder layers (HF names without ".weight"): every expert of every MoE layer,
    # or none.
    routed: frozenset[str]
    # Other MXFP4 modules: shared experts, the MTP layer's experts (dequantized on load).
    dequantized: frozenset[str]
    # The routed experts' activations (`ACTIVATIONS`) and, for "mxfp4", Quark's scale rule (`SCALE_MODES`).
    activations: str
    scale_mode: str | None

    @property
    def modules(self) -> frozenset[str]:
        """Every module stored in MXFP4."""
        return self.routed | self.dequantized


@dataclasses.dataclass(frozen=True)
class QuarkMxfp4:
    """A Quark `quantization_config` whose global checks passed (`read`); `plan` decides the modules."""

    config: Mapping[str, Any]

    def excluded(self, module: str) -> bool:
        """Whether `exclude` names `module` (the module docstring's matching)."""
        return any(_matches_exclude(module, entry) for entry in self.config.get("exclude") or ())

    def scheme(self, module: str) -> Mapping[str, Any] | None:
        """The quantization scheme of a module not excluded: its layer_quant_config entry, else the global one."""
        for pattern, scheme in (self.config.get("layer_quant_config") or {}).items():
            if (fnmatch.fnmatchcase(module, pattern) if _has_wildcard(pattern) else module == pattern):
                return scheme
        return self.config.get("global_quant_config")

    def plan(self, linear_modules: Iterable[str], *, num_hidden_layers: int, moe_layers: Iterable[int],
             num_experts: int) -> Mxfp4Plan:
        """The MXFP4 modules among `linear_modules` (HF names of the checkpoint's linear layers, without ".weight")
        and what they become; ValueError naming every module or scheme not implemented (module docstring). Routed
        experts of layers >= num_hidden_layers (the MTP layer) are dequantized as the shared experts are."""
        quantized, problems, schemes = set(), [], {}
        for module in sorted(linear_modules):
            if self.excluded(module):
                continue
            scheme = self.scheme(module)
            weight = None if scheme is None else scheme.get("weight")
            if weight is None:
                continue
            reasons = scheme_problems(scheme)
            if reasons:
                problems.append(f"{module}: {'; '.join(reasons)}")
                continue
            quantized.add(module)
            schemes[module] = scheme
        routed = {m for m in quantized if _ROUTED.fullmatch(m) and int(_ROUTED.fullmatch(m)[1]) < num_hidden_layers}
        dequantized = {m for m in quantized - routed if _ROUTED.fullmatch(m) or _SHARED.fullmatch(m)}
        others = sorted(quantized - routed - dequantized)
        if others:
            problems.append(f"modules other than experts in MXFP4 are not implemented (this engine keeps the routed "
                            f"experts in MXFP4 and dequantizes the shared ones): {_listing(others)}")
        want = {f"model.layers.{layer}.mlp.experts.{x}.{kind}_proj" for layer in moe_layers if layer < num_hidden_layers
                for x in range(num_experts) for kind in ("gate", "up", "down")}
        if routed and routed != want:
            problems.append(f"the routed experts are in MXFP4 in some layers or experts and not in others (one "
                            f"tensor holds a layer stack's experts): not in MXFP4 {_listing(sorted(want - routed))}; "
                            f"quantization='none' loads them all dequantized")
        activations = {_activations(schemes[m]) for m in routed}
        if len(activations) > 1:
            problems.append(f"the routed experts declare different activation schemes {sorted(activations, key=str)}")
        if problems:
            raise ValueError(f"Quark quantization_config not implemented: {' | '.join(problems)}")
        activation, scale_mode = activations.pop() if activations else ("model_dtype", None)
        return Mxfp4Plan(frozenset(routed), frozenset(dequantized), activation, scale_mode)


def read(quantization_config: Mapping[str, Any]) -> QuarkMxfp4:
    """A Quark `quantization_config` after the checks that need no module name (export format, KV cache,
    algorithms, layer types); ValueError naming each field this engine does not implement."""
    config = quantization_config
    problems = []
    export = config.get("export") or {}
    if export.get("weight_format", "real_quantized") != "real_quantized":
        problems.append(f"export.weight_format {export.get('weight_format')!r} (only 'real_quantized': packed "
                        f"codes with their scales)")
    if export.get("kv_cache_group"):
        problems.append(f"KV-cache quantization (export.kv_cache_group {export['kv_cache_group']})")
    if config.get("kv_cache_quant_config"):
        problems.append("KV-cache quantization (kv_cache_quant_config)")
    if config.get("softmax_quant_spec"):
        problems.append("softmax quantization (softmax_quant_spec)")
    if config.get("layer_type_quant_config"):
        problems.append(f"layer_type_quant_config {sorted(config['layer_type_quant_config'])} (keyed by torch "
                        f"module types, which a checkpoint does not name)")
    algorithms = config.get("algo_config") or []
    if isinstance(algorithms, Mapping):
        algorithms = [algorithms]
    names = [a.get("name") if isinstance(a, Mapping) else a for a in algorithms]
    unfolded = [n for n in names if n not in FOLDED_ALGORITHMS]
    if unfolded:
        problems.append(f"algo_config {unfolded} (only algorithms folded into the weights at export: "
                        f"{sorted(FOLDED_ALGORITHMS)})")
    exclude = config.get("exclude") or []
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        problems.append(f"exclude must be a list of module names or patterns; got {exclude!r}")
    if problems:
        raise ValueError(f"Quark quantization_config not implemented: {'; '.join(problems)}")
    return QuarkMxfp4(config)


def scheme_problems(scheme: Mapping[str, Any]) -> list[str]:
    """Why a module's scheme (weight, input_tensors, output_tensors, bias) is not the MXFP4 one this engine
    implements (empty: it is)."""
    problems = []
    for field in ("output_tensors", "bias"):
        if scheme.get(field):
            problems.append(f"{field} quantized ({scheme[field]})")
    problems += [f"weight {p}" for p in _spec_problems(scheme.get("weight"), dynamic=False)]
    if scheme.get("input_tensors") is not None:
        problems += [f"input_tensors {p}" for p in _spec_problems(scheme["input_tensors"], dynamic=True)]
    return problems


def _spec_problems(spec: Any, *, dynamic: bool) -> list[str]:
    """Why a tensor spec is not OCP MXFP4 (static for weights, dynamic for activations)."""
    if not isinstance(spec, Mapping):
        return [f"{spec!r}: a list of specs (e.g. a two-level fp8 + fp4 scheme) is not OCP MXFP4"]
    want = {"dtype": "fp4", "qscheme": "per_group", "group_size": GROUP_SIZE, "scale_format": "e8m0"}
    problems = [f"{k} {spec.get(k)!r} (want {v!r})" for k, v in want.items() if spec.get(k) != v]
    if bool(spec.get("is_dynamic")) != dynamic:
        problems.append(f"is_dynamic {spec.get('is_dynamic')!r} (want {dynamic}: "
                        f"{'scales computed at run time' if dynamic else 'stored scales'})")
    if spec.get("ch_axis") not in (None, -1, 1):
        problems.append(f"ch_axis {spec.get('ch_axis')!r} (groups of 32 inputs: -1)")
    if spec.get("round_method") not in (None, "half_even"):
        problems.append(f"round_method {spec.get('round_method')!r} (half_even)")
    if dynamic and spec.get("scale_calculation_mode") not in SCALE_MODES:
        problems.append(f"scale_calculation_mode {spec.get('scale_calculation_mode')!r} (implemented: "
                        f"{list(SCALE_MODES)})")
    return problems


def _activations(scheme: Mapping[str, Any]) -> tuple[str, str | None]:
    """(activations, scale rule) of a valid MXFP4 scheme."""
    inputs = scheme.get("input_tensors")
    return ("model_dtype", None) if inputs is None else ("mxfp4", inputs.get("scale_calculation_mode"))


def _has_wildcard(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _matches_exclude(module: str, entry: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return fnmatch.fnmatchcase(module, entry) if _has_wildcard(entry) else module == entry


def _listing(names: list[str], most: int = 6) -> str:
    return f"{names[:most]}{f' and {len(names) - most} more' if len(names) > most else ''}"
