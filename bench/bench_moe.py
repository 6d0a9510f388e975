"""One MoE layer on one device: the grouped experts of `dcp_jax/model/moe.py` (each expert multiplies only the rows
routed to it: through the Pallas grouped matmul, `fp8_linear.grouped_matmul`, what the model runs with the
Pallas kernels, or through XLA's `jax.lax.ragged_dot`) against the dense reference (every expert on every row), at
decode batches and prefill lengths, beside same-run ceilings. `dcp-jax bench moe` runs this file.

The layer is the model's (`moe.route`, `moe.grouped_experts` or `moe.dense_experts`, the shared experts'
`mlp.gated_mlp`) at a preset's shapes (DeepSeek-V3.2: hidden 7168, 256 experts, 8 per token, width 2048, one
shared expert), random weights in `--dtype` (the router f32; `--weight-format fp8`: the routed experts in block fp8,
through `pallas_kernels.grouped_matmul_fp8`; `mxfp4`: in OCP MXFP4 as AMD Quark exports GLM-5.2's, [x, out, in / 2]
through `pallas_kernels.grouped_matmul_mxfp4`, which the computations other than `pallas` dequantize to `--dtype`
in the timed program), random rows, the whole layer on one device (tp 1).
Ceilings of the same run:
- decode, B rows: the activated weights read once, (the distinct experts the rows chose + the shared ones) x 3 D F
  weights (`WEIGHT_BYTES` a routed weight) and the f32 router, at the copy bandwidth (x -> x + 1 over
  `--copy-bytes`: `common.copy_tbps`);
- prefill, T tokens: the activated FLOPs, 2 T (3 D F (k + shared) + D X), at the bf16 matmul rate
  (`common.matmul_tflops`).
A ratio is a time over its ceiling (1.0 is the ceiling). `--experts` picks the computations timed (`EXPERTS`;
`--pallas-knobs` a JSON list of knob sets of the Pallas kernel, each timed as `pallas` + its knobs). The dense
reference runs up to `--dense-max-rows` rows:
its [R, X, D] per-expert outputs alone are R x 3.7 MB at DeepSeek's shapes in bf16 (15 GB at R = 4096); past it
the row says skipped.

Usage (repository root):
  python bench/bench_moe.py --preset tiny --decode 1,8 --prefill 64 --copy-bytes 8M --matmul-size 256 \
      --json-out /tmp/moe.jsonl                             # CPU smoke
  python3 bench/bench_moe.py --json-out $OUT/moe.jsonl      # H200: decode 1, 8, 64, 256; prefill 4K, 16K
  python3 bench/bench_moe.py --preset glm-5 --weight-format mxfp4 --json-out $OUT/moe_mxfp4.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from bench.common import copy_tbps, matmul_tflops, median_seconds, run_info, sizes
from dcp_jax.config import ModelConfig, preset
from dcp_jax.model import fp8_linear, moe
from dcp_jax.model.mlp import gated_mlp
from pallas_kernels.formats import Mxfp4Weight, dequantize_mxfp4, quantize_mxfp4


def grouped_matmul(x, w, group_sizes, *, backend: str, **knobs):
    """The model's Pallas grouped matmul (`fp8_linear.grouped_matmul`: plain or block-fp8 weights), and MXFP4 weights
    through `pallas_kernels.grouped_matmul_mxfp4`; the output in x's dtype. `knobs` go to the kernel."""
    if isinstance(w, Mxfp4Weight):
        return pallas_kernels.grouped_matmul_mxfp4(x, w, group_sizes, out_dtype=x.dtype, backend=backend, **knobs)
    return fp8_linear.grouped_matmul(x, w, group_sizes, backend=backend, **knobs)


EXPERTS = {"pallas": functools.partial(moe.grouped_experts, matmul=functools.partial(grouped_matmul, backend="pallas")),
           "ragged_dot": moe.grouped_experts, "dense": moe.dense_experts}
# Bytes a routed weight (None: --dtype's): block fp8's f32 scales are 1/16384 of its values, left out; MXFP4's
# e8m0 scales, one byte a 32, are counted.
WEIGHT_BYTES = {"plain": None, "fp8": 1, "mxfp4": 0.5 + 1 / 32}


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal(key, shape: tuple[int, ...], fan_in: int, dtype):
    """normal / sqrt(fan_in) in `dtype`, drawn inside one program: no f32 copy of an expert tensor is kept."""
    return (jax.random.normal(key, shape, jnp.float32) * fan_in**-0.5).astype(dtype)


def random_weights(cfg: ModelConfig, dtype, seed: int = 0) -> dict:
    """The layer's weights (`_normal`; the router and its bias f32, as the model keeps them)."""
    d, x, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    shared = f * cfg.n_shared_experts
    shapes = {"router": ((d, x), d, jnp.float32), "gate": ((x, d, f), d, dtype), "up": ((x, d, f), d, dtype),
              "down": ((x, f, d), f, dtype), "shared_gate_up": ((d, 2, shared), d, dtype),
              "shared_down": ((shared, d), shared, dtype)}
    keys = jax.random.split(jax.random.key(seed), len(shapes) + 1)
    weights = {name: _normal(key, shape, fan_in, kind)
               for key, (name, (shape, fan_in, kind)) in zip(keys, shapes.items())}
    weights["router_bias"] = 0.1 * jax.random.normal(keys[-1], (x,), jnp.float32)
    return weights


def on_dequantized(experts_fn, dtype):
    """`experts_fn` taking the MXFP4 expert weights dequantized to `dtype` [x, in, out] in its own program (what
    a computation without an MXFP4 kernel runs); plain and block-fp8 weights pass as they are."""

    def run(x, experts, combine, *weights, first_expert):
        plain = [jnp.swapaxes(dequantize_mxfp4(w.packed, w.scales, dtype), 1, 2) if isinstance(w, Mxfp4Weight)
                 else w for w in weights]
        return experts_fn(x, experts, combine, *plain, first_expert=first_expert)

    return run


def layer(experts_fn, cfg: ModelConfig):
    """The jitted layer: (weights, x [R, D]) -> routed + shared output [R, D] (the shared experts as the model runs
    them under the Pallas kernels; the shared weights are plain)."""

    @jax.jit
    def run(weights, x):
        experts, combine = moe.route(x, weights["router"], weights["router_bias"], cfg)
        routed = experts_fn(x, experts, combine, weights["gate"], weights["up"], weights["down"], first_expert=0)
        shared = gated_mlp(x, weights["shared_gate_up"], weights["shared_down"], backend="pallas")
        return routed + shared

    return run


def activated_weight_bytes(cfg: ModelConfig, distinct_experts: int, itemsize: float,
                           shared_itemsize: float | None = None) -> float:
    """Bytes a decode step must read: the chosen routed experts' gate, up and down (`itemsize` bytes a weight,
    `WEIGHT_BYTES`), the shared experts' (`shared_itemsize`, default the same) and the f32 router."""
    weights = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    shared = cfg.n_shared_experts * weights * (shared_itemsize or itemsize)
    return distinct_experts * weights * itemsize + shared + cfg.hidden_size * cfg.n_routed_experts * 4


def activated_flops(cfg: ModelConfig, tokens: int) -> float:
    """FLOPs of `tokens` rows (2 per multiply-add): the router and the k chosen and the shared experts of each."""
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    per_token = 3 * d * f * (cfg.num_experts_per_tok + cfg.n_shared_experts) + d * cfg.n_routed_experts
    return 2.0 * tokens * per_token


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcp-jax bench moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="deepseek-v3.2", help="the MoE shapes of this preset")
    parser.add_argument("--decode", type=sizes, default=(1, 8, 64, 256), help="decode batches B (rows)")
    parser.add_argument("--prefill", type=sizes, default=(4096, 16384), help="prefill lengths T (rows)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="expert weights, rows")
    parser.add_argument("--weight-format", choices=sorted(WEIGHT_BYTES), default="plain",
                        help="fp8: the routed experts in DeepSeek's block fp8 (blocks of 128), as its release; "
                             "mxfp4: in OCP MXFP4 (AMD Quark's layout, GLM-5.2-MXFP4)")
    parser.add_argument("--experts", default="pallas,dense", help=f"computations timed, of {sorted(EXPERTS)}")
    parser.add_argument("--pallas-knobs", default="[]",
                        help='JSON list of knob sets of the Pallas grouped matmul, each timed too: [{"block_m": 64}]')
    parser.add_argument("--dense-max-rows", type=int, default=4096,
                        help="the dense reference runs up to this many rows (skipped past it)")
    parser.add_argument("--runs", type=int, default=10, help="timed calls per point (median)")
    parser.add_argument("--copy-bytes", type=lambda t: sizes(t)[0], default=2 << 30,
                        help="buffer of the copy ceiling (4K, 8M, 2G)")
    parser.add_argument("--matmul-size", type=int, default=8192, help="n of the n x n x n bf16 matmul ceiling")
    parser.add_argument("--json-out", default=None, help="JSON lines: the run, its ceilings, one row per point")
    args = parser.parse_args(argv)
    cfg = preset(args.preset)
    dtype = jnp.dtype(args.dtype)
    out = open(args.json_out, "w") if args.json_out else None

    def record(row: dict) -> None:
        if out:
            out.write(json.dumps(row, default=str) + "\n")
            out.flush()

    def seconds(fn, arg_sets):
        return median_seconds(fn, arg_sets, args.runs)

    info = dict(run_info(), kind="run", args=vars(args))
    record(info)
    tbps, tflops = copy_tbps(args.copy_bytes, seconds), matmul_tflops(seconds, n=args.matmul_size)
    record(dict(kind="ceiling", copy_tbps=tbps, matmul_tflops=tflops))
    print(f"{info['device']}, commit {info['commit']}, {args.preset} MoE: hidden {cfg.hidden_size}, "
          f"{cfg.n_routed_experts} experts ({cfg.num_experts_per_tok} per row) of width "
          f"{cfg.moe_intermediate_size}, {cfg.n_shared_experts} shared, {args.dtype}; same-run copy {tbps:.2f} TB/s, "
          f"bf16 matmul {tflops:.0f} TFLOP/s", flush=True)
    weights = random_weights(cfg, dtype)
    if args.weight_format == "fp8":
        block = (min(128, cfg.moe_intermediate_size), min(128, cfg.hidden_size))
        for name in ("gate", "up", "down"):
            weights[name] = jax.jit(fp8_linear.quantize, static_argnums=(1, 2, 3))(weights[name], block, (-2,), (-1,))
    if args.weight_format == "mxfp4":  # [x, in, out] -> the checkpoint's [x, out, in], packed, an expert at a time
        quantize_experts = jax.jit(lambda w: jax.lax.map(lambda expert: quantize_mxfp4(expert.T), w))
        for name in ("gate", "up", "down"):
            weights[name] = Mxfp4Weight(*quantize_experts(weights[name]))
    unknown = set(args.experts.split(",")) - set(EXPERTS)
    if unknown:
        parser.error(f"--experts: unknown {sorted(unknown)}; choose from {sorted(EXPERTS)}")
    computations = {name: EXPERTS[name] if name == "pallas" else on_dequantized(EXPERTS[name], dtype)
                    for name in args.experts.split(",")}
    for knobs in json.loads(args.pallas_knobs):
        matmul = functools.partial(grouped_matmul, backend="triton", **knobs)
        computations[f"pallas {json.dumps(knobs)}"] = functools.partial(moe.grouped_experts, matmul=matmul)
    layers = {name: layer(fn, cfg) for name, fn in computations.items()}
    print("| phase | rows | experts chosen | ceiling | ceiling ms | computation | ms | / ceiling |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    points = [("decode", rows) for rows in args.decode] + [("prefill", rows) for rows in args.prefill]
    for phase, rows in points:
        x = jax.random.normal(jax.random.key(rows), (rows, cfg.hidden_size), jnp.float32).astype(dtype)
        chosen = moe.route(x, weights["router"], weights["router_bias"], cfg)[0]
        distinct = int(np.unique(np.asarray(chosen)).size)
        if phase == "decode":
            nbytes = activated_weight_bytes(cfg, distinct, WEIGHT_BYTES[args.weight_format] or dtype.itemsize,
                                            dtype.itemsize)
            ceiling_ms, ceiling = 1e3 * nbytes / (tbps * 1e12), f"{nbytes / 1e6:,.1f} MB read"
        else:
            flops = activated_flops(cfg, rows)
            ceiling_ms, ceiling = 1e3 * flops / (tflops * 1e12), f"{flops / 1e9:,.1f} GFLOP"
        times, notes = {}, {}
        for name, run in layers.items():
            if name == "dense" and rows > args.dense_max_rows:
                notes[name] = f"skipped (rows > --dense-max-rows {args.dense_max_rows})"
                continue
            try:
                times[name] = 1e3 * seconds(run, [(weights, x)])
            except Exception as error:  # an out-of-memory or a lowering the backend lacks: record it, go on
                notes[name] = f"failed: {type(error).__name__}: {str(error)[:200]}"
        record(dict(kind="point", phase=phase, rows=rows, distinct_experts=distinct, ceiling_ms=ceiling_ms,
                    **{f"{name}_ms": ms for name, ms in times.items()}, notes=notes))
        for name in layers:
            print(f"| {phase} | {rows} | {distinct} | {ceiling} | {ceiling_ms:.3f} | {name} | "
                  f"{_ms(times.get(name), notes.get(name))} | {_ratio(times.get(name), ceiling_ms)} |", flush=True)
    if out:
        out.close()
    return 0


def _ms(value: float | None, note: str | None) -> str:
    return f"{value:.3f}" if value is not None else note or "-"


def _ratio(numerator: float | None, denominator: float | None) -> str:
    return f"{numerator / denominator:.2f}" if numerator is not None and denominator else "-"


if __name__ == "__main__":
    sys.exit(main())
