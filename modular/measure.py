"""Measures this machine as a job's ranks run it, for the planner (Note [calibrated prices] in
planners/calibration.py): `python -m planners calibrate` runs this module in its own process,
since the planner never imports modular (plans are data; modular applies them, and here
measures its own kernels).

    python -m modular.measure --out this_machine.json --world-size 2 --threads-per-rank 1

One process per rank over the backend a job would use, each with the job's threads, all
measuring at once as a job's ranks share the machine: gloo on CPU; with --device cuda each rank
on GPU `rank % GPUs`, over NCCL where there is a GPU per rank, else gloo (--backend chooses;
Note [calibrating a GPU machine] in modular/measure_device.py).

    python -m modular.measure --out gpu.json --world-size 1 --device cuda --backend nccl
"""

from __future__ import annotations

import os
import platform
import socket
import time
from typing import Callable

from modular import measure_device as where
from modular.measure_device import interleaved as _interleaved
from modular.measure_device import median_seconds as _median_seconds
from modular.measure_device import slowest as _slowest
from modular.measure_kernels import fit_kernel_rate, kernel_shapes, robust_lstsq
from modular.measure_probes import PLANNER_OPTIMIZER, RATE_KEYS, probe_plan, probes
from planners.calibration import DATA_PARALLEL, FAMILIES, Calibration, KernelRate

PARTS = KernelRate.PARTS

__all__ = ["calibrate", "main"]

A2A_BYTES = (256, 256 << 10, 1 << 20, 4 << 20, 8 << 20)  # to each peer: up to a step's bags
ALL_REDUCE_BYTES = (1024, 1 << 20, 4 << 20, 16 << 20)
OPTIMIZER = {"fused": "exact_rowwise_adagrad", "emulated": "adam"}  # "dense": torch SGD


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(tables: list[tuple[str, int, int]], family: str, placements: dict, world: int, group):
    """An EBC of `tables` (name, rows, dim) sharded by `placements` on `group`, and its step."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    import modular
    from planners.types import ShardingPlan

    torch.manual_seed(0)  # every rank's copy alike
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[n])
        for n, r, d in tables
    ])  # fmt: skip
    if where.device() is not None:
        ebc = ebc.to(where.device())
    model = torch.nn.ModuleDict({"ebc": ebc})
    opt = None
    if family in OPTIMIZER:
        opt = modular.fuse_optimizer(model, OPTIMIZER[family], lr=0.01)
    modular.shard(model, ShardingPlan(world_size=world, modules={"ebc": placements}), process_group=group,
                  device=where.device())
    if opt is None:
        opt = torch.optim.SGD(modular.local_parameters(model), lr=0.01)

    def step(kjt) -> None:
        opt.zero_grad()
        model["ebc"](kjt).values().sum().backward()
        opt.step()

    return step


def _batches(names: list[str], rows: int, bags: int, pooling: int, seed: int, n: int = 4) -> list:
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    lengths = torch.full((len(names) * bags,), pooling, dtype=torch.int64)
    out = [
        KeyedJaggedTensor(keys=names, values=torch.randint(0, rows, (int(lengths.sum()),), generator=g),
                          lengths=lengths, stride=bags)
        for _ in range(n)
    ]  # fmt: skip
    return out if where.device() is None else [kjt.to(where.device()) for kjt in out]


def _collectives(world: int, quick: bool, say: Callable[[str], None]) -> tuple[float, ...]:
    import numpy as np
    import torch
    import torch.distributed as dist

    n = 4 if quick else 10

    def fit(sizes, make) -> tuple[float, float]:
        """Latency: the smallest message's median time, timed alone (taken in turn with the
        large ones, a 1 KB all_reduce's median came out 2.2 ms here against 0.5 ms alone);
        bandwidth: the slope above it through the larger ones, taken in turn. (A line's
        intercept through three noisy points had swung from 0.03 to 2.5 ms.)"""
        lat = _slowest(_median_seconds(make(sizes[0]), 4 * n))
        seconds = _interleaved({b: make(b) for b in sizes[1:]}, n)
        x = np.array(sizes[1:], dtype=float)
        extra = np.array([seconds[b] for b in sizes[1:]]) - lat
        slope = float(np.dot(x, extra) / np.dot(x, x))
        return lat, 1.0 / max(slope, 1e-15)

    on = where.collective_device()  # the CPU under gloo, as modular's own collectives run

    def a2a(b):
        x, y = torch.zeros(world * b // 4, device=on), torch.empty(world * b // 4, device=on)
        return lambda i: dist.all_to_all_single(y, x)

    def reduce(b):
        x = torch.zeros(b // 4, device=on)
        return lambda i: dist.all_reduce(x)

    a2a_lat, a2a_bw = fit(A2A_BYTES, a2a)
    ar_lat, ar_bw = fit(ALL_REDUCE_BYTES, reduce)
    big = torch.ones(16 << 20, device=where.device())  # 64 MiB, where the tables are
    out = torch.empty_like(big)
    stream = 2 * big.numel() * 4 / _slowest(_median_seconds(lambda i: out.copy_(big), n))
    say(f"  all_to_all_single: {a2a_lat * 1e6:.0f} us + bytes per peer / {a2a_bw / 1e9:.2f} GB/s")
    say(f"  all_reduce: {ar_lat * 1e6:.0f} us + bytes / {ar_bw / 1e9:.2f} GB/s; stream copy {stream / 1e9:.1f} GB/s")
    return a2a_lat, a2a_bw, ar_lat, ar_bw, stream


def _kernel_rates(rank: int, world: int, quick: bool, say: Callable[[str], None]) -> dict[str, KernelRate]:
    """Times every family on every shape of modular/measure_kernels.py (one-rank models, all
    ranks at once) and fits its rates."""
    import torch.distributed as dist

    own = [dist.new_group([r]) for r in range(world)][rank]  # each a collective: every rank makes all
    shapes = kernel_shapes(quick)
    rates = {}
    for family in FAMILIES:
        seconds = []
        for tables, rows, dim, ids, bags in shapes:
            names = [f"t{i}" for i in range(tables)]
            step = _model([(t, rows, dim) for t in names], family, probe_plan("rw", tables, 1), 1, own)
            kjts = _batches(names, rows, bags, ids // bags, seed=rank)
            dist.barrier()
            seconds.append(_slowest(_median_seconds(lambda i: step(kjts[i % len(kjts)]), 8 if quick else 15)))
            del step
        rates[family] = fit_kernel_rate(shapes, seconds)
        say(f"  kernels {family}: {len(shapes)} shapes, {rates[family]}")
    return rates


def _features(family: str, kind: str, n: int, rows: int, dim: int, pooling: int, bags: int,
              world: int, comm: Calibration, rates: dict) -> tuple[list[float], float]:  # fmt: skip
    """A probe's slowest rank as the cost model sees it: the seconds each fitted constant
    multiplies (set to 1, the rest 0: the fixed part, the routing per id sent, the family's
    kernels at `rates` and a data-parallel copy's, each further kind of shard), and the seconds
    of the measured wire."""
    import dataclasses

    import planners
    from planners.evaluate import fixed_seconds
    from planners.types import ShardingPlan

    names = [f"t{i}" for i in range(n)]
    tables = [planners.Table(t, rows, dim, features=(t,), pooling_factor=pooling) for t in names]
    plan = ShardingPlan(world_size=world, modules={"": probe_plan(kind, n, world)})
    zero = KernelRate(0.0, 0.0, 0.0)
    quiet = dataclasses.replace(comm, kernels={f: zero for f in RATE_KEYS}, step_fixed=0.0,
                                kernel_fixed=0.0, sent_id=0.0)  # fmt: skip
    fast = dataclasses.replace(quiet, all_to_all_bandwidth=1e30, all_reduce_bandwidth=1e30,
                               all_to_all_latency=0.0, all_reduce_latency=0.0)  # fmt: skip

    def slowest(cal: Calibration) -> float:
        stats = planners.plan_stats(plan, tables, planners.Topology(world, calibration=cal),
                                    batch_size=bags, optimizer=PLANNER_OPTIMIZER[family])  # fmt: skip
        return max(r.cost for r in stats.ranks)

    def fixed(**unit) -> float:
        topology = planners.Topology(world, calibration=dataclasses.replace(fast, **unit))
        return max(fixed_seconds(plan, [("", t) for t in tables], topology, bags))

    kernels = [slowest(dataclasses.replace(fast, kernels={**fast.kernels, key: rates[family]}))
               for key in (family, DATA_PARALLEL[family])]  # fmt: skip
    return [1.0, fixed(sent_id=1.0), *kernels, fixed(kernel_fixed=1.0)], slowest(quiet)


def _step_rates(rank: int, world: int, quick: bool, comm: Calibration, rates: dict,
                say: Callable[[str], None]) -> Calibration:  # fmt: skip
    """Times each probe step at this world size (all ranks together) and fits on them the fixed
    part, the routing per id sent, what each further kind of shard adds, and how much each
    family's kernel rates (`rates`, timed apart) grow inside a step, a data-parallel copy's
    apart (Note [calibrated prices])."""
    import dataclasses

    import numpy as np
    import torch.distributed as dist

    columns: list[str] = ["step_fixed", "sent_id", "kernel_fixed", *RATE_KEYS]
    a, y, weights = [], [], []
    timed = probes(quick)
    for j, (family, kind, per_rank, rows, dim, pooling, bags) in enumerate(timed):
        n = per_rank * (world if kind in ("tw", "mix") else 1)  # table-wise pieces spread
        names = [f"t{i}" for i in range(n)]
        step = _model([(t, rows, dim) for t in names], family, probe_plan(kind, n, world), world, None)
        kjts = _batches(names, rows, bags, pooling, seed=rank)
        dist.barrier()
        measured = _slowest(_median_seconds(lambda i: step(kjts[i % len(kjts)]), 6 if quick else 20))
        del step
        (one, sent, *per_key, kinds), wire = _features(family, kind, n, rows, dim, pooling, bags,
                                                       world, comm, rates)  # fmt: skip
        row = [0.0] * len(columns)
        row[0], row[1], row[2] = one, sent, kinds
        for key, seconds in zip((family, DATA_PARALLEL[family]), per_key):
            row[columns.index(key)] = seconds
        a.append(row)
        y.append(measured - wire)
        say(f"  probe {j + 1}/{len(timed)} {family} {kind} {n} x {rows:_} x {dim}, {bags} x {pooling} ids: "
            f"{measured * 1e3:.1f} ms")
        weights.append(1.0 / measured)
    # Weighted by 1/measured: the prices are judged by their ratio to the step, so a 5 ms step's
    # error counts as much as a 100 ms step's; robust, so that a probe the machine slowed does not
    # move every constant.
    coef = robust_lstsq(np.array(a), np.array(y), np.array(weights))
    c = dict(zip(columns, (float(x) for x in coef)))
    kernels = {}
    used = dict(zip(columns, np.array(a).any(axis=0)))
    for key in RATE_KEYS:
        family = key.removesuffix("_dp")
        if not used[key] and key != family:  # no probe ran a copy: priced at the family's rates
            continue
        kernels[key] = KernelRate(*(c[key] * getattr(rates[family], part) for part in PARTS))
        say(f"  {key}: x{c[key]:.2f} the {family} kernels' rates inside a step")
    return dataclasses.replace(comm, kernels=kernels, step_fixed=c["step_fixed"], sent_id=c["sent_id"],
                               kernel_fixed=c["kernel_fixed"])  # fmt: skip


def _rank_main(rank: int, world: int, threads: int, port: int, quick: bool, queue,
               device: str = "cpu", backend: str = "gloo") -> None:  # fmt: skip
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    import torch.distributed as dist

    import warnings

    warnings.filterwarnings("ignore")  # ShardedTensor's FutureWarnings: the progress lines matter
    torch.set_num_threads(threads)
    where.init_rank(rank, world, port, device, backend)  # gloo on CPU
    messages: list[str] = []

    def say(line: str) -> None:
        if rank == 0:
            queue.put(("say", line))

    try:
        on = "gloo" if device == "cpu" else f"{device}, {backend}"
        say(f"calibrate: world {world}, {threads} thread(s) per rank, {on}; collectives")
        a2a_lat, a2a_bw, ar_lat, ar_bw, stream = _collectives(world, quick, say)
        zero = KernelRate(0.0, 0.0, 0.0)
        comm = Calibration(kernels={f: zero for f in RATE_KEYS}, all_to_all_latency=a2a_lat,
                           all_to_all_bandwidth=a2a_bw, all_reduce_latency=ar_lat,
                           all_reduce_bandwidth=ar_bw, stream_bandwidth=stream, step_fixed=0.0,
                           kernel_fixed=0.0, world_size=world, threads_per_rank=threads,
                           backend=backend, device=device)  # fmt: skip
        say(f"calibrate: each kernel family on {len(kernel_shapes(quick))} shapes, apart from the wire")
        rates = _kernel_rates(rank, world, quick, say)
        say(f"calibrate: {len(probes(quick))} probe steps (~{'20' if quick else '90'} s)")
        fitted = _step_rates(rank, world, quick, comm, rates, say)
        say(f"  fixed: {fitted.step_fixed * 1e3:.2f} ms a step, {fitted.kernel_fixed * 1e3:.2f} ms per further "
            f"kind of shard, {fitted.sent_id * 1e9:.1f} ns per id sent")
        if rank == 0:
            import fbgemm_gpu  # noqa: F401  (its version, when it has one)
            import torchrec

            queue.put(("done", dict(
                kernels=fitted.kernels, all_to_all_latency=a2a_lat, all_to_all_bandwidth=a2a_bw,
                all_reduce_latency=ar_lat, all_reduce_bandwidth=ar_bw, stream_bandwidth=stream,
                step_fixed=fitted.step_fixed, kernel_fixed=fitted.kernel_fixed, sent_id=fitted.sent_id,
                world_size=world,
                threads_per_rank=threads, backend=backend, device=device,
                host=platform.node(), measured_at=time.time(),
                versions={"torch": torch.__version__, "torchrec": getattr(torchrec, "__version__", "?"),
                          "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"),
                          "cpus": str(os.cpu_count()),
                          **({"cuda": str(torch.version.cuda)} if device == "cuda" else {})},
                **({"notes": where.notes(device, backend, world)} if device != "cpu" else {}),
            )))  # fmt: skip
        dist.barrier()
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which raises it)
        queue.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()
        del messages


def calibrate(world_size: int = 2, threads_per_rank: int = 1, *, quick: bool = False,
              say: Callable[[str], None] = print, timeout: float = 900.0, device: str = "cpu",
              backend: str | None = None) -> Calibration:  # fmt: skip
    """Measures this machine with `world_size` rank processes of `threads_per_rank` threads, on
    `device` ("cpu", or "cuda": Note [calibrating a GPU machine]) over `backend` (None: gloo on
    CPU; on CUDA NCCL with a GPU per rank, else gloo). A ValueError before any rank starts if
    the machine cannot run that."""
    import multiprocessing as mp

    if world_size < (1 if device == "cuda" else 2):
        raise ValueError(f"calibrate needs a world size of at least 2 (its collectives), got {world_size}")
    backend = where.check(device, backend, world_size)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, threads_per_rank, port, quick, queue,
                                                         device, backend))
             for r in range(world_size)]  # fmt: skip
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    result = None
    try:
        while result is None:
            try:
                kind, payload = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            except Exception:  # queue.Empty
                raise TimeoutError(f"calibrate: no result in {timeout:.0f} s") from None
            if kind == "say":
                say(payload)
            elif kind == "error":
                raise RuntimeError(f"calibrate failed on {payload}")
            else:
                result = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return Calibration(**result)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m modular.measure", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                   help="default: gloo on CPU; on CUDA nccl with a GPU per rank, else gloo")
    args = p.parse_args(argv)
    try:
        where.check(args.device, args.backend, args.world_size)  # before any rank starts
    except ValueError as e:
        p.error(str(e))
    calibration = calibrate(args.world_size, args.threads_per_rank, quick=args.quick,
                            say=lambda line: print(line, flush=True), device=args.device,
                            backend=args.backend)  # fmt: skip
    calibration.save(args.out)
    for note in calibration.notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
