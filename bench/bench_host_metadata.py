"""Host cost of one decode step's metadata: `build_step_metadata` (from Python lists or `BlockTable`s) and
`check_step_metadata`, per batch x context, on this machine's CPU (no accelerator needed).

Run from the repo root: `python bench/bench_host_metadata.py [--dcp 1] [--page-size 64] [--repeats 20]`.
Prints a markdown table of median milliseconds per call.
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import BATCHES, CONTEXT_LENGTHS, median_seconds
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.metadata import build_step_metadata, check_step_metadata
from dcp_jax.host.page_allocator import BlockTable


def median_ms(fn, repeats: int) -> float:
    """Median wall milliseconds of the host function fn() over `repeats` calls, after one untimed call."""
    return 1e3 * median_seconds(fn, [()], repeats, sync=None)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dcp", type=int, default=1)
    parser.add_argument("--interleave", type=int, default=1)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    layout = DcpLayout(dcp_size=args.dcp, interleave=args.interleave, page_size=args.page_size)
    max_blocks = int(layout.virtual_blocks(max(CONTEXT_LENGTHS)))
    print(f"dcp={args.dcp} interleave={args.interleave} page_size={args.page_size} max_blocks={max_blocks}")
    print("| B | L | build from lists ms | build from BlockTable ms | check ms |")
    print("|---|---|---|---|---|")
    for batch in BATCHES:
        for context in CONTEXT_LENGTHS:
            needed = int(layout.virtual_blocks(context))
            lists = [list(range(i * max_blocks, i * max_blocks + needed)) for i in range(batch)]
            tables = [BlockTable(pages) for pages in lists]
            lens = [context] * batch

            def build(block_tables):
                return build_step_metadata(lens, [1] * batch, block_tables, rows=batch, seqs=batch, layout=layout,
                                           max_blocks=max_blocks)

            md = build(tables)
            check = dict(buckets={batch: batch}, layout=layout, max_blocks=max_blocks, num_pages=batch * max_blocks)
            print(f"| {batch} | {context} | {median_ms(lambda: build(lists), args.repeats):.3f} | "
                  f"{median_ms(lambda: build(tables), args.repeats):.3f} | "
                  f"{median_ms(lambda: check_step_metadata(md, **check), args.repeats):.3f} |")


if __name__ == "__main__":
    main()
