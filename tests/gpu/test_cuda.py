"""CUDA: sharded tables on a GPU train like the unsharded EBC on the same GPU.

Skipped where torch sees no CUDA device (CI). On a machine with one, run::

    python -m pytest tests/gpu -q

Each world size runs in freshly spawned ranks (CUDA cannot be forked into): NCCL with one GPU per
rank where there are enough GPUs, else gloo with every rank on GPU 0 (gloo moves CUDA tensors
through host memory, NCCL refuses two ranks on one GPU). `MODULAR_GPU_TEST_DEVICE=cpu` runs the
same bodies on CPU gloo ranks, to check this file itself on a machine with no GPU.

The bodies are those of tests/modular/fused/test_fused.py with the device made explicit and widths of
16 and 32 (off CPU every shard must be a multiple of 4 columns: `check_widths_off_cpu` in
modular/tables/weights.py): fbgemm's CUDA kernels (fused SGD, Adagrad, row-wise Adagrad; dense
gradients), the torch emulation of column pieces under row-wise Adagrad and of data-parallel
copies (which must stay identical on every rank: CUDA's atomic adds make sums
order-dependent), prefetch and a checkpoint round trip, against a torch reference in the same
rank; column pieces also with column_wise_statistic="per_shard".
Run on an H100 on 2026-11-22 (docs/gpu.md: torch 2.11, fbgemm-gpu 1.6.0, torchrec 1.6.1; world 1
over NCCL, world 2 over gloo on the one GPU): 15 passed in 239 s. On CPU they take about 90 s;
writing them found the interleaved kernel routes fixed in modular/tables/layout.py `build_layout`.
"""

from __future__ import annotations

import copy
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch.distributed._shard.sharded_tensor import ShardedTensor

from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import modular
from examples.ports import free_port
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.modular.compare import local_blocks, state_error
from tests.modular.ebc_cases import CASES, global_batch, make_batch, placements_for
from tests.modular.fused_reference import FUSED_EPS as EPS, FUSED_LR as LR, FUSED_STEPS as STEPS
from tests.modular.fused_reference import FusedReference, fused_tables, own_pieces

DEVICE_KIND = os.environ.get("MODULAR_GPU_TEST_DEVICE", "cuda")
ATOL = 1e-4  # GPU reductions reorder sums; the CPU tests hold 1e-5
SPAWN_TIMEOUT_S = 600.0

pytestmark = pytest.mark.skipif(
    DEVICE_KIND == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
)


# -- ranks ---------------------------------------------------------------------------------------


def _backend(world: int) -> str:
    if DEVICE_KIND == "cuda" and torch.cuda.device_count() >= world:
        return "nccl"
    return "gloo"


def _device(rank: int) -> torch.device:
    if DEVICE_KIND != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def _entry(rank: int, world: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    device = _device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(_backend(world), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result: Any = ("ok", fn(device, *args))
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which raises)
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    if result[0] == "ok":
        dist.barrier()
    dist.destroy_process_group()


def run_spawned(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """`fn(device, *args)` on `world` fresh ranks; its per-rank results, or the ranks' errors."""
    with tempfile.TemporaryDirectory() as out:
        ctx = tmp.start_processes(
            _entry, args=(world, free_port(), out, fn, args), nprocs=world, join=False, start_method="spawn"
        )
        try:
            while not ctx.join(timeout=SPAWN_TIMEOUT_S):
                pass
        except Exception:
            for p in ctx.processes:
                p.kill()
            raise
        results = [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]
    errors = [f"rank {r}: {msg}" for r, (kind, msg) in enumerate(results) if kind == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [value for _, value in results]


# -- bodies ----------------------------------------------------------------------------------------


def _ebc(weighted: bool = False, dims: tuple[int, ...] = (16, 32, 16, 32)) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=c.name, num_embeddings=c.num_embeddings, embedding_dim=dim,
                           feature_names=c.feature_names, pooling=PoolingType.SUM if weighted else c.pooling)
        for c, dim in zip(fused_tables(), dims)
    ]  # fmt: skip
    return EmbeddingBagCollection(tables=tables, is_weighted=weighted)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    assert actual.device == expected.device, f"{what}: on {actual.device}, expected {expected.device}"
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0, msg=lambda m: f"{what}: {m}")
    return float((actual - expected).detach().abs().max()) if expected.numel() else 0.0


def _train(device: torch.device, case: str, optimizer: str, placements: dict | None = None,
           weighted: bool = False, prefetch: bool = False, checkpoint: str | None = None,
           statistic: str = "exact") -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    ebc = _ebc(weighted)
    plan = ShardingPlan(world_size=world, modules={"": placements or placements_for(case, ebc, world)})
    pieces = own_pieces(plan, ebc) if statistic == "per_shard" else None
    ref = FusedReference(copy.deepcopy(ebc).to(device), optimizer.replace("dense_", "exact_"), device=device,
                     pieces=pieces)
    if not optimizer.startswith("dense_"):  # fused before shard (Note [order of sharding calls])
        opt = modular.fuse_optimizer(ebc, optimizer, lr=LR, eps=EPS, column_wise_statistic=statistic)
    model = modular.shard(ebc, plan, device=device)
    if optimizer.startswith("dense_"):
        params = modular.local_parameters(model)
        opt = torch.optim.SGD(params, lr=LR) if optimizer == "dense_sgd" else torch.optim.Adagrad(params, lr=LR, eps=EPS)
    kernels = sorted({type(k).__name__ for k in (*model._kernels, *model._local_kernels)})
    every = [[make_batch(ebc, seed=1000 * step + r).to(device) for r in range(world)] for step in range(STEPS)]
    if prefetch:
        modular.prefetch(model, every[0][rank])
    worst = 0.0
    for step in range(STEPS):
        batches = every[step]
        if prefetch and step + 1 < STEPS:
            modular.prefetch(model, every[step + 1][rank])
        out = model(batches[rank]).values()
        assert out.device == device, f"pooled output on {out.device}, expected {device}"
        expected = ref.ebc(global_batch(batches)).values()
        target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step)).to(device)
        mine = slice(rank * out.shape[0], (rank + 1) * out.shape[0])
        worst = max(worst, _close(out, expected[mine], f"{case} step {step} output"))
        (out * target[mine]).sum().backward()
        ((expected * target).sum() / world).backward()
        opt.step()
        opt.zero_grad()
        ref.step()
        if checkpoint is not None and step == 1:  # save, train on, then load: back to step 1's state
            modular.checkpoint.save(checkpoint, model, opt)
            saved = {n: [t.clone() for t, _, _ in local_blocks(p)] for n, p in model.named_parameters()}
    for name, p in model.named_parameters():  # data-parallel copies: the same bits on every rank
        if not isinstance(p, ShardedTensor) and world > 1:
            copies = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(copies, p.detach().contiguous())
            assert all(torch.equal(c, copies[0]) for c in copies), f"{name}: copies differ across ranks"
    full = dict(ref.ebc.named_parameters())
    state = opt.state_dict()["state"] if not optimizer.startswith("dense_") else {}
    for name, p in model.named_parameters():
        for tensor, rows, cols in local_blocks(p):
            assert tensor.device == device, f"{name}: a local shard on {tensor.device}, expected {device}"
            worst = max(worst, _close(tensor, full[name].detach()[rows, cols], f"{case} {name} weight"))
        want = ref.state(name)
        if want is None or optimizer.startswith("dense_"):
            continue
        worst = max(worst, state_error(next(iter(state[name].values())), want, f"{case} {name} state", _close))
    if checkpoint is not None:
        modular.checkpoint.load(checkpoint, model, opt)
        for name, p in model.named_parameters():
            for (tensor, _, _), before in zip(local_blocks(p), saved[name]):
                assert torch.equal(tensor, before), f"{name}: loading the checkpoint did not restore it"
    return {"worst": worst, "kernels": kernels}


def _all_cases(device: torch.device, optimizer: str) -> dict[str, Any]:
    return {case: _train(device, case, optimizer) for case in CASES}


def _column_pieces_on_one_rank(device: torch.device) -> dict[str, Any]:
    """Two column pieces of each table on every rank: the row statistics of row-wise Adagrad,
    exact (summed over the pieces) and per piece (column_wise_statistic="per_shard")."""
    ebc = _ebc()
    world = dist.get_world_size()
    ranks = tuple(r for r in range(world) for _ in range(2))
    placements = {c.name: TablePlacement(ShardingType.COLUMN_WISE, ranks=ranks) for c in ebc.embedding_bag_configs()}
    return {
        statistic: _train(device, "column_wise", "exact_rowwise_adagrad", placements=placements,
                          statistic=statistic)
        for statistic in ("exact", "per_shard")
    }


def _extras(device: torch.device, checkpoint_dir: str) -> dict[str, Any]:
    return {
        "weighted": _train(device, "column_wise", "exact_rowwise_adagrad", weighted=True),
        "prefetch": _train(device, "mixed", "exact_rowwise_adagrad", prefetch=True),
        "checkpoint": _train(device, "mixed", "exact_adagrad", checkpoint=checkpoint_dir),
    }


# -- tests ---------------------------------------------------------------------------------------

WORLDS = (1, 2)
OPTIMIZERS = ("dense_sgd", "dense_adagrad", "exact_sgd", "exact_adagrad", "exact_rowwise_adagrad")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_plan_trains_like_the_unsharded_ebc_on_the_device(world: int, optimizer: str) -> None:
    results = run_spawned(world, _all_cases, optimizer)
    for case in CASES:
        assert results[0][case]["worst"] <= ATOL
    kernels = {k for r in results for case in CASES for k in r[case]["kernels"]}
    assert kernels, "no kernel ran"


@pytest.mark.parametrize("world", WORLDS)
def test_column_pieces_under_rowwise_adagrad_on_the_device(world: int) -> None:
    results = run_spawned(world, _column_pieces_on_one_rank)
    assert all(r[statistic]["worst"] <= ATOL for r in results for statistic in ("exact", "per_shard"))
    # per piece, each piece is a plain fused kernel; exact needs the two-pass (or emulated) one
    assert all("RowStatsFusedKernel" not in r["per_shard"]["kernels"] for r in results), results


@pytest.mark.parametrize("world", WORLDS)
def test_weighted_prefetched_and_checkpointed_training_on_the_device(world: int, tmp_path: Path) -> None:
    results = run_spawned(world, _extras, str(tmp_path / "ckpt"))
    assert all(v["worst"] <= ATOL for r in results for v in r.values())


def _odd_width(device: torch.device) -> str:
    ebc = _ebc(dims=(16, 7, 16, 32))
    plan = ShardingPlan(world_size=dist.get_world_size(), modules={"": placements_for("table_wise", ebc, dist.get_world_size())})
    try:
        modular.shard(ebc, plan, device=device)
    except modular.ShardingError as e:
        return str(e)
    return "sharded"


@pytest.mark.skipif(DEVICE_KIND != "cuda", reason="CPU kernels take any width")
def test_a_width_fbgemm_cannot_take_is_refused_on_the_device() -> None:
    for message in run_spawned(2, _odd_width):
        assert "table 't_mean' of module '' has shards [7] columns wide" in message, message



def _host_syncs_per_forward(device: torch.device, case: str) -> int:
    """Host syncs of one forward after warm-up (Note [host syncs per step]), on tables of one
    row count (features of different row counts may need one more read)."""
    import warnings

    world, rank = dist.get_world_size(), dist.get_rank()
    configs = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=64, embedding_dim=16,
                                  feature_names=[f"f{i}"]) for i in range(4)]  # fmt: skip
    ebc = EmbeddingBagCollection(tables=configs)
    plan = ShardingPlan(world_size=world, modules={"": placements_for(case, ebc, world)})
    modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=LR, eps=EPS)  # before shard
    model = modular.shard(ebc, plan, device=device)
    batch = make_batch(ebc, seed=rank).to(device)
    for _ in range(2):
        model(batch).values().sum().backward()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model(batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # (set_sync_debug_mode itself warns that it is a prototype: not a sync)
    return sum(str(w.message).startswith("called a synchronizing") for w in caught)


@pytest.mark.skipif(DEVICE_KIND != "cuda", reason="counts CUDA host syncs")
@pytest.mark.parametrize("case", ["table_wise", "row_wise"])
def test_a_forward_reads_the_device_once_in_a_world_of_one(case: str) -> None:
    # The checks' statistics, read in one transfer; a world of one needs no agreement (eight
    # reads before, one per check). TorchRec's forward makes two at any world size.
    assert run_spawned(1, _host_syncs_per_forward, case) == [1]
