"""Host side of the engine, numpy only (no jax: a test imports each module in a fresh interpreter): the DCP layout,
the per-step metadata and its builders, the page allocator, the scheduler and the sampling parameters."""
