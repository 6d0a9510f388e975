"""How many CTA-wide reductions the two searches of the Triton top-k (`pallas_kernels/_topk_triton.py`) need, in
a numpy model (no GPU; numpy only, so it starts at once).

Run from the repo root: `python3 bench/model_topk_search.py [--rows 5]`. For rows of 64K columns (N(0, 1),
rounded to quarters, relu'd and log-normal) and k=2048, it finds the floor (the k-th largest of 4096 group
maxima, on a 16-bit lattice) and the threshold (the k-th largest candidate key) with three strategies, checks
each answer against a sort, and prints the mean reductions per row:
- bisect: one bit per step from the top (what the kernels run: 16 and 32 counts, then one count for the ties);
- bisect_min_max: bisection between the smallest and largest key (a min and a max, then a count per step);
- interpolate: the first INTERPOLATED_STEPS trial keys interpolated from the counts at the two ends of the
  interval, then bisection (alone, interpolation stalls: hundreds of steps); a min and a max to start, then
  a count per step;
- interpolate_snap: the trial key interpolated from the two counts around it, then snapped to the nearest key
  on each side (a min and a max to start, then a count, a min and a max per step).
"""

from __future__ import annotations

import argparse

import numpy as np

# k = DeepSeek-V3.2's index_topk (bench.common.TOP_K, not imported: that would load jax).
K, COLUMNS, GROUPS, COARSE_BITS = 2048, 65536, 4096, 16
INTERPOLATED_STEPS = 8


def unsigned_keys(x):
    """f32 -> uint64 in [0, 2**32) whose order is the f32 total order (the kernels' key, offset by 2**31)."""
    bits = x.view(np.int32).astype(np.int64)
    return np.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + 2**31


def bisect(keys, k, shift):
    """Largest lattice index i (keys >> shift) with count(keys >= i << shift) >= k, and the reductions spent."""
    index = 0
    for bit in reversed(range(32 - shift)):
        trial = index | 1 << bit
        if np.sum(keys >= trial << shift) >= k:
            index = trial
    return index, 32 - shift + (shift == 0)  # the exact search counts the ties once more


def bisect_min_max(keys, k, shift):
    low, high = int(keys.min()) >> shift, int(keys.max()) >> shift
    reductions = 2
    while low != high:
        trial = low + (high - low) // 2 + 1
        reductions += 1
        if np.sum(keys >= trial << shift) >= k:
            low = trial
        else:
            high = trial - 1
    return low, reductions + (shift == 0)


def interpolate(keys, k, shift):
    low, high = int(keys.min()) >> shift, int(keys.max()) >> shift
    count_low, count_above_high = len(keys), 0
    reductions = 2
    while low != high:
        if reductions - 2 < INTERPOLATED_STEPS:
            fraction = (count_low - k) / (count_low - count_above_high)
            trial = low + 1 + min(int(fraction * (high - low)), high - low - 1)
        else:
            trial = low + (high - low) // 2 + 1
        count = int(np.sum(keys >= trial << shift))
        reductions += 1
        if count >= k:
            low, count_low = trial, count
        else:
            high, count_above_high = trial - 1, count
    return low, reductions + (shift == 0)


def interpolate_snap(keys, k, shift):
    """The exact k-th largest key, snapped to keys, then rounded down to the lattice."""
    low, high = int(keys.min()), int(keys.max())
    count_low, count_above_high = len(keys), 0
    reductions = 2
    while low != high:
        fraction = (count_low - k) / (count_low - count_above_high)
        trial = low + 1 + min(int(fraction * (high - low)), high - low - 1)
        count = int(np.sum(keys >= trial))
        reductions += 3
        if count >= k:
            low, count_low = int(keys[keys >= trial].min()), count
        else:
            high, count_above_high = int(keys[keys < trial].max()), count
    return low >> shift, reductions


STRATEGIES = {"bisect": bisect, "bisect_min_max": bisect_min_max, "interpolate": interpolate,
              "interpolate_snap": interpolate_snap}
FILLS = {
    "normal": lambda rng: rng.standard_normal(COLUMNS),
    "quarters": lambda rng: np.round(rng.standard_normal(COLUMNS) * 4) / 4,
    "relu": lambda rng: np.maximum(rng.standard_normal(COLUMNS), 0),
    "lognormal": lambda rng: np.exp(3 * rng.standard_normal(COLUMNS)),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=5, help="random rows per fill")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("| fill | strategy | floor reductions | threshold reductions |")
    print("|---|---|---|---|")
    for fill, draw in FILLS.items():
        rows = [draw(rng).astype(np.float32) for _ in range(args.rows)]
        for name, search in STRATEGIES.items():
            floor_cost, threshold_cost = [], []
            for row in rows:
                keys = unsigned_keys(row)
                maxima = unsigned_keys(row.reshape(-1, GROUPS).max(axis=0))
                shift = 32 - COARSE_BITS
                floor, cost = search(maxima, K, shift)
                assert floor == np.sort(maxima)[-K] >> shift, (fill, name)
                floor_cost.append(cost)
                candidates = keys[keys >= floor << shift]
                threshold, cost = search(candidates, K, 0)
                assert threshold == np.sort(keys)[-K], (fill, name)
                threshold_cost.append(cost)
            print(f"| {fill} | {name} | {np.mean(floor_cost):.1f} | {np.mean(threshold_cost):.1f} |")


if __name__ == "__main__":
    main()
