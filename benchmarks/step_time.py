"""Training-step time of our sharded EBC against TorchRec's, side by side in one run.

    python benchmarks/step_time.py                                  # the default config (issue 7)
    python benchmarks/step_time.py --plans rw --optimizers fused --steps 10
    python benchmarks/step_time.py --profile rw:fused               # where our step spends time
    python benchmarks/step_time.py --plans mix --optimizers fused   # column pieces beside tables
    python benchmarks/step_time.py --plans tw --optimizers fused --cpu  # CPU time per thread kind
    python benchmarks/step_time.py --device cuda --world-size 1     # one rank per GPU, NCCL
    python benchmarks/step_time.py --device cuda --world-size 2 --cuda-backend gloo  # 2 ranks, 1 GPU
    python benchmarks/step_time.py --plans cw --optimizers fused --cw-statistic per_shard
    python benchmarks/step_time.py --weighted                       # a weight per id
    perf record -g -D 20000 -- python benchmarks/step_time.py --plans tw --optimizers fused \
        --only ours --steps 1500 --blocks 1                         # one contender, for perf

For each (plan, optimizer) the ranks build one model per contender from the same weights and
time, on the same synthetic batches, alternating blocks of steps:

  ours      modular.shard + torch.optim.SGD over modular.local_parameters ("dense"), or
            modular.fuse_optimizer(model, "exact_rowwise_adagrad") ("fused"); column pieces
            keep the exact row statistic unless --cw-statistic per_shard gives each piece its own
            (TorchRec's approximation, what the torchrec contender does)
  prefetch  ours, with each step first calling modular.prefetch(model, next batch), so the next
            batch's input dist overlaps this step (Note [prefetched input dist])
  torchrec  DistributedModelParallel with the equivalent ParameterShardings: compute kernel
            "dense" with the same torch SGD over its parameters, or "fused" with
            EXACT_ROWWISE_ADAGRAD in fused_params
  pipeline  the same DMP under TorchRec's TrainPipelineSparseDist, which overlaps the next
            batch's input dist too (the counterpart of "prefetch")
  floor     fbgemm's table-batched kernel alone (SplitTableBatchedEmbeddingBagsCodegen with the
            fused update, or the dense TBE + SGD) on exactly the ids this rank looks up in our
            step (as int32), with this rank's shard shapes, without fbgemm's bounds check (ours
            checks ids in its input dist instead): no input or output dist
  unsharded one process's plain torchrec EBC (nn.EmbeddingBag per table) + SGD on its own batch
            ("dense"), or the fused fbgemm TBE over the whole tables ("fused")
  dense     the "unsharded dense part": the loss and its backward on the pooled output
  comm      ours' collectives alone: every call one step of ours makes, with its sizes, on
            buffers made once, nothing between them (benchmarks/_comm.py): what moving the
            step's bytes costs on this machine, a cost TorchRec pays too

A step is forward + backward + optimizer; its time is the max over ranks of that step's wall
time. Each rank runs with one thread (OMP_NUM_THREADS=1) and, unless --no-pin, is pinned to its
own share of the cores this process may use, with gloo's threads: a rank's background work then
fills its own cores' idle time instead of preempting another rank. `taskset -c 0-3` gives 2 ranks
2 cores each. All contenders run on all ranks at once.
With --device cuda each rank takes its own GPU (NCCL; at most as many ranks as GPUs), or with
--cuda-backend gloo the ranks share the GPUs round-robin (gloo moves CUDA tensors through host
memory: the shape of a multi-rank step on one GPU, not NCCL's timing); everything above lives on it, and a step's time ends with torch.cuda.synchronize(). There the contenders run
one at a time, each freed before the next is built, with its peak memory printed (Note [one
contender at a time on a GPU]): 26 tables x 500,000 rows x 128 dims did not fit side by side.
A contender that fails to build or to run (out of memory, say) is reported as "not run" with its
error, on every rank, and the others still run; a rank that fails inside a collective of a step
still leaves its peers waiting there, at the process group's timeout.

Under the table, each fused case prints the floor's achieved bandwidth: the bytes its kernel must
move per step, counted from the step's own ids, over its median step time, next to the device's
peak, or "unknown" (benchmarks/_bandwidth.py): the gap to the physical limit.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import dataclasses
import datetime
import gc
import io
import logging
import os
import pstats
import statistics
import sys
import threading
import time
import warnings
from typing import Callable, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._comm import record as record_collectives, replay as replay_collectives  # noqa: E402
from benchmarks._bandwidth import bandwidth_line, floor_bytes_per_step  # noqa: E402
from benchmarks._common import (  # noqa: E402
    PLANS, Model, Workload, add_device_args, add_workload_args, check_device_args, init_ranks,
    make_batches, make_ebc, max_over_ranks, our_plan, time_block, workload_fields,
)
from benchmarks._rendezvous import Rendezvous, hosted_rendezvous  # noqa: E402

OPTIMIZERS = ("dense", "fused")
CONTENDERS = ("ours", "prefetch", "torchrec", "pipeline", "floor", "unsharded", "dense", "comm")
LR, EPS = 0.01, 1e-8


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config(Workload):
    optimizers: tuple[str, ...]
    profile: Optional[str]
    torchrec: bool
    cpu: bool = False
    pin: bool = True
    device: str = "cpu"  # "cuda": one GPU per rank, NCCL
    cuda_backend: str = "nccl"  # "gloo": ranks share the GPUs round-robin
    cw_statistic: str = "exact"  # fuse_optimizer's column_wise_statistic for ours
    only: Optional[str] = None  # time this contender alone (for an outside profiler)
    cores: tuple[int, ...] = ()  # the cores the launching process may run on, shared out to ranks


def _device(cfg: Config) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")


# -- the contenders: each is a `step(kjt) -> None` closure --------------------------------------


def _loss(pooled: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    return (pooled * probe).sum()


def ours_step(cfg: Config, ebc, plan: str, opt_kind: str, probe) -> tuple[nn.Module, Callable]:
    import modular

    model = Model(copy.deepcopy(ebc))
    if opt_kind == "fused":  # before shard (Note [order of sharding calls])
        opt = modular.fuse_optimizer(
            model, "exact_rowwise_adagrad", lr=LR, eps=EPS,
            column_wise_statistic=cfg.cw_statistic,
        )  # fmt: skip
    modular.shard(model, our_plan(cfg, plan), device=_device(cfg))
    if opt_kind != "fused":
        opt = torch.optim.SGD(modular.local_parameters(model), lr=LR)

    def step(kjt) -> None:
        opt.zero_grad()
        _loss(model(kjt), probe).backward()
        opt.step()

    return model, step


def _prefetching(cfg: Config, ebc, plan: str, opt_kind: str, probe, kjts) -> Callable:
    import modular

    model, plain = ours_step(cfg, ebc, plan, opt_kind, probe)
    position = {id(k): i for i, k in enumerate(kjts)}

    def step(kjt) -> None:
        modular.prefetch(model, kjts[(position[id(kjt)] + 1) % len(kjts)])
        plain(kjt)

    return step


def _dmp(cfg: Config, module: nn.Module, plan: str, opt_kind: str):
    """TorchRec's DistributedModelParallel of `module` (its EBC at "ebc") with the equivalent
    plan, and the torch SGD over what its fused kernels do not update (None if nothing)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from planners.torchrec_interop import to_torchrec

    kernel = "fused" if opt_kind == "fused" else "dense"
    tr_plan = to_torchrec(
        our_plan(cfg, plan), Model(module.ebc), device_type=cfg.device, compute_kernel=kernel
    )
    fused_params = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": EPS}
    sharder = EmbeddingBagCollectionSharder(fused_params=fused_params)
    model = DistributedModelParallel(
        module, env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=_device(cfg), plan=tr_plan, sharders=[sharder],
    )  # fmt: skip
    # Fused tables update in backward; everything else (dense tables, data-parallel copies,
    # whose gradients DDP all-reduces) takes the torch SGD, like ours.
    dense = list(dict(in_backward_optimizer_filter(model.named_parameters())).values())
    return model, (torch.optim.SGD(dense, lr=LR) if dense else None)


def torchrec_step(cfg: Config, ebc, plan: str, opt_kind: str, probe) -> Callable:
    model, opt = _dmp(cfg, Model(copy.deepcopy(ebc)), plan, opt_kind)

    def step(kjt) -> None:
        if opt is not None:
            opt.zero_grad()
        _loss(model(kjt), probe).backward()
        if opt is not None:
            opt.step()

    return step


class _LossModel(nn.Module):
    """Model + loss, the shape TorchRec's train pipelines call: forward(batch) -> (loss, output)."""

    def __init__(self, ebc: nn.Module, probe: torch.Tensor) -> None:
        super().__init__()
        self.ebc = ebc
        self.register_buffer("probe", probe)

    def forward(self, kjt):
        pooled = self.ebc(kjt).values()
        return _loss(pooled, self.probe), pooled


def _torchrec_pipeline(cfg: Config, ebc, plan: str, opt_kind: str, probe, kjts) -> Callable:
    """The same DMP under TorchRec's TrainPipelineSparseDist (batch i+1's input dist overlaps
    batch i), on the same batches in the same order."""
    import itertools

    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    model, opt = _dmp(cfg, _LossModel(copy.deepcopy(ebc), probe), plan, opt_kind)
    # The pipeline always steps an optimizer; with every table fused there is nothing to step.
    opt = opt or torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
    pipeline = TrainPipelineSparseDist(model, opt, _device(cfg))
    batches = itertools.cycle(kjts)

    def step(_kjt) -> None:
        pipeline.progress(batches)

    return step


def _floor_inputs(ours_model, kjts) -> tuple[list, list[tuple[int, int]]]:
    """Exactly the ids our input dist gives this rank for each batch, as the floor's TBE takes
    them ((ids, offsets, weights), int32), and this rank's shard shapes (rows, cols) in the same
    table order (collective: runs ours' input dist)."""
    sebc = ours_model.ebc
    received = []
    with torch.no_grad():
        for kjt in kjts:
            r = sebc.input_dist(kjt)
            lengths = r.lengths.reshape(-1)
            values, weights = r.values, r.weights
            if r.local is not None:  # data-parallel tables look up this rank's own batch
                lengths = torch.cat([lengths, r.local.lengths()])
                values = torch.cat([values, r.local.values()])
                if weights is not None:
                    weights = torch.cat([weights, r.local.weights()])
            # int32 ids and offsets whatever ours sends (Note [ids on the wire]): the floor is
            # the kernel on its cheaper index type.
            lengths, values = lengths.to(torch.int32), values.to(torch.int32)
            offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
            received.append((values, offsets, weights))
    sizes = []
    for k in (*sebc._kernels, *sebc._local_kernels):
        sizes.extend(k.sizes)
    return received, sizes


def _floor(cfg: Config, received: list, sizes: list[tuple[int, int]], opt_kind: str) -> Callable:
    """The TBE on this rank's shard shapes and on exactly the ids our input dist gives it
    (`_floor_inputs`)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        DenseTableBatchedEmbeddingBagsCodegen,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    bags = [int(o.numel() - 1) for _, o, _ in received]
    per_table = bags[0] // len(sizes)
    where, compute = _tbe_placement(cfg)
    if opt_kind == "fused":
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(r, c, where, compute) for r, c in sizes],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LR, eps=EPS,
            pooling_mode=PoolingMode.SUM, device=_device(cfg),
            # As ours runs it: ours checks ids in its input dist, and that check is ours' cost,
            # not the kernel's (fbgemm's default per-forward check took 0.25 ms of a 9 ms floor).
            bounds_check_mode=BoundsCheckMode.NONE,
        )  # fmt: skip
        opt = None
    else:
        tbe = DenseTableBatchedEmbeddingBagsCodegen(
            embedding_specs=sizes, pooling_mode=PoolingMode.SUM, use_cpu=cfg.device == "cpu"
        ).to(_device(cfg))
        opt = torch.optim.SGD(tbe.parameters(), lr=LR)
    from modular.kernels.base import lookup_without_weight_grads

    grad = torch.randn(per_table, sum(c for _, c in sizes)).to(_device(cfg))
    # The weights need no gradient (as in ours: Note [no gradient for per-sample weights]).
    no_grad = torch.zeros(len(sizes), dtype=torch.int32, device=_device(cfg))
    state = {"i": 0}

    def step(_kjt) -> None:
        values, offsets, weights = received[state["i"] % len(received)]
        state["i"] += 1
        if opt is not None:
            opt.zero_grad()
        lookup_without_weight_grads(tbe, values, offsets, weights, no_grad).backward(grad)
        if opt is not None:
            opt.step()

    return step


def _tbe_placement(cfg: Config):
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice

    if cfg.device == "cuda":
        return EmbeddingLocation.DEVICE, ComputeDevice.CUDA
    return EmbeddingLocation.HOST, ComputeDevice.CPU


def _unsharded(cfg: Config, ebc, opt_kind: str, probe) -> Callable:
    if opt_kind == "dense":
        model = Model(copy.deepcopy(ebc))
        opt = torch.optim.SGD(model.parameters(), lr=LR)

        def step(kjt) -> None:
            opt.zero_grad()
            _loss(model(kjt), probe).backward()
            opt.step()

        return step
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(cfg.rows, cfg.dim, *_tbe_placement(cfg))] * cfg.tables,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LR, eps=EPS,
        pooling_mode=PoolingMode.SUM, device=_device(cfg),
    )  # fmt: skip

    from modular.kernels.base import lookup_without_weight_grads

    no_grad = torch.zeros(cfg.tables, dtype=torch.int32, device=_device(cfg))  # as in ours

    def step(kjt) -> None:
        out = lookup_without_weight_grads(
            tbe, kjt.values(), kjt.offsets(), kjt.weights_or_none(), no_grad
        ).view(cfg.tables, cfg.batch, cfg.dim)
        _loss(out.transpose(0, 1).reshape(cfg.batch, -1), probe).backward()

    return step


def _dense_part(probe) -> Callable:
    pooled = torch.randn(probe.shape).to(probe.device).requires_grad_()

    def step(_kjt) -> None:
        pooled.grad = None
        _loss(pooled, probe).backward()

    return step


# -- one (plan, optimizer) case -------------------------------------------------------------------


def _run_case(cfg: Config, rank: int, plan: str, opt_kind: str, ebc, kjts, probe) -> dict:
    """Builds and times each contender of one (plan, optimizer): side by side in alternating
    blocks on CPU; one at a time on CUDA, each freed before the next is built, so that a config
    whose every contender fits the GPU alone runs (Note [one contender at a time on a GPU])."""
    torch.manual_seed(0)
    notes: dict[str, str] = {}
    floor_in: dict = {}  # the floor's ids and shard shapes, from ours' model once built

    def ours() -> Callable:
        model, step = ours_step(cfg, ebc, plan, opt_kind, probe)
        floor_in["received"], floor_in["sizes"] = _floor_inputs(model, kjts)
        floor_in["calls"] = record_collectives(step, kjts[0])
        return step

    def comm() -> Callable:
        if "calls" not in floor_in:  # ours was not built (--only comm): build it for its calls
            _, step = ours_step(cfg, ebc, plan, opt_kind, probe)
            floor_in["calls"] = record_collectives(step, kjts[0])
        return replay_collectives(floor_in["calls"])

    def floor() -> Callable:
        if "received" not in floor_in:  # ours was not built (--only floor): build it for its ids
            _floor_inputs_from_a_model(cfg, plan, opt_kind, ebc, kjts, probe, floor_in)
        return _floor(cfg, floor_in["received"], floor_in["sizes"], opt_kind)

    builders: dict[str, Callable[[], Callable]] = {
        "ours": ours,
        "prefetch": lambda: _prefetching(cfg, ebc, plan, opt_kind, probe, kjts),
    }
    if cfg.torchrec:
        builders["torchrec"] = lambda: torchrec_step(cfg, ebc, plan, opt_kind, probe)
        builders["pipeline"] = lambda: _torchrec_pipeline(cfg, ebc, plan, opt_kind, probe, kjts)
    builders["floor"] = floor
    builders["unsharded"] = lambda: _unsharded(cfg, ebc, opt_kind, probe)
    builders["dense"] = lambda: _dense_part(probe)
    if cfg.world_size > 1:
        builders["comm"] = comm
    if cfg.only is not None:
        builders = {k: v for k, v in builders.items() if k == cfg.only}

    if cfg.device == "cuda":
        times, peak = _one_at_a_time(cfg, rank, plan, opt_kind, builders, kjts, notes)
    else:
        times, peak = _side_by_side(cfg, rank, plan, opt_kind, builders, kjts, notes), {}
    moved = None
    if opt_kind == "fused" and "floor" in times:  # every rank agrees (times are agreed)
        mine = floor_bytes_per_step(floor_in["received"], floor_in["sizes"])
        moved = torch.tensor([mine], dtype=torch.float64, device=_device(cfg))
        dist.all_reduce(moved, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        moved = moved.item()
    return {"times": times, "notes": notes, "peak": peak, "floor_bytes": moved}


def _floor_inputs_from_a_model(cfg, plan, opt_kind, ebc, kjts, probe, floor_in: dict) -> None:
    model, _ = ours_step(cfg, ebc, plan, opt_kind, probe)
    floor_in["received"], floor_in["sizes"] = _floor_inputs(model, kjts)


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"


def _agreed(cfg: Config, name: str, ok: bool, why: Optional[str], notes: dict) -> bool:
    """Whether `name` succeeded on every rank (collective): a contender that failed on one rank
    is skipped on all, with the failure's message or "failed on another rank"."""
    flag = torch.tensor([int(ok)], device=_device(cfg))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not flag.item():
        notes.setdefault(name, why or "failed on another rank")
    return bool(flag.item())


def _attempt(run: Callable[[], object]) -> tuple[bool, Optional[str]]:
    """(True, None) once `run()` returned, or (False, why) where it raised."""
    try:
        run()
    except Exception as e:  # reported in the table, and the next contender runs
        return False, _why(e)
    return True, None


def _build(cfg: Config, name: str, build: Callable[[], Callable], notes: dict) -> Optional[Callable]:
    """`build()`, or None where it raised on any rank (e.g. TorchRec cannot run a case on CPU, or
    the GPU ran out of memory): the other contenders still run."""
    try:
        step, why = build(), None
    except Exception as e:  # reported in the table, and the next contender runs
        step, why = None, _why(e)
    return step if _agreed(cfg, name, step is not None, why, notes) else None


def _side_by_side(cfg: Config, rank: int, plan: str, opt_kind: str, builders: dict, kjts,
                  notes: dict) -> dict[str, list[float]]:  # fmt: skip
    """Every contender built, then timed in alternating blocks (block b runs them in reverse
    order when b is odd), so that drifts of the machine fall on all alike."""
    contenders: dict[str, Callable] = {}
    for name, build in builders.items():
        step = _build(cfg, name, build, notes)
        if step is not None:
            contenders[name] = step
    for name, step in contenders.items():
        time_block(step, kjts, cfg.warmup, 0)
    if cfg.profile == f"{plan}:{opt_kind}" and "ours" in contenders:
        _profile(rank, contenders["ours"], kjts, cfg)
    if cfg.cpu:
        _cpu_breakdown(rank, contenders, kjts, cfg, f"{plan}/{opt_kind}")
    times: dict[str, list[float]] = {name: [] for name in contenders}
    per_block = max(1, cfg.steps // cfg.blocks)
    for b in range(cfg.blocks):
        names = list(contenders)
        if b % 2:
            names.reverse()
        for name in names:
            dist.barrier()
            times[name] += max_over_ranks(time_block(contenders[name], kjts, per_block, b))
    return times


# Note [one contender at a time on a GPU]
# On CPU the contenders run side by side in alternating blocks. On a GPU, memory is what limits
# the config: 26 tables x 500,000 rows x 128 dims are 6.7 GB of FP32 weights, and each contender
# holds its own copy (and its optimizer's state, a dense gradient as large for the dense kernels),
# so keeping all six alive ran out of an H100's 80 GB at the third plan. There each contender is
# built, warmed up, timed for all its steps and freed (then `empty_cache`) before the next, and
# its peak allocation is reported; the source EBC and the batches stay throughout and are part of
# every peak. A contender that raises (out of memory, say) is reported and the next one runs.
# Steps of one contender then run back to back: a drift of the machine is no longer shared out.


def _one_at_a_time(cfg: Config, rank: int, plan: str, opt_kind: str, builders: dict, kjts,
                   notes: dict) -> tuple[dict[str, list[float]], dict[str, int]]:  # fmt: skip
    """Note [one contender at a time on a GPU]: each contender's times and peak bytes allocated."""
    times: dict[str, list[float]] = {}
    peak: dict[str, int] = {}
    steps = max(1, cfg.steps // cfg.blocks) * cfg.blocks  # as many as side by side
    for name, build in builders.items():
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        step = _build(cfg, name, build, notes)
        if step is None:
            peak[name] = torch.cuda.max_memory_allocated()  # how far a failed build got
            continue
        # The ranks agree after the warm-up and after the timed steps, so that all reach the
        # next collective together when one rank raised in between (out of memory, say).
        if _agreed(cfg, name, *_attempt(lambda: time_block(step, kjts, cfg.warmup, 0)), notes):
            if name == "ours" and cfg.profile == f"{plan}:{opt_kind}":
                _profile(rank, step, kjts, cfg)
            if cfg.cpu and name in ("ours", "prefetch", "torchrec", "pipeline"):
                _cpu_breakdown(rank, {name: step}, kjts, cfg, f"{plan}/{opt_kind}")
            dist.barrier()
            mine: list = []
            ok, why = _attempt(lambda: mine.extend(time_block(step, kjts, steps, 0)))
            if _agreed(cfg, name, ok, why, notes):
                times[name] = max_over_ranks(mine)
        peak[name] = torch.cuda.max_memory_allocated()
        step = None  # its model, optimizer state and kept batches go before the next is built
    gc.collect()
    torch.cuda.empty_cache()
    return times, peak


def _profile(rank: int, step: Callable, kjts, cfg: Config) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        time_block(step, kjts, 5, 0)
    pr = cProfile.Profile()
    pr.enable()
    time_block(step, kjts, 5, 0)
    pr.disable()
    if rank == 0:
        print(f"\n== torch.profiler, ours, {cfg.profile}, 5 steps, rank 0 ==", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(35)
        print(f"\n== cProfile, ours, {cfg.profile}, 5 steps, rank 0 ==\n{s.getvalue()}", flush=True)


def _thread_cpu() -> dict[int, tuple[str, int]]:
    """Per thread of this process: its name and the CPU time it has run, in ns (Linux
    schedstat, exact, unlike the tick-sampled utime/stime)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = (name, int(f.read().split()[0]))
        except OSError:  # the thread ended meanwhile
            continue
    return out


def _cpu_breakdown(rank: int, contenders: dict, kjts, cfg: Config, case: str) -> None:
    """Where each sharded contender's CPU goes, per step on rank 0: its main thread, its other
    Python threads (our prefetch thread, TorchRec's pipeline), gloo's threads (the TCP loop and
    the process group's work threads) and anything else; busy = CPU / wall. With one core per
    rank, a step whose busy share is near 100% can only get faster by doing less work."""
    if not os.path.isdir("/proc/self/task"):
        if rank == 0:
            print("--cpu needs Linux's /proc/self/task; skipped", flush=True)
        return
    main = threading.get_native_id()
    n = max(cfg.steps, 10)
    rows = []
    for name in ("ours", "prefetch", "torchrec", "pipeline"):
        if name not in contenders:
            continue
        dist.barrier()
        before, t0 = _thread_cpu(), time.perf_counter()
        time_block(contenders[name], kjts, n, 0)
        wall, after = time.perf_counter() - t0, _thread_cpu()
        kinds = {"main": 0, "python threads": 0, "gloo": 0, "other": 0}
        for tid, (thread, ns) in after.items():
            used = ns - before.get(tid, (thread, 0))[1]
            if tid == main:
                kinds["main"] += used
            elif thread.startswith(("python", "modular")):
                kinds["python threads"] += used
            elif "gloo" in thread:
                kinds["gloo"] += used
            else:
                kinds["other"] += used
        total = sum(kinds.values())
        rows.append((name, wall / n * 1e3, total / n / 1e6, total / 1e9 / wall, kinds))
    if rank == 0:
        print(f"\n{case}: CPU per step on rank 0, ms ({n} steps; busy = CPU / wall)", flush=True)
        print(f"  {'':10} {'wall':>6} {'cpu':>6} {'busy':>5} " + " ".join(f"{k:>14}" for k in rows[0][4]))
        for name, wall_ms, cpu_ms, busy, kinds in rows:
            cells = " ".join(f"{v / n / 1e6:14.2f}" for v in kinds.values())
            print(f"  {name:10} {wall_ms:6.1f} {cpu_ms:6.1f} {busy:5.0%} {cells}", flush=True)


def workload(cfg: Config, rank: int):
    """(EBC, this rank's batches, the loss probe) on the config's device: the same weights on
    every rank and for every contender (also scripts/gpu/host_syncs.py's)."""
    torch.manual_seed(0)
    device = _device(cfg)
    ebc = make_ebc(cfg).to(device)
    kjts = [kjt.to(device) for kjt in make_batches(cfg, rank)]
    probe = torch.randn(cfg.batch, cfg.tables * cfg.dim, generator=torch.Generator().manual_seed(7))
    return ebc, kjts, probe.to(device)


def _worker(rank: int, cfg: Config, rendezvous: Rendezvous) -> None:
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    cores = _cores_of(rank, cfg)
    if cores:  # before the process group, so that gloo's threads stay on the rank's cores too
        os.sched_setaffinity(0, cores)
    init_ranks(rank, cfg.world_size, cfg.device, cfg.cuda_backend, store=rendezvous.store())
    ebc, kjts, probe = workload(cfg, rank)
    results = {}
    for plan in cfg.plans:
        for opt_kind in cfg.optimizers:
            results[(plan, opt_kind)] = _run_case(cfg, rank, plan, opt_kind, ebc, kjts, probe)
            if rank == 0:
                _print_case(plan, opt_kind, results[(plan, opt_kind)], cfg)
    if rank == 0 and cfg.only is None:
        _print_summary(cfg, results)
    dist.barrier()
    dist.destroy_process_group()


def _cores_of(rank: int, cfg: Config) -> set[int]:
    """The cores rank `rank` is pinned to: an equal share of those this process may run on (so
    `taskset -c 0-3` gives 2 ranks 2 cores each), none if not pinned or too few to share."""
    per_rank = len(cfg.cores) // cfg.world_size
    if not cfg.pin or per_rank == 0:
        return set()
    return set(cfg.cores[rank * per_rank:(rank + 1) * per_rank])


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:8.1f} {min(xs) * 1e3:8.1f} {max(xs) * 1e3:8.1f}"


def _print_case(plan: str, opt_kind: str, result: dict, cfg: Config) -> None:
    statistic = ""
    if opt_kind == "fused":
        statistic = f", ours with column_wise_statistic={cfg.cw_statistic!r}"
    print(f"\n{plan}/{opt_kind}: step time, ms (max over ranks per step{statistic})", flush=True)
    peak = result.get("peak", {})
    # On CUDA each contender ran alone: its peak allocation on rank 0 (Note [one contender at a
    # time on a GPU]), the shared source EBC and batches included.
    print(f"  {'':10} {'median':>8} {'min':>8} {'max':>8}" + (f" {'peak GiB':>9}" if peak else ""))
    for name, xs in result["times"].items():
        memory = f" {peak[name] / 2**30:9.2f}" if name in peak else ""
        print(f"  {name:10} {_ms(xs)}{memory}")
    for name, why in result["notes"].items():
        memory = f" (peak {peak[name] / 2**30:.2f} GiB)" if name in peak else ""
        print(f"  {name:10} not run: {why}{memory}")


def _print_summary(cfg: Config, results: dict) -> None:
    if cfg.device == "cuda":
        if cfg.cuda_backend == "gloo":
            gpus = min(cfg.world_size, torch.cuda.device_count())
            ranks = (f"{cfg.world_size} ranks on {gpus} x {torch.cuda.get_device_name()} (gloo, "
                     "ranks sharing GPUs)")  # fmt: skip
        else:
            ranks = f"{cfg.world_size} x {torch.cuda.get_device_name()} (NCCL, one GPU per rank)"
    else:
        mine = len(_cores_of(0, cfg))
        pinned = f"each rank pinned to its own {mine} core(s)" if mine else "ranks not pinned"
        ranks = f"{cfg.world_size} CPU ranks x 1 thread (gloo, {pinned})"
    print(
        f"\n## {cfg.tables} tables x {cfg.rows:,} rows x {cfg.dim} dims, batch {cfg.batch:,} per "
        f"rank, pooling {cfg.pooling}, SUM{', weighted' if cfg.weighted else ''}, {ranks}, "
        f"{cfg.steps} steps each in {cfg.blocks} alternating blocks, "
        f"{datetime.date.today().isoformat()}, {len(cfg.cores)} of {os.cpu_count()} cores; "
        f"ours' fused column pieces: column_wise_statistic={cfg.cw_statistic!r}\n"
    )
    print("| plan | optimizer | ours ms | ours + prefetch ms | TorchRec ms | TorchRec pipeline ms | "
          "ours / TorchRec | ours + prefetch / TorchRec | ours + prefetch / TorchRec pipeline | "
          "floor ms | unsharded ms | dense part ms | ours / (floor + dense) | "
          "ours + prefetch / (floor + dense) | comm ms |")  # fmt: skip
    print("|---|---|" + "---:|" * 13)
    med = statistics.median

    def ms(t: dict, name: str) -> str:
        return f"{med(t[name]) * 1e3:.1f}" if name in t else "n/a"

    def ratio(t: dict, a: str, b: str) -> str:
        return f"{med(t[a]) / med(t[b]):.2f}" if a in t and b in t else "n/a"

    def over_bound(t: dict, a: str) -> str:
        if a not in t or "floor" not in t or "dense" not in t:
            return "n/a"
        return f"{med(t[a]) / (med(t['floor']) + med(t['dense'])):.2f}"

    for (plan, opt_kind), r in results.items():
        t = r["times"]
        cells = [
            PLANS[plan], opt_kind, ms(t, "ours"), ms(t, "prefetch"), ms(t, "torchrec"),
            ms(t, "pipeline"), ratio(t, "ours", "torchrec"), ratio(t, "prefetch", "torchrec"),
            ratio(t, "prefetch", "pipeline"), ms(t, "floor"), ms(t, "unsharded"),
            f"{med(t['dense']) * 1e3:.2f}" if "dense" in t else "n/a",
            over_bound(t, "ours"), over_bound(t, "prefetch"), ms(t, "comm"),
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    for (plan, opt_kind), r in results.items():
        for name, why in r["notes"].items():
            print(f"\n{PLANS[plan]}/{opt_kind}: {name} not run: {why}")
    device_name = torch.cuda.get_device_name() if cfg.device == "cuda" else None
    print()
    for (plan, opt_kind), r in results.items():
        if r.get("floor_bytes") is not None:
            seconds = med(r["times"]["floor"])
            print(bandwidth_line(f"{plan}/{opt_kind}", r["floor_bytes"], seconds, device_name))
    for line in _target_lines(cfg, results):
        print(line)
    for line in _overhead_lines(results):
        print(line)


OVERHEAD_TARGET = 0.5  # issue 29: (ours - floor - dense) <= 0.5 x (TorchRec - floor - dense)


def _overhead_lines(results: dict) -> list[str]:
    """Issue 29's restated target for this one run (benchmarks/step_targets.py takes the median
    over separate runs, which is what counts)."""
    med = statistics.median
    lines = []
    for contender, theirs, label in (("ours", "torchrec", "ours"), ("prefetch", "pipeline", "ours + prefetch")):
        met, missed = [], []
        for (plan, opt_kind), r in results.items():
            t = r["times"]
            if not all(k in t for k in (contender, theirs, "floor", "dense")):
                continue
            base = med(t["floor"]) + med(t["dense"])
            if med(t[theirs]) <= base:
                continue
            value = (med(t[contender]) - base) / (med(t[theirs]) - base)
            (met if value <= OVERHEAD_TARGET else missed).append(f"{plan}/{opt_kind} {value:.2f}")
        if met or missed:
            lines.append(
                f"target overhead ({label} - floor - dense) / ({'TorchRec' if theirs == 'torchrec' else 'TorchRec pipeline'}"
                f" - floor - dense) <= {OVERHEAD_TARGET}: met by {len(met)} of {len(met) + len(missed)}"
                + (f"; not by {', '.join(missed)}" if missed else "")
            )
    return lines


# Issue 7's targets: ours / TorchRec <= 0.8 for every case; ours / (floor + dense) <= 1.5 on 2 ranks.
TORCHREC_TARGET, FLOOR_TARGET = 0.8, 1.5


def _target_lines(cfg: Config, results: dict) -> list[str]:
    """Which cases of this run meet each target, for ours and ours + prefetch (medians)."""
    med = statistics.median
    checks = [("ours / TorchRec", TORCHREC_TARGET, lambda t: med(t["torchrec"]) if "torchrec" in t else None)]
    if cfg.world_size == 2:
        checks.append(
            ("ours / (floor + dense)", FLOOR_TARGET,
             lambda t: med(t["floor"]) + med(t["dense"]) if "floor" in t and "dense" in t else None)
        )  # fmt: skip
    lines = []
    for what, target, denominator in checks:
        for contender, label in (("ours", "ours"), ("prefetch", "ours + prefetch")):
            met, missed = [], []
            for (plan, opt_kind), r in results.items():
                t = r["times"]
                d = denominator(t)
                if d is None or contender not in t:  # a contender that did not run
                    continue
                value = med(t[contender]) / d
                (met if value <= target else missed).append(f"{plan}/{opt_kind} {value:.2f}")
            if met or missed:
                lines.append(
                    f"target {what.replace('ours', label, 1)} <= {target}: met by {len(met)} of "
                    f"{len(met) + len(missed)}" + (f"; not by {', '.join(missed)}" if missed else "")
                )
    return lines


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender")
    p.add_argument("--blocks", type=int, default=4, help="alternating blocks the steps are split in")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", default=None, help="plan:optimizer to profile ours on, e.g. rw:fused")
    p.add_argument("--no-torchrec", action="store_true")
    p.add_argument("--no-pin", action="store_true", help="let the OS move ranks between cores")
    p.add_argument("--cpu", action="store_true", help="print each sharded contender's CPU per step by thread kind")
    add_device_args(p)
    p.add_argument("--only", choices=CONTENDERS, default=None,
                   help="time this contender alone, one block, no summary: for perf or py-spy "
                        "(e.g. --only ours --steps 1500 --blocks 1)")  # fmt: skip
    p.add_argument("--weighted", action="store_true",
                   help="a weight per id (an EBC with is_weighted=True, SUM of weight x row)")
    p.add_argument("--cw-statistic", choices=["exact", "per_shard"], default="exact",
                   help="ours' row statistic on fused column pieces (fuse_optimizer's "
                        "column_wise_statistic); per_shard is TorchRec's approximation")  # fmt: skip
    a = p.parse_args(argv)
    check_device_args(p, a)
    cfg = Config(
        **workload_fields(a), weighted=a.weighted, optimizers=tuple(a.optimizers),
        profile=a.profile, torchrec=not a.no_torchrec, pin=not a.no_pin and a.device == "cpu",
        cpu=a.cpu, device=a.device, cuda_backend=a.cuda_backend, cw_statistic=a.cw_statistic,
        only=a.only,
        cores=tuple(sorted(os.sched_getaffinity(0))),
    )  # fmt: skip
    with hosted_rendezvous() as rendezvous:
        mp.spawn(_worker, args=(cfg, rendezvous), nprocs=cfg.world_size, join=True)


if __name__ == "__main__":
    main()
