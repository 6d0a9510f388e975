"""DeepSeek's fine-grained fp8 GEMM alone (`pallas_kernels.fp8_gemm`: a linear layer of block-fp8 weights) at
DeepSeek-V3.2's linear shapes, against the same-run bf16 matmul of the same shape (XLA), XLA's per-tensor fp8 GEMM
of the same operands (cuBLAS on the GPU: the fp8 rate without block scaling), the engine's fp8 product without the
kernel (`fp8_linear.einsum` under the reference backend: activations through act_quant, weights dequantized, an f32
product, all in XLA) and the fp8 weights read once at the copy rate.

Operands: x e4m3 [M, K] with one f32 scale a row per 128 channels, w e4m3 [N, K] with one f32 scale per 128 x 128
block (random normal values before quantization); the activations' quantization (`act_quant`) is not timed. The
kernel's output is checked against `pallas_kernels.reference.fp8_gemm` (relative Frobenius error). Each timed call
rotates over weight copies of at least 256 MB so no call finds its weights in L2. On a GPU a time is the device time
of one call: the summed durations of its kernels in a profiler trace (the wrapper's small ops included, the host's
dispatch not: small products are dispatched slower than they run); elsewhere the wall time of back-to-back calls.

Usage (repository root):
  python bench/bench_fp8_gemm.py --shapes 256x256 --rows 4 --backends triton --copy-bytes 8M \
      --matmul-size 256                                              # CPU smoke
  python3 bench/bench_fp8_gemm.py --json-out $OUT/fp8_gemm.jsonl     # H200 / H100
  python bench/bench_fp8_gemm.py --plot docs/data/fp8_gemm/prefill_tile_order_h100.jsonl \
      docs/img/fp8_gemm_prefill_knobs_h100.png                      # a saved run drawn, no GPU needed
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pallas_kernels  # noqa: E402
from bench.common import (copy_tbps, device_seconds, matmul_tflops, median_seconds, pyplot,  # noqa: E402
                          run_info, save_figure, sizes, warm_up_clocks)
from dcp_jax.model import fp8_linear  # noqa: E402
from dcp_jax.model.memory_plan import FP8_BLOCK  # noqa: E402

# DeepSeek-V3.2's block-fp8 linear layers at TP 1, (N, K) = (out, in): the dense layers' gate_up (gate_proj and
# up_proj stacked along N as one GEMM; mlp_gate is one of them alone, as the model ran them before) and the shared
# experts' gate_up (docs/performance.md, "One GEMM for two projections: `wqkv_a` and `gate_up`").
SHAPES = {"wq_b": (24576, 1536), "wqkv_a": (2112, 7168), "wo": (7168, 16384), "mlp_gate_up": (36864, 7168),
          "mlp_gate": (18432, 7168), "mlp_down": (7168, 18432), "shared_gate_up": (4096, 7168)}
ROTATION_BYTES = 256 << 20
BLOCK = (FP8_BLOCK, FP8_BLOCK)  # DeepSeek-V3.2's weight_block_size


def _shape(name: str) -> tuple[int, int]:
    """A layer of SHAPES, or "NxK"."""
    if name in SHAPES:
        return SHAPES[name]
    width, _, depth = name.partition("x")
    if not (width.isdigit() and depth.isdigit()):
        raise ValueError(f"--shapes: {name!r} is neither one of {sorted(SHAPES)} nor NxK")
    return int(width), int(depth)


def _block_fp8_weight(key, width: int, depth: int) -> fp8_linear.Fp8BlockWeight:
    """A random normal weight in block fp8 (`fp8_linear.quantize`), our layout [K, N]: values e4m3 [N, K], scales
    by BLOCK."""
    return fp8_linear.quantize(jax.random.normal(key, (depth, width), jnp.float32), BLOCK, (-2,), (-1,))


@jax.jit
def _bf16_matmul(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)


@jax.jit
def _fp8_per_tensor(x, w, scale):
    out = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (out * scale).astype(jnp.bfloat16)


@jax.jit
def _engine_fp8_xla(x, weight):
    return fp8_linear.einsum("mk,kn->mn", x, weight, backend="reference")


def plot(jsonl: str, png: str) -> None:
    """Each timed backend's rate over the same-run bf16 XLA rate, per layer and M, of one run's JSON lines, as
    grouped bars against 1x and the issue's 1.4x prefill target (a PNG)."""
    with open(jsonl) as saved:
        lines = [json.loads(line) for line in saved]
    run = next(line for line in lines if line.get("kind") == "run")
    points = [line for line in lines if line.get("kind") == "point"]
    backends = sorted({b for p in points for b, r in p["backends"].items() if "us" in r},
                      key=lambda b: (b.count("+"), b))
    fig, ax = pyplot().subplots(figsize=(max(6.4, 0.9 * len(points) * max(1, len(backends)) / 3) + 3.2, 4.2))
    width = 0.8 / max(1, len(backends))
    for i, backend in enumerate(backends):
        ratios = [p["bf16_us"] / p["backends"][backend]["us"] if "us" in p["backends"].get(backend, {}) else 0.0
                  for p in points]
        implementation, _, label = backend.partition("+")
        knobs = json.loads(run["args"]["knobs"]).get(label, {})
        name = f"{implementation} " + (", ".join(f"{k}={v}" for k, v in knobs.items()) if knobs else "(defaults)")
        ax.bar([x + (i - (len(backends) - 1) / 2) * width for x in range(len(points))], ratios, width, label=name)
    ax.axhline(1.0, color="gray", linestyle=":", label="bf16 XLA (same run)")
    if any(p["rows"] >= 4096 for p in points):
        ax.axhline(1.4, color="C3", linestyle="--", label="target 1.4x (M >= 4096)")
    ax.set_xticks(range(len(points)), [f"{p['layer']}\nM={p['rows']}" for p in points], fontsize=8)
    ax.set(ylabel="rate / bf16 XLA rate", ylim=(0, None),
           title=f"block-fp8 GEMM, {run.get('device', '?')}, commit {run.get('commit', '?')}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcp-jax bench fp8_gemm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", nargs=2, metavar=("JSONL", "PNG"), default=None,
                        help="measure nothing: draw a saved run's rates over its bf16 rate")
    parser.add_argument("--rows", type=sizes, default=(64, 256, 4096, 16384), help="M values")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {sorted(SHAPES)}, or NxK")
    parser.add_argument("--backends", default="mosaic,triton",
                        help="fp8_gemm implementations timed; NAME+LABEL times NAME with the knobs --knobs gives LABEL")
    parser.add_argument("--knobs", default="{}", help='JSON: label -> knobs, e.g. {"k8": {"k_splits": 8}}')
    parser.add_argument("--calls", type=int, default=20, help="traced calls per timing (a GPU's device time)")
    parser.add_argument("--kernels-only", action="store_true",
                        help="time the bf16 product and the kernels, not XLA's per-tensor fp8 or the engine's XLA "
                             "path (null in the JSON; fewer compiles: a knob sweep)")
    parser.add_argument("--copy-bytes", type=lambda t: sizes(t)[0], default=2 << 30,
                        help="the copy ceiling's array (8M, 2G, ...)")
    parser.add_argument("--matmul-size", type=int, default=8192, help="n of the n x n x n bf16 matmul ceiling")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    if args.plot:
        plot(*args.plot)
        return 0
    knobs = json.loads(args.knobs)
    labels = {backend.partition("+")[2] for backend in args.backends.split(",")} - {""}
    if labels != set(knobs):
        parser.error(f"--backends labels {sorted(labels)} and --knobs labels {sorted(knobs)} differ")
    out = open(args.json_out, "w") if args.json_out else None

    def record(row):
        if out:
            out.write(json.dumps(row, default=str) + "\n")
            out.flush()

    def seconds(fn, arg_sets):
        return device_seconds(fn, arg_sets, args.calls)

    if jax.default_backend() == "gpu":
        warm_up_clocks()
    info = dict(run_info(), kind="run", args=vars(args))
    def wall_seconds(fn, arg_sets):  # the ceilings: large single ops, their dispatch negligible
        return median_seconds(fn, arg_sets, 5)

    tbps, tflops = copy_tbps(args.copy_bytes, wall_seconds), matmul_tflops(wall_seconds, n=args.matmul_size)
    record(info | dict(copy_tbps=tbps, matmul_tflops=tflops))
    print(f"{info['device']}, commit {info['commit']}; same-run copy {tbps:.2f} TB/s, bf16 matmul {args.matmul_size}^3 "
          f"{tflops:.0f} TFLOP/s", flush=True)
    print("| layer | M | N x K | bf16 XLA us (TFLOP/s) | fp8 per-tensor XLA us (TFLOP/s) | engine's fp8 XLA us | "
          "fp8 weights read us | backend | us | TFLOP/s | / bf16 rate | engine XLA / kernel | / weight read | "
          "rel. error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for name in args.shapes.split(","):
        width, depth = _shape(name)
        weight_bytes = width * depth + 4 * math.prod(-(-d // b) for d, b in zip((width, depth), BLOCK))
        copies = min(64, max(1, math.ceil(ROTATION_BYTES / weight_bytes)))
        weights = [_block_fp8_weight(jax.random.key(i), width, depth) for i in range(copies)]
        plain = [w.values.astype(jnp.bfloat16) for w in weights]
        read_us = 1e6 * weight_bytes / (tbps * 1e12)
        for rows in args.rows:
            x, x_scales = fp8_linear.act_quant(jax.random.normal(jax.random.key(rows), (rows, depth)), BLOCK[1])
            x_bf16 = x.astype(jnp.bfloat16)
            flops = 2 * rows * width * depth
            bf16_us = 1e6 * seconds(_bf16_matmul, [(x_bf16, w) for w in plain])
            fp8_us = engine_us = None
            if not args.kernels_only:
                fp8_us = 1e6 * seconds(_fp8_per_tensor, [(x, w.values, jnp.float32(1.0)) for w in weights])
                engine_us = 1e6 * seconds(_engine_fp8_xla, [(x_bf16, w) for w in weights])
            want = np.asarray(pallas_kernels.reference.fp8_gemm(x, x_scales, weights[0].values, weights[0].scales,
                                                                block=BLOCK, out_dtype=jnp.float32))
            row = dict(kind="point", layer=name, rows=rows, width=width, depth=depth, bf16_us=bf16_us,
                       fp8_per_tensor_us=fp8_us, engine_fp8_xla_us=engine_us, weight_read_us=read_us, backends={})
            shared = (f"| {name} | {rows} | {width} x {depth} | {bf16_us:.1f} ({flops / bf16_us / 1e6:.0f}) | "
                      f"{'-' if fp8_us is None else f'{fp8_us:.1f} ({flops / fp8_us / 1e6:.0f})'} | "
                      f"{'-' if engine_us is None else f'{engine_us:.1f}'} | {read_us:.1f} |")
            for backend in args.backends.split(","):
                implementation, _, label = backend.partition("+")
                run = jax.jit(lambda x, xs, w, ws, b=implementation, k=knobs.get(label, {}): pallas_kernels.fp8_gemm(
                    x, xs, w, ws, block=BLOCK, out_dtype=jnp.bfloat16, backend=b, **k))
                try:
                    got = np.asarray(run(x, x_scales, weights[0].values, weights[0].scales).astype(jnp.float32))
                    error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                    us = 1e6 * seconds(run, [(x, x_scales, w.values, w.scales) for w in weights])
                except Exception as failure:  # a lowering or a shape the backend lacks: record it, go on
                    row["backends"][backend] = dict(failed=f"{type(failure).__name__}: {str(failure)[:300]}")
                    print(f"{shared} {backend} | failed: {type(failure).__name__}: {str(failure)[:150]} |", flush=True)
                    continue
                row["backends"][backend] = dict(us=us, rel_error=error)
                print(f"{shared} {backend} | {us:.1f} | {flops / us / 1e6:.0f} | {bf16_us / us:.2f}x | "
                      f"{'-' if engine_us is None else f'{engine_us / us:.2f}x'} | {us / read_us:.2f}x | {error:.1e} |",
                      flush=True)
            record(row)
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
