"""`modular.reshard`: training across a reshard equals the unsharded reference on the global batch.

Each EBC body walks one chain of plans through every ordered pair of the five sharding types (an
Eulerian circuit of the complete directed graph, so each pair is one reshard), then through a
change in the number of column pieces and the `mixed` plan: 2 steps before the first reshard and
3 after each, checking outputs every step and every weight (and the fused optimizer's state) after
every reshard against the reference, which never reshards. Fused (exact_rowwise_adagrad,
exact_adagrad) and unfused (SGD over `local_parameters`, rebuilt after each reshard: the old one
must refuse to step) at worlds 2 and 3; an EmbeddingCollection case; a DTensor case under DDP and
FSDP2; the bytes on the wire; and the faults (a rank failing mid-reshard, a failed collective, a
plan that does not fit), after which every rank's old module trains on exactly.
"""

from __future__ import annotations

import contextlib
import copy
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import modular
from modular.resharding import exchange as reshard_exchange
from modular.resharding import moves as reshard_moves
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.compare import close, full_value, local_blocks, state_error
from tests.modular.dlrm_cases import (
    DLRM, DLRM_LR, dlrm_batch, global_dlrm_batch, loss_of, mixed_plan,
)  # fmt: skip
from tests.modular.ebc_cases import global_batch, make_batch, make_ebc, placements_for
from tests.modular.fused_reference import FUSED_EPS, FUSED_LR, FusedReference, fused_ebc
from tests.modular.sequence_cases import (
    SEQ_FEATURES, make_seq_model, seq_global_batch, seq_plan_for, seq_rank_batches,
)  # fmt: skip

TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
LR = 0.3
TIMEOUT = 240.0


def _circuit(kinds: tuple[str, ...]) -> list[str]:
    """Plans in an order that reshards once between every ordered pair of distinct `kinds`
    (Hierholzer's circuit of the complete directed graph), starting and ending at kinds[0]."""
    left = {a: [b for b in reversed(kinds) if b != a] for a in kinds}
    stack, out = [kinds[0]], []
    while stack:
        if left[stack[-1]]:
            stack.append(left[stack[-1]].pop())
        else:
            out.append(stack.pop())
    return out[::-1]


def _placements(case: str, ebc: nn.Module, world: int) -> dict[str, TablePlacement]:
    if case == "column_pieces":  # world + 1 column pieces, the last rank two: another count
        names = [c.name for c in ebc.embedding_bag_configs()]
        ranks = (world - 1, *range(world))
        return {n: TablePlacement(ShardingType.COLUMN_WISE, ranks=ranks) for n in names}
    return placements_for(case, ebc, world)


def _chain() -> list[str]:
    return [*_circuit(TYPES), "column_pieces", "column_wise", "mixed"]


def _batch(ref: nn.Module, step: int, rank: int):
    return make_batch(ref, seed=1000 * step + rank)


def _step(model, ref, step: int, world: int, rank: int, what: str, mine=None):
    """One forward on this rank's batch (`mine`: the same batch, an object prefetched before) and
    the reference's on the global batch; their losses."""
    batches = [_batch(ref, step, r) for r in range(world)]
    out = model(batches[rank] if mine is None else mine).values()
    return _losses(out, ref(global_batch(batches)).values(), step, world, rank, what)


def _losses(out, expected, step: int, world: int, rank: int, what: str):
    mine = slice(rank * out.shape[0], (rank + 1) * out.shape[0])
    close(out, expected[mine], f"{what}: output")
    target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step))
    return (out * target[mine]).sum(), (expected * target).sum() / world


def _check_weights(model: nn.Module, ref: nn.Module, what: str) -> None:
    refs = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert names == list(refs), f"{what}: parameter names {names} != {list(refs)}"
    for name, p in model.named_parameters():
        for tensor, rows, cols in local_blocks(p):
            close(tensor.detach(), refs[name].detach()[rows, cols], f"{what}: {name}")


def _ebc_chain(optimizer: str | None, prefetch: bool = False) -> int:
    """Trains the chain of plans (module docstring); returns how many reshards it checked."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ebc = fused_ebc() if optimizer else make_ebc(False)
    chain = _chain()
    if optimizer:
        ref = FusedReference(copy.deepcopy(ebc), optimizer)
        fused = modular.fuse_optimizer(ebc, optimizer, lr=FUSED_LR, eps=FUSED_EPS)
    else:
        ref = copy.deepcopy(ebc)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ref_module = ref.ebc if optimizer else ref
    model = modular.shard(ebc, ShardingPlan(world_size=world, modules={"": _placements(chain[0], ebc, world)}))
    opt = None if optimizer else torch.optim.SGD(modular.local_parameters(model), lr=LR)
    step, prefetched = 0, None
    for i, case in enumerate(chain):
        what = f"rank {rank}/{world} {optimizer or 'sgd'}: {chain[i - 1] if i else ''} -> {case}"
        for s in range(2 if i == 0 else 3):
            mine, prefetched = prefetched, None
            if prefetch and i == 0 and s == 1:  # the next batch, prefetched under the old layout
                prefetched = _batch(ref_module, step + 1, rank)
                modular.prefetch(model, prefetched)
            loss, ref_loss = _step(model, ref_module, step, world, rank, f"{what}, step {step}", mine)
            loss.backward()
            ref_loss.backward()
            (fused if optimizer else opt).step()
            (ref if optimizer else ref_opt).step()
            if not optimizer:
                opt.zero_grad()
                ref_opt.zero_grad()
            step += 1
        if i + 1 == len(chain):
            break
        plan = ShardingPlan(world_size=world, modules={"": _placements(chain[i + 1], ebc, world)})
        if prefetch and i == 0:
            assert model._prefetcher is not None and model._prefetcher._pending, "nothing prefetched"
        assert modular.reshard(model, plan) is model
        if prefetch and i == 0:  # dropped: the next forward runs its input dist on the new layout
            assert model._prefetcher is None, "reshard kept the old layout's prefetched batch"
        _check_weights(model, ref_module, f"{what} -> {chain[i + 1]}, after the reshard")
        if optimizer:
            state = fused.state_dict()["state"]
            for name in state:
                for key, got in state[name].items():
                    state_error(got, ref.state(name), f"{what}: state {key} of {name}")
        else:
            with pytest.raises(TypeError, match=r"modular\.reshard has since rebuilt .* Rebuild the optimizer"):
                opt.step()
            opt = torch.optim.SGD(modular.local_parameters(model), lr=LR)
    return len(chain) - 1


@pytest.mark.parametrize("world", [2, 3])
def test_training_across_every_pair_of_sharding_types(world: int) -> None:
    """Unfused (SGD, its optimizer rebuilt after each reshard) and fused with both Adagrads."""
    pairs = len(TYPES) * (len(TYPES) - 1)
    for optimizer in (None, "exact_rowwise_adagrad", "exact_adagrad"):
        done = run_on_ranks(world, _ebc_chain, optimizer, prefetch=optimizer is None, timeout=TIMEOUT)
        assert done == [pairs + 3] * world
