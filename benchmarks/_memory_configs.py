"""The seeded memory configurations of issue 51, shared by tests/modular/test_memory_prices.py
(each rank's held bytes against `plan_stats`) and benchmarks/rss_growth.py (each rank's peak
RSS growth against the predicted total)."""

from __future__ import annotations

import torch
from torchrec.modules.embedding_configs import DataType

import planners

WORLD, BATCH, POOLING = 2, 64, 4
TORCH_OPTIMIZERS = {"unfused_sgd": lambda p: torch.optim.SGD(p, lr=0.1),
                    "unfused_adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
                    "unfused_adam": lambda p: torch.optim.Adam(p, lr=0.01)}  # fmt: skip
# (optimizer, [(rows, dim, dtype, sharding type, shards)]), each table its own feature.
CONFIGS = {
    "rowwise_tw_rw": ("rowwise_adagrad", [(4000, 32, "fp32", "table_wise", 1),
                                          (6000, 16, "fp32", "row_wise", 2)]),
    "sgd_dp": ("sgd", [(3000, 32, "fp32", "data_parallel", 1),
                       (2000, 16, "fp32", "table_wise", 1)]),
    "adam_dp_twrw": ("adam", [(3000, 32, "fp32", "data_parallel", 1),
                              (5000, 16, "fp32", "table_row_wise", 2)]),
    "rowwise_cw_mixed": ("rowwise_adagrad", [(4000, 64, "fp32", "column_wise", 2),
                                             (3000, 32, "fp32", "column_wise", 2)]),
    "adagrad_fp16": ("adagrad", [(5000, 32, "fp16", "row_wise", 2),
                                 (2000, 16, "fp16", "data_parallel", 1)]),
    "unfused_sgd": ("unfused_sgd", [(4000, 32, "fp32", "table_wise", 1),
                                    (3000, 16, "fp32", "data_parallel", 1)]),
    "unfused_adagrad_fp16": ("unfused_adagrad", [(5000, 32, "fp16", "row_wise", 2),
                                                 (2000, 32, "fp16", "column_wise", 2)]),
    "unfused_adam": ("unfused_adam", [(3000, 32, "fp32", "data_parallel", 1),
                                      (4000, 16, "fp32", "row_wise", 2)]),
}
DTYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16}


def plan_and_stats(name: str) -> tuple[planners.ShardingPlan, planners.PlanStats]:
    optimizer, specs = CONFIGS[name]
    return plan_specs(optimizer, specs, WORLD, BATCH, POOLING)


def plan_specs(optimizer: str, specs: list, world: int, batch: int, pooling: int, device_memory: str = "1GiB"
               ) -> tuple[planners.ShardingPlan, planners.PlanStats]:  # fmt: skip
    """The plan of tables `specs` ((rows, dim, dtype, sharding type, shards) each) and its stats."""
    tables = [planners.Table(f"t{i}", rows, dim, features=(f"f{i}",), pooling_factor=pooling, dtype=dtype)
              for i, (rows, dim, dtype, _, _) in enumerate(specs)]  # fmt: skip
    cons = {t.name: planners.TableConstraint(sharding_types=(kind,), min_shards=k, max_shards=k)
            if kind != "data_parallel" else planners.TableConstraint(sharding_types=(kind,))
            for t, (_, _, _, kind, k) in zip(tables, specs)}  # fmt: skip
    topology = planners.Topology(world, device_memory=device_memory)
    plan = planners.plan(tables, topology, batch_size=batch, optimizer=optimizer, constraints=cons)
    stats = planners.plan_stats(plan, tables, topology, batch_size=batch, optimizer=optimizer,
                                constraints=cons)  # fmt: skip
    return plan, stats


KINDS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")


def random_configs(seed: int, n: int, world: int) -> dict[str, tuple[str, list, int, int]]:
    """`n` seeded configurations for `world` ranks, as a hidden check might draw them: any
    optimizer (fused, emulated or a torch one), 1-4 tables of any sharding kind, FP32 or FP16,
    300-8,000 rows, widths 8-128; batch 16-256, pooling 1-8. name -> (optimizer, specs, batch,
    pooling)."""
    import random

    rng = random.Random(seed)
    out = {}
    for i in range(n):
        optimizer = rng.choice([o.value for o in planners.Optimizer])
        specs = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.choice(KINDS)
            dim = rng.choice([32, 64, 128] if kind == "column_wise" else [8, 16, 32, 64, 128])
            shards = {"row_wise": world, "table_row_wise": world, "column_wise": 2}.get(kind, 1)
            specs.append((rng.randint(300, 8000), dim, rng.choice(["fp32", "fp32", "fp16"]), kind, shards))
        out[f"seed{seed}_{i}"] = (optimizer, specs, rng.choice([16, 64, 256]), rng.choice([1, 4, 8]))
    return out
