"""Which kernels a fused EmbeddingCollection looks its sequences up with (Note [sequence lookups]
in modular/sequence/lookup.py): the plain fused kernel is fbgemm's PoolingMode.NONE (one row per
id, no padding) on CUDA, grouped by width, and bags of one on CPU, where NONE is slower; the
deferred kernels keep bags of one. The NONE cases switch it on for CPU
(`SEQUENCE_KERNEL_DEVICES`), so its parity is held here too. Each case trains 3 steps
on batches that repeat ids (within a sequence, across samples, features and ranks) and matches
the unsharded EmbeddingCollection trained with the torch equivalent."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
import modular.fused.fbgemm as fused_kernels
from modular.fused.deferred import RowStatsFusedKernel
from modular.fused.fbgemm import FusedKernel
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.compare import close, local_blocks
from tests.modular.fused_reference import FUSED_EPS as EPS, FUSED_LR as LR, FusedReference
from tests.modular.sequence_cases import seq_global_batch

OPTIMIZERS = ("exact_sgd", "exact_adagrad", "exact_rowwise_adagrad")
STEPS, DIM = 3, 12


def _ec() -> EmbeddingCollection:
    torch.manual_seed(0)
    tables = [
        EmbeddingConfig(name="goods", num_embeddings=10, embedding_dim=DIM, feature_names=["item", "hist"]),
        EmbeddingConfig(name="cats", num_embeddings=6, embedding_dim=DIM, feature_names=["cat"]),
    ]  # fmt: skip
    return EmbeddingCollection(tables=tables)


def _batch(rank: int, step: int) -> KeyedJaggedTensor:
    """3 samples; id 3 of 'goods' repeats within a sequence, across samples, across the two
    features that read 'goods' and across ranks; one sequence is empty."""
    items = [3, 3, 1, 3, 3 + step, 2 * rank]
    hist = [3, 7, 3]
    cats = [5, 5, 0, rank + step]
    lengths = [3, 0, 3, 1, 2, 0, 2, 1, 1]
    return KeyedJaggedTensor(
        keys=["item", "hist", "cat"],
        values=torch.tensor(items + hist + cats),
        lengths=torch.tensor(lengths),
    )


def _loss(rows: torch.Tensor) -> torch.Tensor:
    """Weighs every element of one rank's rows of a feature differently."""
    return (rows * (1 + torch.arange(rows.numel()).view_as(rows) % 5)).sum()


def _kernels(ec) -> list[tuple[str, bool, tuple[int, ...]]]:
    """(kernel class, pooling mode is NONE, shard widths) of each of `ec`'s kernels."""
    return [
        (type(k).__name__, k.tbe.pooling_mode == PoolingMode.NONE and k.nobag, tuple(c for _, c in k.sizes))
        for k in (*ec._kernels, *ec._local_kernels)
    ]  # fmt: skip


def _train(kind: str, plan: ShardingPlan | None, nobag_on_cpu: bool = True) -> tuple[list, float]:
    """3 steps of `kind` on a fused EC (sharded by `plan`, or one process), compared with the
    reference on the global batch; its kernels and the largest difference seen. `nobag_on_cpu`:
    build the CPU kernels with fbgemm's NONE kernel, as on CUDA."""
    devices = fused_kernels.SEQUENCE_KERNEL_DEVICES
    if nobag_on_cpu:
        fused_kernels.SEQUENCE_KERNEL_DEVICES = devices | {"cpu"}
    try:
        return _train_on(kind, plan)
    finally:
        fused_kernels.SEQUENCE_KERNEL_DEVICES = devices


def _train_on(kind: str, plan: ShardingPlan | None) -> tuple[list, float]:
    world = 1 if plan is None else dist.get_world_size()
    rank = 0 if plan is None else dist.get_rank()
    ref = _ec()
    model = torch.nn.ModuleDict({"ec": copy.deepcopy(ref)})
    modular.fuse_optimizer(model, kind, lr=LR, eps=EPS)
    if plan is not None:
        modular.shard(model, plan)
    reference = FusedReference(ref, kind)
    worst = 0.0
    for step in range(STEPS):
        batches = [_batch(r, step) for r in range(world)]
        out = model["ec"](batches[rank])
        want = ref(seq_global_batch(batches))
        loss, ref_loss = torch.zeros(()), torch.zeros(())
        for key, jt in want.items():
            n = [int(b[key].lengths().sum()) for b in batches]
            per_rank = jt.values().split(n)  # the global batch holds the ranks' rows in order
            what = f"{kind}, rank {rank}: step {step} rows of {key}"
            worst = max(worst, close(out[key].values(), per_rank[rank], what))
            loss = loss + _loss(out[key].values())
            # Each rank's loss on its own rows; the reference's is their mean over ranks.
            ref_loss = ref_loss + sum(_loss(rows) for rows in per_rank) / world
        loss.backward()
        ref_loss.backward()
        reference.step()
    params = dict(ref.named_parameters())
    for name, param in model["ec"].named_parameters():
        for tensor, rows, cols in local_blocks(param):
            what = f"{kind}, rank {rank}: {name}[{rows}, {cols}] after {STEPS} steps"
            worst = max(worst, close(tensor.detach(), params[name].detach()[rows, cols], what))
    return _kernels(model["ec"]), worst


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_a_fused_ec_looks_sequences_up_with_fbgemms_none_kernel(kind: str) -> None:
    kernels, worst = _train(kind, None)
    # One kernel for both tables (one width), fbgemm's sequence kernel, not bags of one.
    assert kernels == [("FusedKernel", True, (DIM, DIM))], kernels
    assert worst <= 1e-5


@pytest.mark.timeout(120)
def test_on_cpu_a_fused_ec_keeps_bags_of_one_by_default() -> None:
    assert fused_kernels.SEQUENCE_KERNEL_DEVICES == frozenset({"cuda"})
    kernels, worst = _train("exact_rowwise_adagrad", None, nobag_on_cpu=False)
    assert kernels == [("FusedKernel", False, (DIM, DIM))], kernels
    assert worst <= 1e-5


def _column_pieces(kind: str) -> tuple[list, float]:
    plan = ShardingPlan(
        world_size=2,
        modules={
            "ec": {
                # Two column pieces of unequal widths on rank 0: a kernel per width, narrowest first.
                "goods": TablePlacement(ShardingType.COLUMN_WISE, ranks=(0, 0), sizes=(8, 4)),
                "cats": TablePlacement(ShardingType.TABLE_WISE, ranks=(1,)),
            }
        },
    )
    return _train(kind, plan)


@pytest.mark.timeout(300)
def test_sequence_kernels_take_one_width_and_deferred_ones_keep_bags() -> None:
    for kind in OPTIMIZERS:
        rank0, rank1 = run_on_ranks(2, _column_pieces, kind, timeout=150)
        # Row-wise Adagrad exchanges the column pieces' row statistics: fbgemm's SUM backward
        # replayed (RowStatsFusedKernel), so bags of one; the other optimizers take NONE.
        pieces = "RowStatsFusedKernel" if kind == "exact_rowwise_adagrad" else "FusedKernel"
        nobag = pieces == "FusedKernel"
        assert rank0[0] == [(pieces, nobag, (4,)), (pieces, nobag, (8,))], (kind, rank0[0])
        assert rank1[0] == [("FusedKernel", True, (DIM,))], (kind, rank1[0])
        assert max(rank0[1], rank1[1]) <= 1e-5, (kind, rank0[1], rank1[1])
    assert RowStatsFusedKernel.replays_sum_backward and not FusedKernel.replays_sum_backward
