"""The device mesh and the partition specs of the decode step. Axis names are spelled only here."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dcp_jax.config import ParallelConfig

# The tp/W DCP groups; the KV cache is replicated over it, heads are split over it.
DCP_GROUP = "dcp_group"
# W consecutive TP ranks of one DCP group; KV tokens are split over it, heads too.
DCP = "dcp"
# Heads split over every TP rank: group-major, so one group's W ranks hold consecutive head blocks.
HEADS = (DCP_GROUP, DCP)

REPLICATED = P()
# [W, ...] arrays holding one entry per DCP rank (per-rank caches, local lengths, slot mappings).
PER_DCP_RANK = P(DCP)


def make_mesh(parallel: ParallelConfig, devices=None) -> Mesh:
    """A (tp/W, W) mesh over the first tp devices."""
    devices = jax.devices() if devices is None else list(devices)
    if len(devices) < parallel.tp:
        raise ValueError(
            f"tp={parallel.tp} needs {parallel.tp} devices, found {len(devices)} "
            "(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    grid = np.asarray(devices[: parallel.tp]).reshape(parallel.dcp_groups, parallel.dcp)
    return Mesh(grid, (DCP_GROUP, DCP), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def sharding(mesh: Mesh, spec: P) -> NamedSharding:
    return NamedSharding(mesh, spec)
