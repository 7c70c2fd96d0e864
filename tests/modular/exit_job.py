"""A user's own rank script, ended the way PyTorch's docs end one: destroy_process_group, return.

    python tests/modular/exit_job.py [SHAPE]    # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set

Run by tests/modular/test_exit.py and scripts/exit_stress.py as a plain process per rank, with
torchrun's environment variables, as a user would start their own script. It trains `STEPS`
steps of one job shape (`SHAPES`, default "fsdp"), printing each step's loss, and returns; every
shape has its tables sharded by `modular.shard` on a plan with row-, table- and column-wise
tables and data-parallel copies:
  fsdp     fused row-wise Adagrad (exact column-wise statistic, fused data-parallel copies), towers under
           FSDP2, every next batch prefetched (`modular.prefetch`: a second gloo group);
  ddp      unfused tables (Adagrad from `local_parameters`), DTensor tables, dense part under
           DDP (`apply_ddp`), prefetched;
  compile  fused row-wise Adagrad, FSDP2 towers compiled (`apply_compile`, inductor);
  ec       an EmbeddingCollection and an EBC (examples/sequential), fused, FSDP2 tower,
           both collections prefetched;
  plain    fused row-wise Adagrad, the dense parts unwrapped, no prefetch: the job of issue 40,
           whose last collectives are the fused update's at the end of the last backward;
  raise    plain's job, in which rank 1 raises after its first backward: rank 1 must exit 1
           with its traceback, rank 0 with `CollectiveError` (exit 1), neither with a signal.

Its only instrumentation is an atexit probe registered before `import modular`, so it runs after
modular's hook (atexit runs hooks last-registered first) and just before the interpreter
finalizes: it prints which threads of torch's process groups are still alive then
(Note [exit after destroy_process_group] in modular/exit.py). `MODULAR_TEST_NO_EXIT_HOOK=1` takes
modular's hook out, to measure a run as it was without it.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

PROCESS_GROUP_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")


def _threads_left() -> None:
    names = [(Path("/proc/self/task") / t / "comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    left = sorted(n for n in names if n in PROCESS_GROUP_THREADS)
    print(f"process group threads at exit: {left}", flush=True)


atexit.register(_threads_left)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import modular  # noqa: E402
from examples.dlrm import DLRM, SyntheticCriteo, criteo_table_configs  # noqa: E402
from examples.sequential.model import SequentialRecommender, Tower, make_batch  # noqa: E402
from planners.types import ShardingPlan, ShardingType, TablePlacement  # noqa: E402

if os.environ.get("MODULAR_TEST_NO_EXIT_HOOK") == "1":
    atexit.unregister(modular.exit.release_process_groups)

STEPS = 3
KINDS = (ShardingType.ROW_WISE, ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.DATA_PARALLEL)


def _placement(kind: ShardingType, i: int, world: int) -> TablePlacement:
    if kind is ShardingType.DATA_PARALLEL:
        return TablePlacement(kind)
    if kind is ShardingType.TABLE_WISE:
        return TablePlacement(kind, ranks=(i % world,))
    return TablePlacement(kind, ranks=tuple(range(world)))


def _dlrm_job(shape: str, rank: int, world: int) -> None:
    tables = criteo_table_configs(scale_rows_to=100, dim=8, cardinalities=[100] * 8)
    plan = ShardingPlan(world_size=world, modules={"sparse.ebc": {
        t.name: _placement(KINDS[i % len(KINDS)], i, world) for i, t in enumerate(tables)
    }})  # fmt: skip
    torch.manual_seed(0)
    model = DLRM(tables, bottom_mlp=[16, 8], top_mlp=[16], device="meta")
    fused = shape != "ddp"
    tables_opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1) if fused else None
    model = modular.shard(model, plan, tensor_type="dtensor" if shape == "ddp" else "sharded_tensor")
    towers = lambda m: m is model.dense or m is model.over  # noqa: E731
    if shape == "ddp":
        call = modular.apply_ddp(model)
        opts = {"all": torch.optim.Adagrad(modular.local_parameters(model), lr=0.1)}
    elif shape in ("plain", "raise"):  # dense parts unwrapped: each rank trains its own copy
        call = model
        opts = {"tables": tables_opt, "dense": torch.optim.Adam(modular.local_parameters(model), lr=1e-3)}
    else:
        call = model = modular.apply_fully_shard(model, modules=towers)
        if shape == "compile":
            model = modular.apply_compile(model, modules=towers)
        opts = {"tables": tables_opt, "dense": torch.optim.Adam(modular.local_parameters(model), lr=1e-3)}
    opt = modular.CombinedOptimizer(opts)
    data = SyntheticCriteo([t.num_embeddings for t in tables], batch_size=16, seed=0, rank=rank, world_size=world)
    batches = [data.batch_at(step) for step in range(STEPS)]
    for step, batch in enumerate(batches):
        if shape not in ("compile", "plain") and step + 1 < STEPS:
            modular.prefetch(model, batches[step + 1].sparse)
        loss = F.binary_cross_entropy_with_logits(call(batch.dense, batch.sparse), batch.labels)
        opt.zero_grad()
        loss.backward()
        if shape == "raise" and rank == 1:
            raise RuntimeError("rank 1 fails on purpose after its first backward (exit_job.py 'raise')")
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)


def _ec_job(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = SequentialRecommender(device=torch.device("meta"))
    plan = ShardingPlan(world_size=world, modules={
        "seq": {"item": _placement(ShardingType.ROW_WISE, 0, world),
                "category": _placement(ShardingType.COLUMN_WISE, 0, world)},
        "user": {"user": _placement(ShardingType.DATA_PARALLEL, 0, world)},
    })  # fmt: skip
    tables_opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1)
    modular.shard(model, plan)
    modular.apply_fully_shard(model, modules={Tower})
    dense_opt = torch.optim.Adam(modular.local_parameters(model), lr=1e-3)
    opt = modular.CombinedOptimizer({"tables": tables_opt, "dense": dense_opt})
    batches = [make_batch(step, rank, batch_size=8) for step in range(STEPS)]
    for step, batch in enumerate(batches):
        if step + 1 < STEPS:
            modular.prefetch(model, batches[step + 1].sequences, modules=["seq"])
            modular.prefetch(model, batches[step + 1].users, modules=["user"])
        loss = model.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)


SHAPES = ("fsdp", "ddp", "compile", "ec", "plain", "raise")


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "fsdp"
    if shape not in SHAPES:
        raise SystemExit(f"exit_job.py: unknown shape {shape!r}; the shapes are {', '.join(SHAPES)}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if shape == "ec":
        _ec_job(rank, world)
    else:
        _dlrm_job(shape, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
