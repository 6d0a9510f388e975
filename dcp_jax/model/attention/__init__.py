"""One MLA + lightning-indexer attention layer: weights, projections, cache formats, the cross-rank exchange,
the sparse DCP decode layer, prefill, and the unsharded twin of decode."""
