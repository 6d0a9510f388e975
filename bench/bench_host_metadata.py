"""Host cost of one decode step's metadata, per batch x context, on this machine's CPU (no accelerator needed):
`build_step_metadata` from Python lists or from the scheduler's one array, `check_step_metadata`, and the whole
decode step as the runner makes it: built, checked and packed (`build_step`, `_Packing.pack`, a step with prefill
chunks) against written into a copy of the bucket's packed step of pads and checked (`fill_decode_rows`, what
`StepProgram.pack_filled` runs for a step of decode rows only).

Run from the repo root: `python bench/bench_host_metadata.py [--dcp 1] [--page-size 64] [--repeats 20]`.
Prints a markdown table of median milliseconds per call.
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from bench.common import BATCHES, CONTEXT_LENGTHS, median_seconds
from dcp_jax.host.layout import DcpLayout
from dcp_jax.host.sampling import SamplingParams
from dcp_jax.host.sampling_metadata import SamplingTable
from dcp_jax.host.step_metadata import build_step_metadata, check_step_metadata
from dcp_jax.host.step_plan import ScheduledRows, build_step, fill_decode_rows
from dcp_jax.runtime.step import _Packing


def median_ms(fn, repeats: int) -> float:
    """Median wall milliseconds of the host function fn() over `repeats` calls, after one untimed call."""
    return 1e3 * median_seconds(fn, [()], repeats, sync=None)


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dcp", type=int, default=1)
    parser.add_argument("--interleave", type=int, default=1)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    layout = DcpLayout(dcp_size=args.dcp, interleave=args.interleave, page_size=args.page_size)
    max_blocks = int(layout.virtual_blocks(max(CONTEXT_LENGTHS)))
    print(f"dcp={args.dcp} interleave={args.interleave} page_size={args.page_size} max_blocks={max_blocks}")
    print("| B | L | build from lists ms | build from one array ms | check ms | step built, checked, packed ms | "
          "step written, checked ms |")
    print("|---|---|---|---|---|---|---|")
    for batch in BATCHES:
        table = SamplingTable(batch + 1, scratch_slot=batch, eos_token_id=1)
        for slot in range(batch):
            table.set(slot, SamplingParams(temperature=0.8, top_p=0.9), slot, 1)
        for context in CONTEXT_LENGTHS:
            needed = int(layout.virtual_blocks(context))
            lists = [list(range(i * max_blocks, i * max_blocks + needed)) for i in range(batch)]
            array = np.full((batch, max_blocks), -1, np.int32)
            for row, pages in enumerate(lists):
                array[row, :needed] = pages
            lens = [context] * batch
            check = dict(buckets={batch: batch}, layout=layout, max_blocks=max_blocks, num_pages=batch * max_blocks)
            step = dict(bucket=batch, seqs=batch, layout=layout, max_blocks=max_blocks, table=table)

            def build(block_tables):
                return build_step_metadata(lens, [1] * batch, block_tables, rows=batch, seqs=batch, layout=layout,
                                           max_blocks=max_blocks)

            rows = ScheduledRows.decode(list(range(batch)), lens, array)
            empty = build_step(ScheduledRows.decode([], [], array[:0]), **step)
            packing = _Packing.of(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), empty))
            template = packing.pack(empty)

            def built():
                inputs, md = build_step(rows, **step)
                check_step_metadata(md, **check)
                return packing.pack((inputs, md))

            def written():
                packed = template.copy()
                inputs, md = packing.views(packed)
                fill_decode_rows(inputs, md, rows, layout=layout, table=table)
                check_step_metadata(md, **check)
                return packed

            np.testing.assert_array_equal(built(), written())
            md = build(array)
            print(f"| {batch} | {context} | {median_ms(lambda: build(lists), args.repeats):.3f} | "
                  f"{median_ms(lambda: build(array), args.repeats):.3f} | "
                  f"{median_ms(lambda: check_step_metadata(md, **check), args.repeats):.3f} | "
                  f"{median_ms(built, args.repeats):.3f} | {median_ms(written, args.repeats):.3f} |")


if __name__ == "__main__":
    main()
