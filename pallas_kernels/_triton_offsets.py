"""A fix to JAX's Pallas-Triton lowering (jax 0.11.2): 64-bit load and store offsets for arrays of one-byte
elements past 2**31 of them.

The lowering (`_compute_offsets_from_indices`) counts a load's or store's offsets in elements but takes 64 bits
only when the whole array is over 2**32 *bytes*, and Triton sign-extends a 32-bit offset: in an fp8 array of 2 to
4 GiB, element e past 2**31 is read and written at e - 2**32, in the 2 GiB below the array's start. Such arrays
are ordinary here: an fp8 KV pool sized from part of a GPU's memory (every layer's pages are one array), the fp8
weights of 256 experts. Not reported upstream yet (no network here).
`widen_one_byte_offsets` makes the offsets 64-bit whenever an element offset can pass 2**31 - 1; for elements of
two bytes or more that is already the lowering's rule, which is left as it is. pallas_kernels installs it on
import, before any kernel is lowered.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax._src.pallas.triton import lowering as triton_lowering

# The largest element offset a signed 32-bit offset holds.
MAX_INT32_OFFSET = 2**31 - 1


def _needs_wider_offsets(aval) -> bool:
    return jnp.dtype(aval.dtype).itemsize == 1 and math.prod(aval.shape) - 1 > MAX_INT32_OFFSET


def widen_one_byte_offsets() -> None:
    """Wrap the lowering's offset computation (once): an array of one-byte elements whose last element offset
    exceeds MAX_INT32_OFFSET is lowered as if of two-byte elements, which the lowering gives 64-bit offsets past
    2**31 elements. Only the offsets' width reads that dtype."""
    lowering_offsets = triton_lowering._compute_offsets_from_indices
    if getattr(lowering_offsets, "widens_one_byte_offsets", False):
        return

    @functools.wraps(lowering_offsets)
    def compute_offsets(block_info, nd_indexer):
        aval = block_info.full_shape_dtype
        if _needs_wider_offsets(aval):
            block_info = dataclasses.replace(block_info, full_shape_dtype=aval.update(dtype=jnp.dtype(jnp.int16)))
        return lowering_offsets(block_info, nd_indexer)

    compute_offsets.widens_one_byte_offsets = True
    triton_lowering._compute_offsets_from_indices = compute_offsets
