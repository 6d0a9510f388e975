"""Host cost of one decode step's metadata: `build_decode_metadata` (from Python lists or `BlockTable`s, the
engine's) and `check_decode_metadata`, per batch x context, on this machine's CPU (no accelerator needed).

Run from the repo root: `python bench/bench_host_metadata.py [--dcp 1] [--page-size 64] [--repeats 20]`.
Prints a markdown table of median milliseconds per call.
"""

from __future__ import annotations

import argparse
import statistics
import time

from dcp_jax.layout import virtual_blocks
from dcp_jax.metadata import build_decode_metadata, check_decode_metadata
from dcp_jax.page_allocator import BlockTable

BATCHES = (1, 8, 32, 64)
CONTEXTS = (4096, 16384, 65536, 131072)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return 1e3 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dcp", type=int, default=1)
    parser.add_argument("--interleave", type=int, default=1)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    max_blocks = int(virtual_blocks(max(CONTEXTS), args.dcp, args.page_size))
    layout = dict(dcp=args.dcp, interleave=args.interleave, page_size=args.page_size, max_blocks=max_blocks)
    print(f"dcp={args.dcp} interleave={args.interleave} page_size={args.page_size} max_blocks={max_blocks}")
    print("| B | L | build from lists ms | build from BlockTable ms | check ms |")
    print("|---|---|---|---|---|")
    for batch in BATCHES:
        for context in CONTEXTS:
            needed = int(virtual_blocks(context, args.dcp, args.page_size))
            lists = [list(range(i * max_blocks, i * max_blocks + needed)) for i in range(batch)]
            tables = [BlockTable(pages) for pages in lists]
            lens = [context] * batch

            def build(block_tables):
                return build_decode_metadata(lens, block_tables, bucket=batch, **layout)

            md = build(tables)
            check = dict(buckets=(batch,), num_pages=batch * max_blocks, **layout)
            print(f"| {batch} | {context} | {median_ms(lambda: build(lists), args.repeats):.3f} | "
                  f"{median_ms(lambda: build(tables), args.repeats):.3f} | "
                  f"{median_ms(lambda: check_decode_metadata(md, **check), args.repeats):.3f} |")


if __name__ == "__main__":
    main()
