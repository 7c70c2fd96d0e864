"""What a checkpoint of a split collision table costs each rank: the table split (each rank saves
and loads its range, Note [a collision table in a checkpoint]) against the whole table gathered
on every rank (how it was saved before 2026-11-28), side by side.

    python benchmarks/mc_checkpoint.py                      # zch_size 8M, 2 gloo ranks
    python benchmarks/mc_checkpoint.py --zch-size 1000000 --world-size 3

One MC-EBC table of `--zch-size` slots (dim 4: the collision state dominates) whose every usable
slot holds a raw id, row-wise over the ranks. Each rank, for each contender: the wall time of
`modular.checkpoint.save` and of `load` into a fresh model (which must then hold the same
state), and the peak resident memory above what it held before the call (VmHWM, reset by
/proc/self/clear_refs before each). The state is 4 int64 columns (DistanceLFU: raw id, slot,
count, last access): 32 bytes a slot, `--zch-size` x 32 for the whole table. Files are written
under a temporary directory, removed at the end.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks._common import init_ranks, run_ranks, status_kib  # noqa: E402
from benchmarks._rendezvous import Rendezvous  # noqa: E402

CONTENDERS = ("split", "whole")


def _model(args, device: str):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule,
    )  # fmt: skip

    tables = [EmbeddingBagConfig(name="t_raw", num_embeddings=args.zch_size, embedding_dim=4, feature_names=["f"])]
    mcc = ManagedCollisionCollection(managed_collision_modules={"t_raw": MCHManagedCollisionModule(
        zch_size=args.zch_size, device=torch.device(device), eviction_policy=DistanceLFU_EvictionPolicy(),
        eviction_interval=1, input_hash_size=2**62)}, embedding_configs=tables)  # fmt: skip
    model = torch.nn.Module()
    model.mc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=tables, device=torch.device(device)),
                                                      mcc, return_remapped_features=True)  # fmt: skip
    return model


def _sharded(args):
    import modular
    from planners.types import ShardingPlan, ShardingType, TablePlacement

    model = _model(args, "meta")
    modular.shard(model, ShardingPlan(world_size=args.world_size, modules={"mc._embedding_module": {
        "t_raw": TablePlacement(ShardingType.ROW_WISE, ranks=tuple(range(args.world_size)))}}))  # fmt: skip
    return model, model.mc._managed_collision_collection._managed_collision_modules["t_raw"]


def _fill(module, args) -> None:
    """Every usable slot of this rank's range holds a raw id (the same table on every rank)."""
    from modular.mc.slot_shard import SlotShard

    old = module._shard
    generator = torch.Generator().manual_seed(1)
    slots = torch.arange(old.lo, old.hi, old.step)
    raw = torch.randint(0, 2**62, (args.zch_size - 1,), generator=generator)[slots]
    counts = torch.randint(1, 100, (slots.numel(),), generator=generator)
    shard = SlotShard(old.lo, old.hi, module._scoring, step=old.step)
    shard.load(raw, slots, {"counts": counts, "last_access_iter": torch.full_like(counts, 5)})
    module._shard = shard


def _peak(call) -> tuple[float, int]:
    """(seconds, peak resident bytes above those before) of `call()` on this rank."""
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current VmRSS
        f.write("5")
    before = status_kib("VmRSS")
    t = time.perf_counter()
    call()
    seconds = time.perf_counter() - t
    peak = status_kib("VmHWM")
    dist.barrier()
    return seconds, (peak - before) * 1024


def _worker(rank: int, args, rendezvous: Rendezvous, queue) -> None:
    import warnings

    import modular
    from modular.mc.table_state import TableState

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    init_ranks(rank, args.world_size, store=rendezvous.store())
    model, module = _sharded(args)
    _fill(module, args)
    expected = module._rows()
    root = tempfile.mkdtemp(prefix="mc_checkpoint_", dir=args.dir) if rank == 0 else None
    holder = [root]
    dist.broadcast_object_list(holder, src=0)
    root = holder[0]
    results = {}
    split = TableState._split
    try:
        for name in CONTENDERS:
            if name == "whole":  # as saved before the split: the whole table on every rank
                TableState._split = lambda self, mode: self._whole()
            path = os.path.join(root, name)
            save_s, save_peak = _peak(lambda: modular.checkpoint.save(path, model))
            fresh, fresh_module = _sharded(args)
            load_s, load_peak = _peak(lambda: modular.checkpoint.load(path, fresh))
            assert torch.equal(fresh_module._rows(), expected), f"rank {rank}: {name}: the loaded state differs"
            TableState._split = split
            results[name] = (save_s, save_peak, load_s, load_peak)
            del fresh, fresh_module
    finally:
        TableState._split = split
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    queue.put((rank, results, module._shard.size * 32))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zch-size", type=int, default=8_000_000)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--dir", default=None, help="where the checkpoints are written (a temporary directory in it)")
    args = p.parse_args()
    whole = args.zch_size * 32
    print(f"## A collision table of zch_size {args.zch_size:,} (DistanceLFU: 4 int64 columns, "
          f"{whole / 2**20:,.0f} MiB whole) through modular.checkpoint, {args.world_size} gloo ranks on CPU "
          f"({os.cpu_count()} cores), {datetime.date.today().isoformat()}, torch {torch.__version__}\n")  # fmt: skip
    results = run_ranks(_worker, (args,), args.world_size)
    print("| contender | rank | its share MiB | save s | save peak MiB | load s | load peak MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in CONTENDERS:
        for rank, per_rank, share in sorted(results, key=lambda r: r[0]):
            save_s, save_peak, load_s, load_peak = per_rank[name]
            print(f"| {name} | {rank} | {share / 2**20:,.0f} | {save_s:.2f} | {save_peak / 2**20:,.0f} | "
                  f"{load_s:.2f} | {load_peak / 2**20:,.0f} |")  # fmt: skip
    print("\npeak: resident memory above that before the call (VmHWM after /proc/self/clear_refs)")


if __name__ == "__main__":
    main()
