"""Does running decoder layers under `jax.lax.scan` over stacked weights cost device time on this GPU?

Each layer here is an MLP of DeepSeek-V3.2's dense width ([M, D] @ [D, F] -> silu -> @ [F, D], bf16) plus a paged
KV pool touched as decode does (scatter M new rows, gather 2048 rows per row, reduce). Compared: today's unrolled
loop over per-layer arrays, and a scan over stacked weights with the pools folded into one [layers * pages, ...]
buffer carried through the loop. Prints per-call times against the same-run weight read at the copy rate, and each
program's compile time. XLA flags (XLA_FLAGS) apply to the whole run: run once per flag set.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from bench.common import copy_tbps, throughput_seconds, warm_up_clocks

D, F, C, SELECTED = 7168, 18432, 576, 2048


def mlp(x, w_in, w_out):
    return jnp.dot(jax.nn.silu(jnp.dot(x, w_in)), w_out)


def attend(x, pool, slots, reads):
    """pool [pages*B, C]: write x's first C columns at slots [M], read `reads` [M, K] rows, reduce."""
    pool = pool.at[slots].set(x[:, :C])
    rows = pool[reads]  # [M, K, C]
    return x.at[:, :C].add(jnp.einsum("mkc,mc->mc", rows, x[:, :C])), pool


def unrolled(x, weights, pools, slots, reads):
    new_pools = []
    for (w_in, w_out), pool in zip(weights, pools):
        x, pool = attend(x, pool, slots, reads)
        x = x + mlp(x, w_in, w_out)
        new_pools.append(pool)
    return x, new_pools


def scanned(x, stacked_in, stacked_out, pool, slots, reads):
    tokens = pool.shape[0] // stacked_in.shape[0]

    def layer(carry, weights):
        x, pool, i = carry
        x, pool = attend(x, pool, slots + i * tokens, reads + i * tokens)
        return (x + mlp(x, *weights), pool, i + 1), None

    (x, pool, _), _ = jax.lax.scan(layer, (x, pool, 0), (stacked_in, stacked_out))
    return x, pool


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 1024])
    parser.add_argument("--pool-tokens", type=int, default=1 << 18)
    parser.add_argument("--label", default="default flags")
    parser.add_argument("--hlo-dir", help="write each compiled program's optimized HLO here")
    args = parser.parse_args()
    warm_up_clocks()
    copy = copy_tbps(1 << 30, lambda fn, a: throughput_seconds(fn, a))
    key = jax.random.key(0)
    layers, tokens = args.layers, args.pool_tokens
    w_in = jax.random.normal(key, (layers, D, F), jnp.bfloat16) * 0.01
    w_out = jax.random.normal(key, (layers, F, D), jnp.bfloat16) * 0.01
    per_layer = [(w_in[i] + 0, w_out[i] + 0) for i in range(layers)]
    pool = jnp.zeros((layers * tokens, C), jnp.bfloat16)
    pools = [jnp.zeros((tokens, C), jnp.bfloat16) for _ in range(layers)]
    weight_bytes = w_in.nbytes + w_out.nbytes
    results = []
    for m in args.rows:
        x = jax.random.normal(key, (m, D), jnp.bfloat16)
        slots = jnp.arange(m, dtype=jnp.int32) * 7
        reads = jax.random.randint(key, (m, SELECTED), 0, tokens, jnp.int32)
        for name, fn, fargs in (
                ("unrolled", jax.jit(unrolled, donate_argnums=2), lambda: (x, per_layer, pools, slots, reads)),
                ("scan", jax.jit(scanned, donate_argnums=3), lambda: (x, w_in, w_out, pool, slots, reads))):
            start = time.perf_counter()
            compiled = fn.lower(*fargs()).compile()
            compile_s = time.perf_counter() - start
            if args.hlo_dir:
                with open(f"{args.hlo_dir}/{args.label}_{name}_{m}.hlo", "w") as f:
                    f.write(compiled.as_text())
            state = {"pools": pools, "pool": pool}

            def call(_):
                if name == "unrolled":
                    out, state["pools"] = compiled(x, per_layer, state["pools"], slots, reads)
                else:
                    out, state["pool"] = compiled(x, w_in, w_out, state["pool"], slots, reads)
                return out

            seconds = throughput_seconds(call, [(0,)])
            pools, pool = state["pools"], state["pool"]
            results.append({"label": args.label, "program": name, "layers": layers, "rows": m,
                            "compile_s": round(compile_s, 2), "us": round(seconds * 1e6, 1),
                            "weight_read_us": round(weight_bytes / (copy * 1e12) * 1e6, 1),
                            "copy_tbps": round(copy, 2)})
            print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main()
