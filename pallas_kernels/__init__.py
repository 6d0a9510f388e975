"""Pallas GPU kernels of sparse DCP decode (and the MoE's grouped matmul), behind one face.

Ops (`api.py`; each has a reference of the same signature in `reference.py`, and a `backend` argument: "pallas"
by default, "reference", "triton", "mosaic"):
- `indexer_logits`: lightning-indexer scores over a paged index-key cache;
- `topk`: exact per-row top-k of length-masked scores;
- `indexer_top_k`: the two, fused where the Mosaic indexer allows;
- `sparse_mla_decode`: absorbed sparse MLA over compacted physical slots, with the log-sum-exp of each row;
- `mla_decode`: absorbed dense MLA over a sequence's paged local tokens (one DCP rank's), with the log-sum-exp;
- `grouped_matmul`: rows sorted by group times their group's matrix (an MoE layer's routed experts),
  `grouped_matmul_fp8` of block-fp8 operands and `grouped_matmul_mxfp4` of MXFP4 weights (AMD Quark's);
- `fp8_gemm`: DeepSeek's fine-grained fp8 GEMM (a linear layer of block-fp8 weights).
`lse_merge_weights` (plain jnp) merges partial attention results by log-sum-exp. The formats (`formats.py`):
`Fp8IndexKeys` and `Fp8LatentCache`, passed to the ops in place of a plain cache, `Mxfp4Weight` in place of plain
expert weights, and their quantizers.
`unsupported` / `choose` / `IMPLEMENTATIONS` are the backend table. Modules named with a leading underscore are
the implementations. Importing the package fixes the Triton lowering's offsets for large fp8 arrays
(`_triton_offsets`).
"""

from pallas_kernels import formats, reference
from pallas_kernels._lse import lse_merge_weights
from pallas_kernels._triton_offsets import widen_one_byte_offsets
from pallas_kernels.api import (BACKENDS, IMPLEMENTATIONS, choose, fp8_gemm, grouped_matmul, grouped_matmul_fp8,
                                grouped_matmul_mxfp4, indexer_logits, indexer_top_k, mla_decode, sparse_mla_decode,
                                topk, unsupported)
from pallas_kernels.formats import Fp8IndexKeys, Fp8LatentCache, Mxfp4Weight

widen_one_byte_offsets()  # before any kernel is lowered

__all__ = ["BACKENDS", "IMPLEMENTATIONS", "Fp8IndexKeys", "Fp8LatentCache", "Mxfp4Weight", "choose", "formats",
           "fp8_gemm", "grouped_matmul", "grouped_matmul_fp8", "grouped_matmul_mxfp4", "indexer_logits",
           "indexer_top_k", "lse_merge_weights", "mla_decode", "reference", "sparse_mla_decode", "topk",
           "unsupported"]
