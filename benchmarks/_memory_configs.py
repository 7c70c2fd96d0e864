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


def tables_of(name: str) -> list[planners.Table]:
    return [planners.Table(f"t{i}", rows, dim, features=(f"f{i}",), pooling_factor=POOLING,
                           dtype=dtype)
            for i, (rows, dim, dtype, _, _) in enumerate(CONFIGS[name][1])]  # fmt: skip


def plan_and_stats(name: str) -> tuple[planners.ShardingPlan, planners.PlanStats]:
    optimizer, specs = CONFIGS[name]
    tables = tables_of(name)
    cons = {t.name: planners.TableConstraint(sharding_types=(kind,), min_shards=k, max_shards=k)
            if kind != "data_parallel" else planners.TableConstraint(sharding_types=(kind,))
            for t, (_, _, _, kind, k) in zip(tables, specs)}  # fmt: skip
    topology = planners.Topology(WORLD, device_memory="1GiB")
    plan = planners.plan(tables, topology, batch_size=BATCH, optimizer=optimizer, constraints=cons)
    stats = planners.plan_stats(plan, tables, topology, batch_size=BATCH, optimizer=optimizer,
                                constraints=cons)  # fmt: skip
    return plan, stats
