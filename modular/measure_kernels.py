"""Each kernel family's rates, timed apart from the wire (Note [calibrated prices] in
planners/calibration.py): the shapes modular/measure.py times, and the fit.

Every rank builds the same one-rank model (a process group of its own) and times its step, all
ranks at once as a job's ranks share the machine's memory and caches: no collective in the
step, so no wait on a peer's wake-up blurs it. The shapes span what a shard meets (ids per
shard, widths, rows beyond the caches, poolings, several shards), and each family's
`KernelRate` is a robust least squares over them of each shape's error relative to its step.
"""

from __future__ import annotations

import math

from planners.calibration import FAMILIES, KernelRate

__all__ = ["KERNEL_SHAPES", "fit_kernel_rate", "kernel_features", "kernel_shapes", "nonnegative_lstsq",
           "robust_lstsq"]

# Hand-picked corners (tables, rows, dim, ids per table, bags per table): many tiny shards (what a
# call costs), pooling 1, a wide and a narrow table beyond the caches, a large batch.
KERNEL_SHAPES = (
    (8, 1_000, 16, 128, 64), (1, 50_000, 16, 2_048, 512), (1, 50_000, 128, 2_048, 512),
    (1, 200_000, 32, 16_384, 1_024), (1, 200_000, 128, 16_384, 1_024), (1, 50_000, 64, 32_768, 2_048),
    (4, 50_000, 32, 4_096, 4_096), (1, 200_000, 16, 65_536, 4_096),
)  # fmt: skip


def kernel_shapes(quick: bool, seed: int = 0) -> tuple:
    """The corners, then a seeded spread (the same on every rank, no shape twice) of at most
    200,000 ids."""
    import random

    rng, out = random.Random(seed), []
    while len(out) < (4 if quick else 20):
        tables, bags = rng.choice((1, 1, 2, 6)), rng.choice((256, 1024, 4096))
        shape = (tables, rng.choice((20_000, 50_000, 200_000)), rng.choice((16, 32, 64, 128)),
                 bags * rng.choice((1, 4, 16, 32)), bags)  # fmt: skip
        if tables * shape[3] <= 200_000 and shape not in out and shape not in KERNEL_SHAPES:
            out.append(shape)
    return KERNEL_SHAPES + tuple(out)


def kernel_features(tables: int, rows: int, dim: int, ids: int, bags: int, elem: int = 4) -> list[float]:
    """What each of `KernelRate.PARTS` multiplies for `tables` shards of `rows` x `dim`, each
    looking up `ids` uniform ids into `bags` bags (as `KernelRate.seconds` prices a shard)."""
    touched = rows * -math.expm1(-ids / rows)
    row = dim * elem
    return [tables * ids, tables * ids * row, tables * bags * dim, tables * rows * row,
            tables * touched * row, float(tables)]  # fmt: skip


def nonnegative_lstsq(a, y):
    """Least squares with every coefficient >= 0: refit without the columns that came out
    negative until none does (an active-set shortcut, enough for a few dozen columns)."""
    import numpy as np

    keep = np.ones(a.shape[1], dtype=bool)
    while True:
        coef = np.zeros(a.shape[1])
        coef[keep], *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (coef >= 0).all() or not keep.any():
            return coef
        keep &= coef > 0


def robust_lstsq(a, y, w, rounds: int = 6):
    """`nonnegative_lstsq` of w*a against w*y, made robust: a few rounds that weigh down the rows
    whose weighted error is beyond 1.5 robust standard deviations (Huber's weights), so that one
    step the machine slowed (a shared VM's steps vary 2x at times) does not move every rate."""
    import numpy as np

    h = np.ones(len(y))
    for _ in range(rounds):
        coef = nonnegative_lstsq(a * (w * h)[:, None], y * w * h)
        r = np.abs(a @ coef - y) * w
        scale = 1.4826 * float(np.median(r))
        if scale <= 0:
            break
        h = np.sqrt(np.minimum(1.0, 1.5 * scale / np.maximum(r, 1e-300)))
    return coef


def fit_kernel_rate(shapes: tuple, seconds: list[float]) -> KernelRate:
    """One family's rates from its steps on `shapes`: a least squares of each shape's error
    relative to its step. A step of a one-rank model costs something whatever its shards
    (Python, autograd): a column of its own, left out of the rates (the probe steps' fixed part
    holds it)."""
    import numpy as np

    a = np.array([kernel_features(*shape) + [1.0] for shape in shapes])
    y = np.array(seconds)
    coef = robust_lstsq(a, y, 1.0 / y)
    return KernelRate(*(float(c) for c in coef[:-1]))
