"""2D sparse parallelism against 1D (issue 36): step time and the bytes each collective moves per
step per rank, side by side in one run on CPU gloo ranks; and the planner's prices of the same.

    python benchmarks/step_2d.py                          # world 4: 1D over 4, 2D 2x2 exact, periodic
    python benchmarks/step_2d.py --plans tw --sync-every 10 --steps 30
    python benchmarks/step_2d.py --world-size 6 --replicas 3
    python benchmarks/step_2d.py --priced                 # planner: Criteo 1TB at 64, 512, 4,096

For each plan the ranks build three models from the same weights, each with fbgemm's fused
exact row-wise Adagrad (`modular.fuse_optimizer` before `shard`), and time them on the same
synthetic batches (benchmarks/_common.py: B samples per rank, so the global batch is W x B in
every contender), in alternating blocks:

  1D        `modular.shard(model, plan)`, the plan over all W ranks
  exact     `modular.shard(model, plan, mesh=mesh)` over a ("replicate", "shard") mesh of R x G
            ranks, the plan over G = W / R; `replica_sync="exact"` (Note [exact replicas] in
            modular/kernels/exact_replicas.py: every copy gathers the other groups' lookup batches
            and replays them through its backward)
  periodic  the same mesh, `replica_sync="periodic"`, and `modular.sync_replicas(model)` (weights
            and fused state averaged across replica groups) after every --sync-every N steps

A step's time is the max over ranks; "step" is the median of the timed steps, the periodic sync's
own time ("sync") is timed apart (its median) and amortised over N ("per step" = step + sync/N).
Bytes are counted, not timed: one step of each contender (and one sync_replicas call) runs with
torch.distributed's collectives wrapped, and each call's bytes *received* by the rank are added
up by collective and by the group it ran on (world, shard group, replica group): an all-to-all
the sum of its output splits less the rank's own, an all-gather (n - 1) x its input, an
all-reduce 2 (n - 1) / n x its tensor (a ring's), a broadcast its tensor on every rank but the
source. The table shows the max over ranks; below it, how many collectives each contender calls
per step by kind and group (the replica axis' gathers are latency-bound: Note [exact replicas]
counts them). "priced" is what the planner charges the same plan for exact replica sync, in
bytes received per rank (`plan_stats(..., replicas=R)` on links of 1 byte/s, the max over
ranks), beside the replica group's gathers counted.

Ranks run one thread each. This machine's cores are fewer than the ranks, so rank r is pinned
to core r mod (cores this process may use) with its gloo threads (round robin, two ranks a core
on two cores): step times include a core's sharing, the byte counts are exact regardless.

--priced prints instead the planner's step time for the Criteo 1TB tables
(examples/tables_criteo_1tb.yaml, H100 defaults, 8 ranks per host, batch 512 per rank) at 64,
512 and 4,096 ranks: 1D, and 2D exact and periodic at every replica count that keeps a group of
at least 8 ranks (docs/planner.md's 2D table).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import os
import statistics
import sys
import time
import warnings
from typing import Callable, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks._common import (  # noqa: E402
    PLANS, Model, Workload, add_workload_args, make_batches, make_ebc, max_over_ranks, our_plan,
    workload_fields,
)
from benchmarks._rendezvous import Rendezvous, hosted_rendezvous  # noqa: E402

CONTENDERS = ("1D", "exact", "periodic")
LR, EPS = 0.01, 1e-8
KiB = 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Workload):
    replicas: int  # R replica groups of world_size / R ranks
    sync_every: int  # periodic: sync_replicas after every N steps
    cores: tuple[int, ...] = ()


# -- counting bytes per collective ----------------------------------------------------------------

_COUNTED = ("all_to_all_single", "all_gather_single", "all_gather_into_tensor", "all_gather",
            "all_reduce", "broadcast", "irecv")  # fmt: skip
_SHORT = {"all_to_all_single": "a2a", "all_gather_single": "gather", "all_gather_into_tensor": "gather",
          "all_gather": "gather", "all_reduce": "all-reduce", "broadcast": "bcast", "irecv": "recv"}  # fmt: skip


def _received(name: str, args: tuple, kwargs: dict, n: int, me: int) -> int:
    """Bytes this rank receives from the others in one call (module docstring's conventions)."""
    if name == "all_to_all_single":
        out = args[0]
        splits = args[2] if len(args) > 2 else kwargs.get("output_split_sizes")
        own = splits[me] if splits else out.numel() // n
        return (out.numel() - own) * out.element_size()
    if name.startswith("all_gather"):  # (output, input): every other rank's input
        return (n - 1) * args[1].numel() * args[1].element_size()
    t = args[0]
    if name == "all_reduce":
        return int(2 * (n - 1) / n * t.numel() * t.element_size())
    if name == "broadcast":
        src = kwargs.get("group_src", kwargs.get("src", args[1] if len(args) > 1 else 0))
        return 0 if src == me else t.numel() * t.element_size()
    return t.numel() * t.element_size()  # irecv


def count_bytes(
    run: Callable[[], object], groups: dict[str, list[int]]
) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes received by this rank in `run()`, and how many calls, each keyed "<collective>
    <group>", the group named by its ranks as in `groups` ("world" for the default group)."""
    counts: dict[str, int] = {}
    calls: dict[str, int] = {}
    originals = {name: getattr(dist, name) for name in _COUNTED}
    world = list(range(dist.get_world_size()))

    def wrap(name: str) -> Callable:
        original = originals[name]

        def counting(*args, **kwargs):
            group = kwargs.get("group")
            ranks = world if group is None else dist.get_process_group_ranks(group)
            where = next((k for k, v in groups.items() if v == ranks), str(ranks))
            key = f"{_SHORT[name]} {where}"
            me = ranks.index(dist.get_rank())
            counts[key] = counts.get(key, 0) + _received(name, args, kwargs, len(ranks), me)
            calls[key] = calls.get(key, 0) + 1
            return original(*args, **kwargs)

        return counting

    for name in _COUNTED:
        setattr(dist, name, wrap(name))
    try:
        run()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return counts, calls


# -- the contenders -------------------------------------------------------------------------------


def _loss(pooled: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    return (pooled * probe).sum()


def _model(cfg: Config, ebc, plan: str, mesh, sync: Optional[str]):
    import modular

    model = Model(copy.deepcopy(ebc))
    modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=LR, eps=EPS)  # before shard
    if mesh is None:
        return modular.shard(model, our_plan(cfg, plan))
    group = dataclasses.replace(cfg, world_size=cfg.world_size // cfg.replicas)
    return modular.shard(model, our_plan(group, plan), mesh=mesh, replica_sync=sync)


def _step(model, probe) -> Callable:
    def step(kjt) -> None:
        _loss(model(kjt), probe).backward()  # the fused update runs in backward

    return step


def _run_plan(cfg: Config, plan: str, mesh, groups, ebc, kjts, probe) -> dict:
    import modular

    models = {
        "1D": _model(cfg, ebc, plan, None, None),
        "exact": _model(cfg, ebc, plan, mesh, "exact"),
        "periodic": _model(cfg, ebc, plan, mesh, "periodic"),
    }
    steps = {name: _step(m, probe) for name, m in models.items()}

    def sync() -> None:
        modular.sync_replicas(models["periodic"])

    for name, step in steps.items():
        for i in range(cfg.warmup):
            step(kjts[i % len(kjts)])
    sync()
    counted = {name: count_bytes(lambda s=step: s(kjts[0]), groups) for name, step in steps.items()}
    counted["sync"] = count_bytes(sync, groups)
    moved = {name: c[0] for name, c in counted.items()}
    calls = {name: c[1] for name, c in counted.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    sync_times: list[float] = []
    done = {name: 0 for name in steps}
    per_block = max(1, cfg.steps // cfg.blocks)
    for b in range(cfg.blocks):
        names = list(steps) if b % 2 == 0 else list(reversed(steps))
        for name in names:
            dist.barrier()
            mine, synced = [], []
            for _ in range(per_block):
                t0 = time.perf_counter()
                steps[name](kjts[done[name] % len(kjts)])
                mine.append(time.perf_counter() - t0)
                done[name] += 1
                if name == "periodic" and done[name] % cfg.sync_every == 0:
                    t0 = time.perf_counter()
                    sync()
                    synced.append(time.perf_counter() - t0)
            times[name] += max_over_ranks(mine)
            if synced:
                sync_times += max_over_ranks(synced)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (moved, calls))

    def most(part: int) -> dict:
        return {name: {k: max(r[part][name].get(k, 0) for r in every)
                       for r in every for k in r[part][name]} for name in moved}  # fmt: skip

    replicas = [r[0]["exact"].get("gather replicas", 0) for r in every]
    return {"times": times, "sync": sync_times, "bytes": most(0), "calls": most(1),
            "counted": replicas, "priced": priced_replica_bytes(cfg, plan)}  # fmt: skip


def priced_replica_bytes(cfg: Config, plan: str) -> list[float]:
    """What the planner charges `plan` (one shard group's) for exact replica sync, in bytes
    received per step by each rank of a shard group: `replica_sync` seconds on links of 1
    byte/s."""
    import planners

    tables = [
        planners.Table(f"t{i}", cfg.rows, cfg.dim, features=(f"f{i}",),
                       pooling_factor=float(cfg.pooling))
        for i in range(cfg.tables)
    ]  # fmt: skip
    group = dataclasses.replace(cfg, world_size=cfg.world_size // cfg.replicas)
    topology = planners.Topology(cfg.world_size, ranks_per_host=cfg.world_size,
                                 intra_host_bandwidth=1.0, cross_host_bandwidth=1.0)  # fmt: skip
    stats = planners.plan_stats(our_plan(group, plan), tables, topology, batch_size=cfg.batch,
                                module_fqn="ebc", replicas=cfg.replicas)  # fmt: skip
    return [r.replica_sync for r in stats.ranks]


# -- ranks ----------------------------------------------------------------------------------------


def _worker(rank: int, cfg: Config, rendezvous: Rendezvous) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    if cfg.cores:  # before the process group, so that gloo's threads stay on the rank's core
        os.sched_setaffinity(0, {cfg.cores[rank % len(cfg.cores)]})
    dist.init_process_group("gloo", store=rendezvous.store(), rank=rank, world_size=cfg.world_size)
    group_size = cfg.world_size // cfg.replicas
    mesh = init_device_mesh("cpu", (cfg.replicas, group_size), mesh_dim_names=("replicate", "shard"))
    groups = {
        "world": list(range(cfg.world_size)),
        "shard": dist.get_process_group_ranks(mesh.get_group("shard")),
        "replicas": dist.get_process_group_ranks(mesh.get_group("replicate")),
    }
    torch.manual_seed(0)  # every rank's model alike
    ebc = make_ebc(cfg)
    kjts = make_batches(cfg, rank)
    probe = torch.randn(cfg.batch, cfg.tables * cfg.dim, generator=torch.Generator().manual_seed(7))
    results = {}
    for plan in cfg.plans:
        torch.manual_seed(0)
        results[plan] = _run_plan(cfg, plan, mesh, groups, ebc, kjts, probe)
    if rank == 0:
        _print(cfg, results)
    dist.barrier()
    dist.destroy_process_group()


def _print(cfg: Config, results: dict) -> None:
    med = statistics.median
    g = cfg.world_size // cfg.replicas
    pinned = (f"rank r pinned to core r mod {len(cfg.cores)} (round robin: "
              f"{cfg.world_size} ranks on {len(cfg.cores)} cores)") if cfg.cores else "not pinned"  # fmt: skip
    print(
        f"\n## {cfg.tables} tables x {cfg.rows:,} rows x {cfg.dim} dims, batch {cfg.batch:,} per "
        f"rank, pooling {cfg.pooling}, fused exact row-wise Adagrad; 1D over {cfg.world_size} "
        f"ranks against 2D {cfg.replicas} x {g} (replicate x shard); periodic syncs every "
        f"{cfg.sync_every} steps; {cfg.world_size} CPU ranks x 1 thread (gloo, {pinned}); "
        f"{cfg.steps} steps each in {cfg.blocks} alternating blocks; "
        f"{datetime.date.today().isoformat()}\n"
    )
    keys = sorted({k for r in results.values() for b in r["bytes"].values() for k in b})
    print("| plan | contender | step ms | sync ms | per step ms | "
          + " | ".join(f"{k} KiB" for k in keys) + " | all KiB | priced replicas KiB |")
    print("|---|---|" + "---:|" * (len(keys) + 5))
    for plan, r in results.items():
        for name in CONTENDERS:
            step = med(r["times"][name])
            moved = dict(r["bytes"][name])
            sync_ms, per_step = "", step
            if name == "periodic":
                s = med(r["sync"]) if r["sync"] else 0.0
                sync_ms, per_step = f"{s * 1e3:.1f}", step + s / cfg.sync_every
                for k, v in r["bytes"]["sync"].items():
                    moved[k] = moved.get(k, 0) + v / cfg.sync_every
            cells = [f"{moved.get(k, 0) / KiB:,.1f}" if moved.get(k) else "0" for k in keys]
            priced = f"{max(r['priced']) / KiB:,.1f}" if name == "exact" else ""
            print(f"| {PLANS[plan]} | {name} | {step * 1e3:.1f} | {sync_ms} | {per_step * 1e3:.1f} | "
                  + " | ".join(cells) + f" | {sum(moved.values()) / KiB:,.1f} | {priced} |")
    print(f"\n(bytes received per step by the rank that receives most; periodic's include its "
          f"sync's / {cfg.sync_every}: one sync_replicas call receives over the replica group "
          + ", ".join(f"{PLANS[p]} {r['bytes']['sync'].get('all-reduce replicas', 0):,} B"
                      for p, r in results.items()) + ")")  # fmt: skip
    print("\ncollectives per step by kind and group, on the rank that calls most (periodic's "
          "sync_replicas call apart):")
    for plan, r in results.items():
        for name in (*CONTENDERS, "sync"):
            calls = r["calls"][name]
            print(f"  {PLANS[plan]} {name}: " + ", ".join(f"{k} {calls[k]}" for k in sorted(calls))
                  + f"; {sum(calls.values())} in all")
    print("\nexact, bytes each rank receives over its replica group per step, counted / priced "
          "(rank r is rank r mod G of its shard group):")
    for plan, r in results.items():
        pairs = [f"{c:,} / {r['priced'][i % g]:,.0f}" for i, c in enumerate(r["counted"])]
        print(f"  {PLANS[plan]}: " + "; ".join(pairs))


# -- the planner's prices ------------------------------------------------------------------------


def priced(batch: int = 512, host: int = 8) -> None:
    """docs/planner.md's table: the planner's step time of the Criteo 1TB tables, 1D against 2D
    exact and periodic, on the slowest rank; for periodic, one `sync_replicas` call priced
    apart (`Replicas.sync_seconds` of the rank with most shard and state bytes) and the N (sync
    every N steps) above which periodic's step plus its sync / N is cheaper than exact's step
    and than 1D's."""
    import planners
    from planners.files import load_tables
    from planners.replicas import group_topology, synced_bytes

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", "tables_criteo_1tb.yaml")  # fmt: skip
    tables = load_tables(path)
    print("| ranks | layout (R x G) | sync | step us | all-to-all us | replica sync us | lookup us "
          "| other us | sync_replicas ms | N to beat exact | N to beat 1D |")
    print("|---|---|---|" + "---:|" * 8)

    def row(world: int, layout: str, sync: str, s, extra: str = "| | | |") -> None:
        k = s.slowest_rank
        a2a = k.input_dist + k.output_dist
        other = k.cost - a2a - k.replica_sync - k.lookup
        print(f"| {world} | {layout} | {sync} | {s.max_cost * 1e6:.1f} | {a2a * 1e6:.1f} | "
              f"{k.replica_sync * 1e6:.1f} | {k.lookup * 1e6:.1f} | {other * 1e6:.1f} {extra}",
              flush=True)  # fmt: skip

    def n_to_beat(sync_s: float, step: float, other: float) -> str:
        return f"{sync_s / (other - step):,.0f}" if other > step else "never"

    for world in (64, 512, 4096):
        topology = planners.Topology(world, ranks_per_host=host, device_memory="80GiB")
        one_d = planners.plan_with_stats(tables, topology, batch_size=batch).stats
        row(world, "1D", "-", one_d)
        for replicas in (r for r in (2, 4, 8, 64, 512) if world // r >= host):
            layout = f"{replicas} x {world // replicas}"
            exact = planners.plan_with_stats(tables, topology, batch_size=batch,
                                             replicas=replicas).stats  # fmt: skip
            row(world, layout, "exact", exact)
            periodic = planners.plan_with_stats(tables, topology, batch_size=batch,
                                                replicas=replicas, replica_sync="periodic")  # fmt: skip
            group, across = group_topology(topology, replicas, "periodic")
            sync_s = across.sync_seconds(max(synced_bytes(periodic.plan, tables)),
                                         group.intra_host_bandwidth, group.cross_host_bandwidth)  # fmt: skip
            step = periodic.stats.max_cost
            row(world, layout, "periodic", periodic.stats,
                f"| {sync_s * 1e3:.1f} | {n_to_beat(sync_s, step, exact.max_cost)} | "
                f"{n_to_beat(sync_s, step, one_d.max_cost)} |")


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.set_defaults(world_size=4, plans=["tw", "rw", "cw", "dp", "mix"], batch=512)
    p.add_argument("--replicas", type=int, default=2, help="R: 2D is R x (world_size / R)")
    p.add_argument("--sync-every", type=int, default=10, help="periodic: sync_replicas every N steps")
    p.add_argument("--steps", type=int, default=30, help="timed steps per contender and plan")
    p.add_argument("--blocks", type=int, default=6, help="alternating blocks the steps are split in")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-pin", action="store_true", help="let the OS move ranks between cores")
    p.add_argument("--priced", action="store_true", help="print the planner's Criteo 1TB table only")
    a = p.parse_args(argv)
    if a.priced:
        priced()
        return
    if a.world_size % a.replicas or a.replicas < 2:
        p.error(f"--replicas {a.replicas} must be at least 2 and divide --world-size {a.world_size}")
    cfg = Config(**workload_fields(a), replicas=a.replicas, sync_every=a.sync_every,
                 cores=() if a.no_pin else tuple(sorted(os.sched_getaffinity(0))))  # fmt: skip
    with hosted_rendezvous() as rendezvous:
        mp.spawn(_worker, args=(cfg, rendezvous), nprocs=cfg.world_size, join=True)


if __name__ == "__main__":
    main()
