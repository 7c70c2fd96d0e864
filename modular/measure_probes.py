"""The probe steps `python -m planners calibrate` times and fits its rates on (modular/measure.py,
Note [calibrated prices] in planners/calibration.py)."""

from __future__ import annotations

from planners.calibration import DATA_PARALLEL, FAMILIES

__all__ = ["PLANNER_OPTIMIZER", "PROBES", "RATE_KEYS", "ROWS", "SPREAD", "SPREAD_QUICK", "probe_plan",
           "probes", "spread"]

SPREAD, SPREAD_QUICK = 24, 4  # seeded probes beyond the hand-picked ones (`spread`)
ROWS = 50_000  # rows of a probe's tables: larger than the caches (3 to 25 MiB)

# Probe steps: (family, kind, tables per rank, rows, dim, ids per bag, bags). The fixed part, the
# routing per id and what each further kind of shard adds are fitted on all of them, and how much
# each family's kernel rates (timed apart, modular/measure_kernels.py) grow inside a step on the
# family's own (a data-parallel copy's apart: `DATA_PARALLEL`). Hand-picked corners, then a seeded
# spread over what jobs run.
PROBES = (
    ("fused", "tw", 1, ROWS, 16, 4, 512), ("fused", "tw", 1, ROWS, 128, 16, 1024),
    ("fused", "rw", 2, ROWS, 64, 8, 1024), ("fused", "cw", 2, ROWS, 64, 4, 2048),
    ("fused", "rw", 1, ROWS, 32, 1, 4096), ("fused", "tw", 2, ROWS, 64, 32, 256),
    ("fused", "dp", 2, ROWS, 32, 8, 1024), ("fused", "tw", 1, ROWS, 32, 2, 64),
    ("fused", "dp", 4, 2 * ROWS, 64, 20, 1024), ("fused", "dp", 8, ROWS, 16, 10, 512),
    ("fused", "cw", 4, 2 * ROWS, 64, 20, 1024), ("fused", "cw", 8, ROWS, 32, 10, 512),
    ("emulated", "tw", 1, ROWS, 64, 8, 1024), ("emulated", "rw", 2, ROWS, 16, 16, 512),
    ("emulated", "tw", 1, ROWS, 128, 2, 2048), ("emulated", "rw", 1, ROWS, 128, 8, 512),
    ("emulated", "dp", 2, ROWS, 32, 8, 512),
    ("dense", "tw", 1, ROWS, 64, 8, 1024), ("dense", "tw", 1, 4 * ROWS, 64, 8, 1024),
    ("dense", "rw", 2, ROWS, 16, 16, 512), ("dense", "tw", 1, ROWS, 128, 2, 2048),
    ("dense", "dp", 2, ROWS, 32, 8, 512),
    # several kinds of shard on a rank (what each further kind adds: `kernel_fixed`)
    ("fused", "mix", 4, ROWS, 32, 8, 1024), ("fused", "rwdp", 4, ROWS, 32, 4, 512),
    ("emulated", "mix", 4, ROWS, 64, 4, 512), ("dense", "rwdp", 2, ROWS, 32, 4, 512),
    ("fused", "mix", 8, 2 * ROWS, 64, 10, 1024),
)  # fmt: skip


def spread(n: int, seed: int = 0) -> tuple:
    """`n` probes drawn (seeded, the same on every rank) over the kinds, families, widths,
    poolings and batches jobs run, each at most 100,000 ids per rank's
    tables before routing."""
    import random

    rng, out = random.Random(seed), []
    while len(out) < n:
        probe = (rng.choice(("fused", "fused", "emulated", "dense")),
                 rng.choice(("tw", "rw", "cw", "twrw", "dp", "mix", "rwdp")), rng.choice((1, 2, 4, 6)),
                 rng.choice((ROWS, 2 * ROWS, 4 * ROWS)), rng.choice((16, 32, 64, 128)),
                 rng.choice((1, 4, 10, 20)), rng.choice((256, 512, 1024, 2048)))  # fmt: skip
        if probe[2] * probe[5] * probe[6] <= 100_000:
            out.append(probe)
    return tuple(out)


RATE_KEYS = FAMILIES + tuple(DATA_PARALLEL.values())  # the rates calibrate fits
PLANNER_OPTIMIZER = {"fused": "rowwise_adagrad", "emulated": "adam", "dense": "unfused_sgd"}


def probe_plan(kind: str, tables: int, world: int) -> dict:
    """`tables` tables placed as `kind`: one kind for all, or "mix" (the first quarter column-wise,
    the rest table-wise) or "rwdp" (the first half data-parallel, the rest row-wise)."""
    from planners.types import ShardingType, TablePlacement

    every = tuple(range(world))
    full = {"tw": "table_wise", "rw": "row_wise", "cw": "column_wise", "twrw": "table_row_wise"}

    def one(k: str, i: int) -> TablePlacement:
        if k == "tw":
            return TablePlacement(ShardingType.TABLE_WISE, ranks=(i % world,))
        if k == "dp":
            return TablePlacement(ShardingType.DATA_PARALLEL)
        return TablePlacement(ShardingType.parse(full[k]), ranks=every)

    mixed = {"mix": lambda i: "cw" if i < max(1, tables // 4) else "tw",
             "rwdp": lambda i: "dp" if i < max(1, tables // 2) else "rw"}  # fmt: skip
    return {f"t{i}": one(mixed[kind](i) if kind in mixed else kind, i) for i in range(tables)}


def probes(quick: bool) -> tuple:
    """Every probe a calibration times: the hand-picked ones, then the spread."""
    return PROBES + spread(SPREAD_QUICK if quick else SPREAD)
