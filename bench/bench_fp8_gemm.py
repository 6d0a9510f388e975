"""DeepSeek's fine-grained fp8 GEMM alone (`pallas_kernels.fp8_gemm`: a linear layer of block-fp8 weights) at
DeepSeek-V3.2's linear shapes, against the same-run bf16 matmul of the same shape (XLA), XLA's per-tensor fp8 GEMM
of the same operands (cuBLAS on the GPU: the fp8 rate without block scaling) and the fp8 weights read once at the
copy rate.

Operands: x e4m3 [M, K] with one f32 scale a row per 128 channels, w e4m3 [N, K] with one f32 scale per 128 x 128
block (random normal values before quantization); the activations' quantization (`act_quant`) is not timed. The
kernel's output is checked against `pallas_kernels.reference.fp8_gemm` (relative Frobenius error). Each timed call
rotates over weight copies of at least 256 MB so no call finds its weights in L2.

Usage (repository root):
  python bench/bench_fp8_gemm.py --shapes 256x256 --rows 4 --backends triton --runs 1 --copy-bytes 8M \
      --matmul-size 256                                              # CPU smoke
  python3 bench/bench_fp8_gemm.py --json-out $OUT/fp8_gemm.jsonl     # H200 / H100
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
from bench.common import copy_tbps, matmul_tflops, median_seconds, run_info, sizes, warm_up_clocks  # noqa: E402
from dcp_jax.model import fp8_linear  # noqa: E402
from dcp_jax.model.memory_plan import FP8_BLOCK  # noqa: E402

# DeepSeek-V3.2's block-fp8 linear layers at TP 1, (N, K) = (out, in).
SHAPES = {"wq_b": (24576, 1536), "wkv_a": (576, 7168), "wo": (7168, 16384), "mlp_gate": (18432, 7168),
          "mlp_down": (7168, 18432)}
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


def _block_fp8_weight(key, width: int, depth: int):
    """A random normal [N, K] weight in block fp8 (`fp8_linear.quantize`): e4m3 [N, K] and scales by BLOCK."""
    plain = jax.random.normal(key, (depth, width), jnp.float32)  # our layout, [K, N]
    weight = fp8_linear.quantize(plain, BLOCK, (-2,), (-1,))
    return weight.values, weight.scales


@jax.jit
def _bf16_matmul(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)


@jax.jit
def _fp8_per_tensor(x, w, scale):
    out = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (out * scale).astype(jnp.bfloat16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcp-jax bench fp8_gemm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=sizes, default=(64, 256, 4096, 16384), help="M values")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {sorted(SHAPES)}, or NxK")
    parser.add_argument("--backends", default="mosaic,triton",
                        help="fp8_gemm implementations timed; NAME+LABEL times NAME with the knobs --knobs gives LABEL")
    parser.add_argument("--knobs", default="{}", help='JSON: label -> knobs, e.g. {"k8": {"k_splits": 8}}')
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--copy-bytes", type=lambda t: sizes(t)[0], default=2 << 30,
                        help="the copy ceiling's array (8M, 2G, ...)")
    parser.add_argument("--matmul-size", type=int, default=8192, help="n of the n x n x n bf16 matmul ceiling")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
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
        return median_seconds(fn, arg_sets, args.runs)

    if jax.default_backend() == "gpu":
        warm_up_clocks()
    info = dict(run_info(), kind="run", args=vars(args))
    tbps, tflops = copy_tbps(args.copy_bytes, seconds), matmul_tflops(seconds, n=args.matmul_size)
    record(info | dict(copy_tbps=tbps, matmul_tflops=tflops))
    print(f"{info['device']}, commit {info['commit']}; same-run copy {tbps:.2f} TB/s, bf16 matmul {args.matmul_size}^3 "
          f"{tflops:.0f} TFLOP/s", flush=True)
    print("| layer | M | N x K | bf16 XLA us (TFLOP/s) | fp8 per-tensor XLA us (TFLOP/s) | fp8 weights read us | "
          "backend | us | TFLOP/s | / bf16 rate | / weight read | rel. error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for name in args.shapes.split(","):
        width, depth = _shape(name)
        weight_bytes = width * depth + 4 * math.prod(-(-d // b) for d, b in zip((width, depth), BLOCK))
        copies = min(64, max(1, math.ceil(ROTATION_BYTES / weight_bytes)))
        weights = [_block_fp8_weight(jax.random.key(i), width, depth) for i in range(copies)]
        plain = [w.astype(jnp.bfloat16) for w, _ in weights]
        read_us = 1e6 * weight_bytes / (tbps * 1e12)
        for rows in args.rows:
            x, x_scales = fp8_linear.act_quant(jax.random.normal(jax.random.key(rows), (rows, depth)), BLOCK[1])
            x_bf16 = x.astype(jnp.bfloat16)
            flops = 2 * rows * width * depth
            bf16_us = 1e6 * seconds(_bf16_matmul, [(x_bf16, w) for w in plain])
            fp8_us = 1e6 * seconds(_fp8_per_tensor, [(x, w, jnp.float32(1.0)) for w, _ in weights])
            want = np.asarray(pallas_kernels.reference.fp8_gemm(x, x_scales, *weights[0], block=BLOCK,
                                                                out_dtype=jnp.float32))
            row = dict(kind="point", layer=name, rows=rows, width=width, depth=depth, bf16_us=bf16_us,
                       fp8_per_tensor_us=fp8_us, weight_read_us=read_us, backends={})
            for backend in args.backends.split(","):
                implementation, _, label = backend.partition("+")
                run = jax.jit(lambda x, xs, w, ws, b=implementation, k=knobs.get(label, {}): pallas_kernels.fp8_gemm(
                    x, xs, w, ws, block=BLOCK, out_dtype=jnp.bfloat16, backend=b, **k))
                try:
                    got = np.asarray(run(x, x_scales, *weights[0]).astype(jnp.float32))
                    error = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                    us = 1e6 * seconds(run, [(x, x_scales, w, ws) for w, ws in weights])
                except Exception as failure:  # a lowering or a shape the backend lacks: record it, go on
                    row["backends"][backend] = dict(failed=f"{type(failure).__name__}: {str(failure)[:300]}")
                    print(f"| {name} | {rows} | {width} x {depth} | | | | {backend} | failed: "
                          f"{type(failure).__name__}: {str(failure)[:150]} |", flush=True)
                    continue
                row["backends"][backend] = dict(us=us, rel_error=error)
                print(f"| {name} | {rows} | {width} x {depth} | {bf16_us:.1f} ({flops / bf16_us / 1e6:.0f}) | "
                      f"{fp8_us:.1f} ({flops / fp8_us / 1e6:.0f}) | {read_us:.1f} | {backend} | {us:.1f} | "
                      f"{flops / us / 1e6:.0f} | {bf16_us / us:.2f}x | {us / read_us:.2f}x | {error:.1e} |",
                      flush=True)
            record(row)
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
