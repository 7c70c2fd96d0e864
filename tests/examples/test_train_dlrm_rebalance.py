"""examples/train_dlrm.py --rebalance-every on 2 gloo ranks: a pooling factor that drifts mid-run
makes the run replan and reshard, the model then holds exactly the new plan's shards, and the
losses are those of the same run that never reshards (resharding moves tables, not math)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

import modular
import planners
from tests.dist import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(batch_size=64, eval_batches=1, progress=False)
# t_cat_3 (table-wise on rank 1 in the plan for 2 ranks) gets 20 ids per bag from step 3 on; the
# checks run after steps 3 (nothing drifted yet) and 6; steps 6 and 7 train on the new plan.
DRIFT = dict(steps=8, drift_feature="f_cat_3", drift_pooling=20, drift_at=3)


def _held(ebc) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Each table's shards on this rank, as (offsets, sizes), from the module's state_dict."""
    out = {}
    for key, value in ebc.state_dict().items():
        table = key.split(".")[-2]  # embedding_bags.<table>.weight
        if isinstance(value, ShardedTensor):
            out[table] = sorted((tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes))
                                for s in value.local_shards())  # fmt: skip
        elif isinstance(value, DTensor):
            raise AssertionError(f"{key}: the example's tables are ShardedTensors")
        else:
            out[table] = [((0, 0), tuple(value.shape))]
    return out


def _expected(plan: planners.ShardingPlan, configs) -> dict[str, list]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for c in configs:
        shards = plan.placement("sparse.ebc", c.name).shards(
            num_embeddings=c.num_embeddings, embedding_dim=c.embedding_dim, world_size=world
        )
        out[c.name] = sorted(((s.row_offset, s.col_offset), (s.num_rows, s.num_cols))
                             for s in shards if s.rank == rank)  # fmt: skip
    return out


def _runs(runs: list[dict]) -> list[tuple]:
    """Each config trained in turn, with `modular.reshard` watched: after every call the model's
    shards on this rank must be the new plan's."""
    from examples import train_dlrm

    configs = train_dlrm.table_configs()
    real, layouts = modular.reshard, []

    def watched(model, plan):
        out = real(model, plan)
        layouts.append(_held(model.sparse.ebc) == _expected(plan, configs))
        return out

    modular.reshard = watched  # examples/rebalance.py calls modular.reshard(...) by attribute
    out = []
    try:
        for kwargs in runs:
            layouts.clear()
            r = train_dlrm.train(train_dlrm.TrainConfig(**SMALL, **kwargs))
            checks = [(c.step, c.resharded, c.why, tuple(m.name for m in c.moves), c.moved_bytes,
                       dict(c.pooling)) for c in r.rebalances]  # fmt: skip
            out.append((r.losses, checks, r.plan, list(layouts)))
    finally:
        modular.reshard = real
    return out


def test_a_drifted_pooling_factor_reshards_and_training_goes_on_unchanged() -> None:
    runs = [dict(DRIFT, rebalance_every=3, rebalance_budget="1MiB"),  # a re-cut fits 1 MiB
            dict(DRIFT),  # the same batches, never rebalanced
            dict(DRIFT, steps=4, rebalance_every=3, drift_at=0, rebalance_threshold=0.9)]  # fmt: skip
    ranks = run_on_ranks(2, _runs, runs, timeout=240)
    (losses, checks, plan, layouts), (plain, no_checks, first_plan, _), (_, high, _, none) = ranks[0]
    assert ranks[1][0][:3] == ranks[0][0][:3]  # every rank: the same checks, losses and plan
    assert no_checks == [] and none == []
    # After step 3 nothing had drifted: the plan made for pooling factor 1 stays.
    (step3, moved3, why3, _, bytes3, pooling3), (step6, moved6, why6, tables6, bytes6, pooling6) = checks
    assert (step3, moved3, bytes3) == (3, False, 0) and why3.startswith("nothing moved"), why3
    assert pooling3["f_cat_3"] == 1.0
    # After step 6 t_cat_3 has 20 ids per bag: a plan within 1 MiB is priced faster; resharded.
    assert pooling6["f_cat_3"] == 20.0 and pooling6["f_cat_4"] == 1.0
    assert (step6, moved6) == (6, True) and 0 < bytes6 <= 2**20, why6
    assert "sparse.ebc.t_cat_3" in tables6
    assert plan != first_plan and layouts == [True]  # the model holds the new plan's shards
    # Resharding moves tables, not math: the losses before it are bit for bit the same, the two
    # after it equal up to the order of float sums on the new layout.
    assert losses[:7] == plain[:7]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain), atol=1e-5, rtol=1e-5)
    assert plain[-1] != plain[-2]  # trained at all
    # A gain below the threshold moves nothing, and says so.
    [(_, moved, why, tables, moved_bytes, _)] = high
    assert not moved and moved_bytes == 0 and tables and "not above the threshold of 90.0%" in why


def test_the_script_logs_what_moved(tmp_path: Path) -> None:
    command = [
        sys.executable, str(ROOT / "examples" / "train_dlrm.py"), "--world-size", "2",
        "--batch-size", "32", "--steps", "4", "--eval-batches", "1", "--no-progress",
        "--rebalance-every", "2", "--rebalance-budget", "1MiB", "--drift-feature", "f_cat_3",
        "--drift-pooling", "20",
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = done.stdout
    assert log.count("rebalance after step 2: pooling factors moved: f_cat_3 1.00 -> 20.00") == 1, log
    assert "resharded, moving" in log and "moved sparse.ebc.t_cat_3: table_wise on rank 1 -> " in log, log
    assert "per rank received / sent: " in log, log
