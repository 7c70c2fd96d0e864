"""A sharded model is visible in a profile and says what it built (issue 50).

Each rank body runs its calls under `torch.profiler.profile` and returns the `modular::` ranges it
recorded (name, start, end in us), so the test checks the labels of Note [profiler labels]
(modular/profiling.py) by their names in `modular.profiling`: one training step at world 2 for
each way a kernel updates (fbgemm's fused backward, the end of backward, the torch emulation,
a torch optimizer), a 2D step at world 4 (replica_sync), and `reshard` and `checkpoint.save` /
`load` in one profiled run. The "modular" logger's records are collected on each rank while
`shard` builds and while a step runs (which logs nothing).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from modular import profiling as P
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks

TW, RW, CW, DP = (ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE,
                  ShardingType.DATA_PARALLEL)  # fmt: skip
# name -> (rows, dim); widths fbgemm's fused kernels take (multiples of 4), FP32.
TABLES = {"t_tw": (40, 8), "t_rw": (30, 8), "t_cw": (20, 16), "t_dp": (10, 4)}

Range = tuple[str, float, float]  # a `modular::` range: name, start and end (us)


class _Holder(nn.Module):
    def __init__(self, tables: list[str], device: str = "cpu") -> None:
        super().__init__()
        torch.manual_seed(0)
        configs = [
            EmbeddingBagConfig(name=n, num_embeddings=TABLES[n][0], embedding_dim=TABLES[n][1],
                               feature_names=[f"f_{n}"])
            for n in tables
        ]  # fmt: skip
        self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device(device))


def _placements(tables: list[str], world: int) -> dict[str, TablePlacement]:
    kinds = {"t_tw": TW, "t_rw": RW, "t_cw": CW, "t_dp": DP}
    return {
        n: TablePlacement(kinds[n], ranks=(0,)) if kinds[n] is TW
        else TablePlacement(kinds[n]) if kinds[n] is DP
        else TablePlacement(kinds[n], ranks=tuple(range(world)))
        for n in tables
    }  # fmt: skip


def _batch(tables: list[str], seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (len(tables) * 3,), generator=g)  # 3 samples, no empty bag
    values = torch.cat([
        torch.randint(0, TABLES[n][0], (int(lengths[3 * i : 3 * i + 3].sum()),), generator=g)
        for i, n in enumerate(tables)
    ])  # fmt: skip
    return KeyedJaggedTensor(keys=[f"f_{n}" for n in tables], values=values, lengths=lengths)


def _build(
    tables: list[str], optimizer: Optional[str], *, mesh=None, sync: str = "exact", **fused: Any
) -> tuple[_Holder, Any]:
    """The holder's EBC sharded over the default group (or 2D over `mesh`, with `sync`), with its
    optimizer: `optimizer` fused with `fused`'s options, or SGD over the tables."""
    model = _Holder(tables)
    if optimizer is not None:
        opt = modular.fuse_optimizer(model, optimizer, lr=0.1, **fused)
    world = dist.get_world_size() if mesh is None else mesh["shard"].size()
    plan = ShardingPlan(world_size=world, modules={"ebc": _placements(tables, world)})
    modular.shard(model, plan, mesh=mesh, replica_sync=sync)
    if optimizer is None:
        opt = torch.optim.SGD(modular.local_parameters(model), lr=0.1)
    return model, opt


def _step(model: _Holder, opt: Any, tables: list[str]) -> None:
    opt.zero_grad()
    model.ebc(_batch(tables, seed=dist.get_rank())).values().sum().backward()
    opt.step()


def _ranges(prof) -> list[Range]:
    return sorted(
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.name.startswith("modular::")
    )


def _profiled(call) -> list[Range]:
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    return _ranges(prof)


# -- one training step at world 2 ---------------------------------------------------------------

# case -> (tables, fused optimizer or None for SGD, fuse_optimizer's options)
STEPS = {
    "fbgemm_fused": (["t_tw", "t_rw"], "exact_rowwise_adagrad", {}),  # updates inside backward
    "end_of_backward": (["t_cw", "t_dp"], "exact_rowwise_adagrad", {}),  # row statistics, replicas
    "emulated": (["t_tw", "t_rw"], "exact_rowwise_adagrad", {"weight_decay": 0.01}),
    "adam": (["t_tw", "t_cw"], "adam", {}),
    "torch_optimizer": (["t_tw", "t_rw", "t_dp"], None, {}),
}


def _profile_steps() -> dict[str, list[Range]]:
    out = {}
    for case, (tables, optimizer, fused) in STEPS.items():
        model, opt = _build(tables, optimizer, **fused)
        _step(model, opt, tables)  # first with no profiler on: no range opens
        out[case] = _profiled(lambda: _step(model, opt, tables))
    return out


def _names(ranges: list[Range]) -> list[str]:
    return [name for name, _, _ in ranges]


def _inside(inner: Range, outer: Range) -> bool:
    return outer[1] <= inner[1] and inner[2] <= outer[2]


@pytest.mark.timeout(200)
def test_a_training_step_shows_every_phase_by_name() -> None:
    for rank, by_case in enumerate(run_on_ranks(2, _profile_steps, timeout=180)):
        for case, ranges in by_case.items():
            names = _names(ranges)
            where = f"rank {rank}, {case}: {names}"
            # Once per forward of the one module, once per backward for the pooled gradients.
            for once in (P.INPUT_DIST, P.LOOKUP, P.OUTPUT_DIST, P.OUTPUT_DIST_BACKWARD):
                assert names.count(once) == 1, where
            assert names.count(P.LOOKUP_BACKWARD) >= 1, where
            assert P.REPLICA_SYNC not in names, where  # 1D
            if STEPS[case][1] is None:
                assert set(names) == set(P.STEP_LABELS) - {P.FUSED_UPDATE}, where
            else:
                assert set(names) == set(P.STEP_LABELS), where
            first = {n: min(r for r in ranges if r[0] == n) for n in set(names)}
            assert first[P.INPUT_DIST][2] <= first[P.LOOKUP][1], where
            assert first[P.LOOKUP][2] <= first[P.OUTPUT_DIST][1], where
            assert first[P.OUTPUT_DIST][2] <= first[P.OUTPUT_DIST_BACKWARD][1], where
            backwards = [r for r in ranges if r[0] == P.LOOKUP_BACKWARD]
            updates = [r for r in ranges if r[0] == P.FUSED_UPDATE]
            if case == "fbgemm_fused":  # the update is fbgemm's backward: one inside each
                assert len(updates) == len(backwards), where
                assert all(any(_inside(u, b) for b in backwards) for u in updates), where
                assert first[P.OUTPUT_DIST_BACKWARD][2] <= min(b[1] for b in backwards), where
            elif STEPS[case][1] is not None:  # one update, once every kernel's backward is done
                assert len(updates) == 1, where
                assert max(b[2] for b in backwards) <= updates[0][1], where


# -- 2D: the replica axis ---------------------------------------------------------------------

# case -> (tables, fused optimizer or None, options); every table has a copy in each replica group
STEPS_2D = {
    "deferred": (["t_tw", "t_rw"], "exact_rowwise_adagrad", {}),  # gathers batches, then replays
    "emulated": (["t_tw", "t_rw"], "exact_rowwise_adagrad", {"weight_decay": 0.01}),  # gradients
    "dense": (["t_tw", "t_rw"], None, {}),  # gathers inside each kernel's backward
    "periodic": (["t_tw", "t_rw"], "exact_rowwise_adagrad", {"sync": "periodic"}),
}


def _profile_2d() -> dict[str, tuple[list[Range], list[Range]]]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    for case, (tables, optimizer, options) in STEPS_2D.items():
        model, opt = _build(tables, optimizer, mesh=mesh, **options)
        step = _profiled(lambda: _step(model, opt, tables))
        out[case] = (step, _profiled(lambda: modular.sync_replicas(model)))
    return out


@pytest.mark.timeout(300)
def test_a_2d_step_shows_its_replica_sync() -> None:
    for rank, by_case in enumerate(run_on_ranks(4, _profile_2d, timeout=280)):
        for case, (step, sync) in by_case.items():
            where = f"rank {rank}, {case}: step {_names(step)}, sync_replicas {_names(sync)}"
            assert _names(sync) == [P.REPLICA_SYNC], where
            syncs = [r for r in step if r[0] == P.REPLICA_SYNC]
            if case == "periodic":  # nothing crosses replica groups within a step
                assert not syncs, where
                continue
            assert syncs, where
            # Where the gathers run: in the update at the end of backward, or in the kernel's own
            # backward (a dense kernel replays the gathered batch there).
            within = P.LOOKUP_BACKWARD if case == "dense" else P.FUSED_UPDATE
            outer = [r for r in step if r[0] == within]
            assert all(any(_inside(s, o) for o in outer) for s in syncs), where


# -- reshard and checkpoints ------------------------------------------------------------------


def _profile_calls(path: str) -> list[Range]:
    tables = ["t_tw", "t_rw"]
    model, opt = _build(tables, "exact_rowwise_adagrad")
    _step(model, opt, tables)
    moved = ShardingPlan(world_size=2, modules={"ebc": {
        "t_tw": TablePlacement(TW, ranks=(1,)), "t_rw": TablePlacement(RW, ranks=(1, 0)),
    }})  # fmt: skip

    def calls() -> None:
        modular.reshard(model, moved)
        modular.checkpoint.save(path, model)
        modular.checkpoint.load(path, model)

    return _profiled(calls)


@pytest.mark.timeout(120)
def test_reshard_and_checkpoints_show_by_name(tmp_path: Path) -> None:
    every = run_on_ranks(2, _profile_calls, str(tmp_path / "ckpt"), timeout=100)
    for rank, ranges in enumerate(every):
        names = _names(ranges)
        calls = [P.RESHARD, P.CHECKPOINT_SAVE, P.CHECKPOINT_LOAD]
        assert sorted(names) == sorted(calls), f"rank {rank}: {names}"
        in_order = sorted(ranges, key=lambda r: r[1])
        assert _names(in_order) == calls, f"rank {rank}: {in_order}"
        assert all(a[2] <= b[1] for a, b in zip(in_order, in_order[1:])), f"rank {rank}: {in_order}"


# -- the "modular" logger ---------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.got: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.got.append((record.name, record.levelno, record.getMessage()))


def _logged_build_and_step() -> tuple[list, list]:
    """The "modular" logger's records while `shard` builds (the tables on meta: `fuse_optimizer`
    only marks them) and while a step runs."""
    tables = list(TABLES)
    logger = logging.getLogger("modular")
    records, level = _Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    try:
        model = _Holder(tables, device="meta")
        opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1)
        plan = ShardingPlan(world_size=2, modules={"ebc": _placements(tables, 2)})
        modular.shard(model, plan)
        built = list(records.got)
        _step(model, opt, tables)
        return built, records.got[len(built):]
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)


def _bytes(rows: int, cols: int) -> int:
    return rows * cols * 4  # FP32


# Per rank: each table's shard (rows, cols) there. t_tw whole on rank 0, t_rw 15 rows each,
# t_cw 8 of its 16 columns each, t_dp a replica on each.
HELD = [
    {"t_tw": (40, 8), "t_rw": (15, 8), "t_cw": (20, 8), "t_dp": (10, 4)},
    {"t_rw": (15, 8), "t_cw": (20, 8), "t_dp": (10, 4)},
]
KINDS = {"t_tw": "table_wise", "t_rw": "row_wise", "t_cw": "column_wise", "t_dp": "data_parallel"}


@pytest.mark.timeout(120)
def test_shard_logs_what_it_built_at_info_and_each_kernel_choice_at_debug() -> None:
    for rank, (built, during_step) in enumerate(run_on_ranks(2, _logged_build_and_step, timeout=100)):
        mine = f"module 'ebc' on rank {rank} of 2"
        assert not during_step, f"rank {rank}: a step logged {during_step}"
        assert all(name.startswith("modular.") for name, _, _ in built), built
        infos = [m for _, level, m in built if level == logging.INFO]
        assert len(infos) == 1, f"rank {rank}: {built}"
        info, held = infos[0], HELD[rank]
        assert mine in info, info
        for table, (rows, cols) in held.items():
            assert f"{table} ({KINDS[table]}, {_bytes(rows, cols):,} bytes)" in info, info
        assert ("t_tw" in info) == (rank == 0), info
        weights = sum(_bytes(rows, cols) for rows, cols in held.values())
        state = sum(4 * rows for rows, _ in held.values())  # row-wise Adagrad: a float per row
        held_bytes = f"{weights:,} bytes of shards and {state:,} bytes of fused exact_rowwise_adagrad state"
        assert held_bytes in info, info
        # Kernels: t_tw and t_rw in fbgemm's fused kernel, t_cw's piece with the whole row's
        # statistic (Note [row statistics across column shards]), t_dp a fused replica.
        remote = "t_tw, t_rw#0" if rank == 0 else "t_rw#1"
        kernels = [
            f"FusedKernel [{remote}]", f"RowStatsFusedKernel [t_cw#{rank}]", "GatheredFusedKernel [t_dp]"
        ]  # fmt: skip
        assert f"kernels: {', '.join(kernels)}" in info, info
        debugs = [m for _, level, m in built if level == logging.DEBUG]
        assert debugs == [
            f"{mine}: kernel group [{remote}] (SUM, torch.float32) -> FusedKernel (fbgemm: "
            "exact_rowwise_adagrad: fbgemm's fused kernel)",
            f"{mine}: kernel group [t_cw#{rank}] (SUM, torch.float32) -> RowStatsFusedKernel "
            "(row_statistics: column pieces under exact_rowwise_adagrad: fbgemm's update in two "
            "passes with the whole row's statistic exchanged between them)",
            f"{mine}: kernel group [t_dp] (SUM, torch.float32, data-parallel) -> GatheredFusedKernel "
            "(replayed: data-parallel copies: fbgemm's backward replayed over every rank's batch)",
        ], debugs
