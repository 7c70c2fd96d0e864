"""`modular.reshard`: training across a reshard equals the unsharded reference on the global batch.

Each EBC body walks one chain of plans through every ordered pair of the five sharding types (an
Eulerian circuit of the complete directed graph, so each pair is one reshard), then through a
change in the number of column pieces and the `mixed` plan: 2 steps before the first reshard and 3
after each, checking outputs every step and every weight (and the fused optimizer's state) after
every reshard against the reference, which never reshards. Fused (exact_rowwise_adagrad,
exact_adagrad) and unfused (SGD over `local_parameters`, rebuilt after each reshard: the old one
must refuse to step; a batch prefetched under the old layout is dropped) at worlds 2 and 3; the
Adam family's moments and step count; an EmbeddingCollection case; DTensor tables under DDP and
FSDP2; the bytes on the wire (one all-to-all per dtype); the peak memory against issue 39's bound,
and every value through the old shards' pages given back; a `state_dict()`, a view or the old
parameters held across a reshard, which keep their values (and warn); the blocks themselves (pure);
and the faults (a rank failing mid-reshard, a failed collective, plans that do not fit), after
which every rank's old module is intact and trains on exactly, and a rank failing past the commit.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
import warnings
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import modular
from modular.resharding import call as reshard_call
from modular.resharding import rounds as reshard_exchange
from modular.resharding import moves as reshard_moves
from modular.resharding import host_staging as reshard_staging
from modular.resharding.blocks import row_blocks, weight_blocks
from modular.tables.forms import Piece, dtype_of, is_sharded, local_pieces
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.adam_reference import (
    ADAM_BETAS, ADAM_EPS, ADAM_FAMILY, ADAM_LR, MomentsReference, touched_rows,
)  # fmt: skip
from tests.modular.compare import close, full_value, local_blocks, state_error
from tests.modular.dlrm_cases import (
    DLRM, DLRM_LR, MLP, dlrm_batch, global_dlrm_batch, loss_of, mixed_plan,
)  # fmt: skip
from tests.modular.ebc_cases import global_batch, make_batch, make_ebc, placements_for, unweighted_tables
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
    if case in ("one_before", "one_moved"):  # world 3, table-wise: one table moves from 0 to 1
        names = [c.name for c in ebc.embedding_bag_configs()]
        ranks = (2, 0, 0 if case == "one_before" else 1, 1)  # rank 2's table stays
        return {n: TablePlacement(ShardingType.TABLE_WISE, ranks=(r,)) for n, r in zip(names, ranks)}
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
    for name, p in model.named_parameters():  # ShardedTensor or DTensor tables, or data-parallel copies
        for piece in local_pieces(p) if is_sharded(p) else [Piece((0, 0), tuple(p.shape), p)]:
            (r0, c0), (nr, nc) = piece.offsets, piece.sizes
            close(piece.tensor.detach(), refs[name].detach()[r0 : r0 + nr, c0 : c0 + nc], f"{what}: {name}")


class _Reference:
    """The unsharded EBC trained on the global batch by the torch twin of `optimizer` (None:
    SGD); it never reshards."""

    def __init__(self, ebc: nn.Module, optimizer: str | None) -> None:
        self.module, self.optimizer = copy.deepcopy(ebc), optimizer
        if optimizer is None:
            self.opt = torch.optim.SGD(self.module.parameters(), lr=LR)
        elif optimizer in ADAM_FAMILY:
            self.moments = MomentsReference(self.module, optimizer)
        else:
            self.fused = FusedReference(self.module, optimizer)

    def step(self, batches: list) -> None:
        if self.optimizer is None:
            self.opt.step()
            self.opt.zero_grad()
        elif self.optimizer in ADAM_FAMILY:
            self.moments.step(touched_rows(self.module, batches))
        else:
            self.fused.step()

    def state(self, name: str) -> dict[str, torch.Tensor]:
        if self.optimizer in ADAM_FAMILY:
            return {**self.moments.state(name), "step": torch.tensor(self.moments.steps)}
        key = "sum" if self.optimizer == "exact_adagrad" else "row_sum"
        return {key: self.fused.state(name)}


def _fuse(ebc: nn.Module, optimizer: str):
    if optimizer in ADAM_FAMILY:
        return modular.fuse_optimizer(ebc, optimizer, lr=ADAM_LR, betas=ADAM_BETAS, eps=ADAM_EPS)
    return modular.fuse_optimizer(ebc, optimizer, lr=FUSED_LR, eps=FUSED_EPS)


def _ebc_chain(optimizer: str | None, chain: list[str], prefetch: bool = False) -> int:
    """Trains `chain`'s plans in turn (module docstring); returns how many reshards it checked."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ebc = fused_ebc() if optimizer else make_ebc(False)
    ref = _Reference(ebc, optimizer)
    fused = _fuse(ebc, optimizer) if optimizer else None
    model = modular.shard(ebc, ShardingPlan(world_size=world, modules={"": _placements(chain[0], ebc, world)}))
    opt = fused or torch.optim.SGD(modular.local_parameters(model), lr=LR)
    step, prefetched = 0, None
    for i, case in enumerate(chain):
        what = f"rank {rank}/{world} {optimizer or 'sgd'}: {chain[i - 1] if i else ''} -> {case}"
        for s in range(2 if i == 0 else 3):
            mine, prefetched = prefetched, None
            if prefetch and i == 0 and s == 1:  # the next batch, prefetched under the old layout
                prefetched = _batch(ref.module, step + 1, rank)
                modular.prefetch(model, prefetched)
            loss, ref_loss = _step(model, ref.module, step, world, rank, f"{what}, step {step}", mine)
            loss.backward()
            ref_loss.backward()
            opt.step()
            opt.zero_grad()
            ref.step([_batch(ref.module, step, r) for r in range(world)])
            step += 1
        if i + 1 == len(chain):
            break
        plan = ShardingPlan(world_size=world, modules={"": _placements(chain[i + 1], ebc, world)})
        if prefetch and i == 0:
            assert model._prefetcher is not None and model._prefetcher._pending, "nothing prefetched"
        adopted = chain[i + 1] == "one_moved" and rank == world - 1  # its tables stay
        kernels = _kernel_storages(model) if adopted else None
        assert modular.reshard(model, plan) is model
        if adopted:  # the very kernels, on the same buffers (Note [reshard memory])
            assert _kernel_storages(model) == kernels, f"{what}: rank {rank}'s kernels were rebuilt"
        if prefetch and i == 0:  # dropped: the next forward runs its input dist on the new layout
            assert model._prefetcher is None, "reshard kept the old layout's prefetched batch"
        _check_weights(model, ref.module, f"{what} -> {chain[i + 1]}, after the reshard")
        if optimizer:
            state = fused.state_dict()["state"]
            for name in state:
                want = ref.state(name)
                assert sorted(state[name]) == sorted(want), f"{what}: state of {name}: {sorted(state[name])}"
                for key, got in state[name].items():
                    state_error(got, want[key], f"{what}: state {key} of {name}")
        else:
            with pytest.raises(TypeError, match=r"modular\.reshard has since rebuilt .* Rebuild the optimizer"):
                opt.step()
            opt = torch.optim.SGD(modular.local_parameters(model), lr=LR)
    return len(chain) - 1


def _kernel_storages(model: nn.Module) -> list:
    """This rank's kernels (ids) with the storages of their shards and optimizer state."""
    out = []
    for k in (*model._kernels, *model._local_kernels):
        ptrs = [v.untyped_storage().data_ptr() for v in k.views]
        ptrs += [t.untyped_storage().data_ptr() for st in getattr(k, "states", ()) for t in st.values()]
        out.append((id(k), ptrs))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_training_across_every_pair_of_sharding_types(world: int) -> None:
    """Unfused (SGD, its optimizer rebuilt after each reshard) and fused with both Adagrads. At
    world 3 the chain ends by moving one table from rank 0 to rank 1: rank 2 keeps its kernels,
    the same objects on the same buffers."""
    pairs = len(TYPES) * (len(TYPES) - 1)
    chain = _chain() + (["one_before", "one_moved"] if world == 3 else [])
    for optimizer in (None, "exact_rowwise_adagrad", "exact_adagrad"):
        done = run_on_ranks(world, _ebc_chain, optimizer, chain, prefetch=optimizer is None, timeout=TIMEOUT)
        assert done == [len(chain) - 1] * world
    assert pairs + 3 == len(_chain()) - 1


def test_adam_state_and_step_count_move() -> None:
    """partial_rowwise_lamb: `exp_avg` like the weights, `exp_avg_sq` per row, the whole rows'
    norms across column pieces, and the module's step count (bias correction) all follow."""
    chain = ["table_wise", "column_wise", "row_wise", "data_parallel", "column_pieces", "table_row_wise"]
    assert run_on_ranks(2, _ebc_chain, "partial_rowwise_lamb", chain, timeout=TIMEOUT) == [5, 5]


# -- the blocks (pure) ---------------------------------------------------------------------------


def _covers(region, spec) -> bool:
    (r0, r1), cols = region
    inside = spec.row_offset <= r0 and r1 <= spec.row_offset + spec.num_rows
    if cols is None:
        return inside
    return inside and spec.col_offset <= cols[0] and cols[1] <= spec.col_offset + spec.num_cols


def _overlaps(region, spec) -> bool:
    (r0, r1), cols = region
    rows = r0 < spec.row_offset + spec.num_rows and spec.row_offset < r1
    return rows and (cols is None or (cols[0] < spec.col_offset + spec.num_cols and spec.col_offset < cols[1]))


@pytest.mark.parametrize("world", [2, 3])
def test_blocks_fill_every_new_shard_once_and_send_only_what_changes_rank(world: int) -> None:
    """For every pair of the plans above and every table: each element of each new shard (each
    row of each per-row statistic) is written by exactly one block, read from an old shard that
    holds it, and a block travels only when its new rank holds none of it under the old plan."""
    ebc = make_ebc(False)
    configs = {c.name: c for c in ebc.embedding_bag_configs()}
    cases = (*TYPES, "column_pieces", "mixed")
    for a in cases:
        for b in cases:
            before, after = _placements(a, ebc, world), _placements(b, ebc, world)
            for t, (name, cfg) in enumerate(configs.items()):
                size = {"num_embeddings": cfg.num_embeddings, "embedding_dim": cfg.embedding_dim, "world_size": world}
                old, new = before[name].shards(**size), after[name].shards(**size)
                for blocks, rows_only in ((weight_blocks(t, old, new), False), (row_blocks(t, old, new, per_piece=False), True)):
                    written = [torch.zeros(n.num_rows, 1 if rows_only else n.num_cols) for n in new]
                    for blk in blocks:
                        region = (blk.rows, blk.cols)
                        assert old[blk.src_shard].rank == blk.src and _covers(region, old[blk.src_shard]), (a, b, name, blk)
                        if blk.moves:
                            assert not any(s.rank == blk.dst and _overlaps(region, s) for s in old), (a, b, name, blk)
                        for jn in blk.dst_shards:
                            n = new[jn]
                            assert n.rank == blk.dst and _covers(region, n), (a, b, name, blk)
                            r = slice(blk.rows[0] - n.row_offset, blk.rows[1] - n.row_offset)
                            c = slice(None) if rows_only else slice(blk.cols[0] - n.col_offset, blk.cols[1] - n.col_offset)
                            written[jn][r, c] += 1
                    for jn, w in enumerate(written):
                        assert bool((w == 1).all()), f"{a} -> {b}, {name} shard {jn}: written {w.unique().tolist()} times"


# -- an EmbeddingCollection ---------------------------------------------------------------------


def _seq_loss(outputs, targets, rows_of) -> torch.Tensor:
    seq_a, seq_b, bags = outputs
    total = (bags.values() * targets["bags"][rows_of("bags", None)]).sum()
    for name, out in (("seq_a", seq_a), ("seq_b", seq_b)):
        for key, jt in out.items():
            total = total + (jt.values() * targets[key][rows_of(name, key)]).sum()
    return total


def _ec_chain() -> int:
    """Two EmbeddingCollections (and an EBC whose plan never changes, so it is left alone)
    through a chain of plans, unfused, against the unsharded model."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chain = ["table_wise", "row_wise", "column_wise", "mixed", "data_parallel", "table_row_wise", "table_wise"]
    ref = make_seq_model()
    model = copy.deepcopy(ref)
    modular.shard(model, seq_plan_for(chain[0], world))
    opt = torch.optim.SGD(modular.local_parameters(model), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    step = 0
    for i, case in enumerate(chain):
        what = f"rank {rank}/{world}: {chain[i - 1] if i else ''} -> {case}"
        for _ in range(2 if i == 0 else 3):
            batches = seq_rank_batches(world, step)
            mine = batches[rank]
            out = model(*(mine[m] for m in SEQ_FEATURES))
            whole = {m: seq_global_batch([b[m] for b in batches]) for m in SEQ_FEATURES}
            expected = ref(*(whole[m] for m in SEQ_FEATURES))

            def rows_of(module: str, key, local: bool = True):
                if key is None:
                    return slice(rank * 3, (rank + 1) * 3) if local else slice(None)
                feature = key.split("@")[0]
                before = sum(int(b[module][feature].lengths().sum()) for b in batches[:rank])
                n = int(mine[module][feature].lengths().sum())
                return slice(before, before + n) if local else slice(None)

            for name, got, want in (("seq_a", out[0], expected[0]), ("seq_b", out[1], expected[1])):
                assert list(got) == list(want), f"{what}: {name} keys {list(got)}"
                for key in want:
                    close(got[key].values(), want[key].values()[rows_of(name, key)], f"{what} step {step} {name}[{key}]")
            g = torch.Generator().manual_seed(step)
            targets = {"bags": torch.randn(expected[2].values().shape, generator=g)}
            for exp in expected[:2]:
                for key, jt in exp.items():
                    targets[key] = torch.randn(jt.values().shape, generator=g)
            _seq_loss(out, targets, rows_of).backward()
            (_seq_loss(expected, targets, lambda m, k: rows_of(m, k, local=False)) / world).backward()
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
            step += 1
        if i + 1 == len(chain):
            break
        bags = model.bags
        modular.reshard(model, seq_plan_for(chain[i + 1], world))
        assert isinstance(model.seq_a, modular.ShardedEmbeddingCollection)
        assert model.bags is bags, f"{what}: the EBC's plan did not change, yet reshard rebuilt it"
        _check_weights(model, ref, f"{what} -> {chain[i + 1]}")
        with pytest.raises(TypeError, match=r"modular\.reshard"):
            opt.step()
        opt = torch.optim.SGD(modular.local_parameters(model), lr=LR)
    return len(chain) - 1


def test_embedding_collections_across_a_chain_of_plans() -> None:
    assert run_on_ranks(2, _ec_chain, timeout=TIMEOUT) == [6, 6]


# -- DTensor tables under DDP and FSDP2 ----------------------------------------------------------


def _dlrm_placements(case: str, world: int) -> dict[str, TablePlacement]:
    names = ("t_user", "t_item", "t_cat", "t_ctx")
    if case == "mixed":
        return dict(mixed_plan(world).modules["sparse"])
    if case == "table_wise":
        return {n: TablePlacement(ShardingType.TABLE_WISE, ranks=(i % world,)) for i, n in enumerate(names)}
    kind = {"row_wise": ShardingType.ROW_WISE, "column_wise": ShardingType.COLUMN_WISE,
            "data_parallel": ShardingType.DATA_PARALLEL}[case]  # fmt: skip
    return {n: TablePlacement(kind) for n in names}


def _check_dlrm_weights(model: nn.Module, ref: nn.Module, what: str) -> None:
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():  # the dense part collectively (FSDP's DTensors)
        if name.startswith("sparse."):
            for piece in local_pieces(p) if is_sharded(p) else [Piece((0, 0), tuple(p.shape), p)]:
                (r0, c0), (nr, nc) = piece.offsets, piece.sizes
                close(piece.tensor.detach(), refs[name].detach()[r0 : r0 + nr, c0 : c0 + nc], f"{what}: {name}")
        else:
            close(full_value(p), refs[name].detach(), f"{what}: {name}")


def _dlrm_dtensor(compose: str) -> int:
    """A DLRM whose tables are DTensors and whose MLPs are under DDP or FSDP2, resharded along a
    chain: the tables keep their form, the dense part its wrapper, and training its parity. A
    `state_dict()` held across the first reshard keeps its values (its old shards are kept whole,
    with a warning); the other reshards, with nothing held, warn of nothing."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = DLRM()
    model = copy.deepcopy(ref)
    chain = ["mixed", "table_wise", "row_wise", "data_parallel", "column_wise", "mixed"]
    modular.shard(model, ShardingPlan(world_size=world, modules={"sparse": _dlrm_placements(chain[0], world)}),
                  tensor_type="dtensor")  # fmt: skip
    if compose == "ddp":
        modular.apply_ddp(model)
    else:
        modular.apply_fully_shard(model, modules={MLP})
    dense = {n: p for n, p in model.named_parameters() if not n.startswith("sparse.")}
    opt = torch.optim.SGD(modular.local_parameters(model), lr=DLRM_LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=DLRM_LR)
    step = 0
    for i, case in enumerate(chain):
        what = f"rank {rank}/{world} {compose}: {chain[i - 1] if i else ''} -> {case}"
        for _ in range(2 if i == 0 else 3):
            batches = [dlrm_batch(step, r) for r in range(world)]
            loss = loss_of(model, batches[rank])
            ref_loss = loss_of(ref, global_dlrm_batch(batches))
            loss.backward()
            ref_loss.backward()
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
            step += 1
        _check_dlrm_weights(model, ref, what)  # its frame's views of the tables go with it
        if i + 1 == len(chain):
            break
        del opt, loss  # both hold the old shards (the loss through its graph): dropped, they are given back
        held = {k: v for k, v in model.state_dict().items() if k.startswith("sparse.")} if i == 0 else {}
        want, said = _local_values(held), []
        with _reshard_warnings(said):
            modular.reshard(model, ShardingPlan(world_size=world, modules={"sparse": _dlrm_placements(chain[i + 1], world)}))
        for k, values in _local_values(held).items():  # the state_dict's DTensors and data-parallel copies
            assert all(torch.equal(a, b) for a, b in zip(values, want[k])), f"{what}: held state_dict {k} changed"
        assert len(said) == (1 if held else 0), f"{what}: {said}"
        assert not held or "still referenced outside the model" in said[0], f"{what}: {said}"
        del held
        forms = {name: type(w) for name, w in model.sparse.table_weights().items()}  # not the tables:
        for name, form in forms.items():  # the next reshard would keep what this frame holds whole
            placement = _dlrm_placements(chain[i + 1], world)[name]
            assert (form is DTensor) == (placement.sharding_type is not ShardingType.DATA_PARALLEL), (
                f"{what}: table {name} is a {form.__name__}"
            )
        assert {n: p for n, p in model.named_parameters() if not n.startswith("sparse.")} == dense, (
            f"{what}: reshard touched the dense part"
        )
        opt = torch.optim.SGD(modular.local_parameters(model), lr=DLRM_LR)
    return len(chain) - 1


@pytest.mark.parametrize("compose,world", [("ddp", 2), ("fsdp", 3)])
def test_dtensor_tables_under_ddp_and_fsdp(compose: str, world: int) -> None:
    assert run_on_ranks(world, _dlrm_dtensor, compose, timeout=TIMEOUT) == [5] * world


# -- what travels --------------------------------------------------------------------------------


class _Holder(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc


@contextlib.contextmanager
def _counting_all_to_alls(calls: list):
    """Records (dtype's name, input splits, output splits, ranks of the group) of each reshard
    all-to-all on this rank."""
    real = reshard_exchange.all_to_all

    def spy(tensor, *, input_splits, output_splits, group=None, **kwargs):
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        calls.append((str(tensor.dtype), list(input_splits), list(output_splits), ranks))
        return real(tensor, input_splits=input_splits, output_splits=output_splits, group=group, **kwargs)

    with mock.patch.object(reshard_exchange, "all_to_all", spy):
        yield calls


def _bytes_on_the_wire() -> dict:
    """A fused model (row-wise Adagrad) whose new plan moves one table-wise table to the other
    rank, beside a data-parallel, a row-wise and a table-wise table that stay: only that table's
    weights and row statistics travel, in one all-to-all (weights and state are both FP32)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ebc = fused_ebc()
    modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=FUSED_LR, eps=FUSED_EPS)
    holder = _Holder(ebc)
    before = {
        "t_sum": TablePlacement(ShardingType.DATA_PARALLEL),
        "t_mean": TablePlacement(ShardingType.TABLE_WISE, ranks=(0,)),
        "t_small": TablePlacement(ShardingType.ROW_WISE),
        "t_big": TablePlacement(ShardingType.TABLE_WISE, ranks=(0,)),
    }
    modular.shard(holder, ShardingPlan(world_size=world, modules={"ebc": before}))
    batches = [make_batch(holder.ebc, seed=r) for r in range(world)]
    holder.ebc(batches[rank]).values().sum().backward()  # some state to move
    old = holder.ebc
    values = {n: full_value(p) for n, p in old.named_parameters()}
    unchanged: list = []
    with _counting_all_to_alls(unchanged):
        modular.reshard(holder, ShardingPlan(world_size=world, modules={"ebc": before}))
    assert holder.ebc is old and not unchanged, "a plan that changes nothing rebuilt or sent"
    calls: list = []
    after = {**before, "t_big": TablePlacement(ShardingType.TABLE_WISE, ranks=(1,))}
    with _counting_all_to_alls(calls):
        modular.reshard(holder, ShardingPlan(world_size=world, modules={"ebc": after}))
    assert holder.ebc is not old
    for n, p in holder.ebc.named_parameters():
        assert torch.equal(full_value(p), values[n]), n
    return {"calls": calls}


def test_only_the_moved_table_travels() -> None:
    rows, dim = 29, 16  # t_big of fused_ebc: its FP32 weights and one FP32 row statistic per row
    moved = rows * dim + rows
    got = run_on_ranks(2, _bytes_on_the_wire, timeout=TIMEOUT)
    assert got[0]["calls"] == [("torch.float32", [0, moved], [0, 0], [0, 1])], got[0]
    assert got[1]["calls"] == [("torch.float32", [0, 0], [moved, 0], [0, 1])], got[1]


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def memory_holder(rows: int, dim: int, names: list[str]) -> tuple[nn.Module, modular.FusedOptimizer]:
    """The memory checks' model: `dense` and `fused` (row-wise Adagrad, whose optimizer comes
    with it), each an EBC of the same FP32 tables of rows x dim, one feature each."""
    configs = [
        EmbeddingBagConfig(name=n, embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{n}"])
        for n in names
    ]  # fmt: skip
    holder = nn.Module()
    holder.dense, holder.fused = EmbeddingBagCollection(tables=configs), EmbeddingBagCollection(tables=configs)
    return holder, modular.fuse_optimizer(holder.fused, "exact_rowwise_adagrad", lr=FUSED_LR, eps=FUSED_EPS)


def _peak_growth() -> list[dict]:
    """Issue 39's memory bound, measured as the kernel counts it: the growth of this process's
    peak resident set (VmHWM, reset through /proc/self/clear_refs) over its resident set before
    each reshard, for a dense and a fused (row-wise Adagrad) module of 4 tables of 8 MiB,
    table-wise, moving one table and then every table to the next rank. The old shards are
    given back as they are copied, so every value is checked afterwards too."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rows, dim, names = 32_768, 64, [f"m{i}" for i in range(4)]
    holder, _ = memory_holder(rows, dim, names)
    at = lambda shift, moved: {  # noqa: E731
        n: TablePlacement(ShardingType.TABLE_WISE, ranks=((i + (shift if n in moved else 0)) % world,))
        for i, n in enumerate(names)
    }  # fmt: skip
    modular.shard(holder, ShardingPlan(world_size=world, modules={m: at(0, ()) for m in ("dense", "fused")}))
    _values_through_given_back_pages()
    out = []
    for module, row_bytes in (("dense", dim * 4), ("fused", dim * 4 + 4)):
        placed = at(0, ())
        for moved in (names[:1], names):
            new = {n: TablePlacement(ShardingType.TABLE_WISE, ranks=((p.ranks[0] + (n in moved)) % world,)) for n, p in placed.items()}
            received = sum(rows * row_bytes for n in moved if new[n].ranks[0] == rank)
            moves = any(rank in (placed[n].ranks[0], new[n].ranks[0]) for n in moved)
            values = {n: full_value(p) for n, p in getattr(holder, module).named_parameters()}
            dist.barrier()
            before = _status_bytes("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak (VmHWM) starts again from the resident set now
            modular.reshard(holder, ShardingPlan(world_size=world, modules={module: new}))
            growth = _status_bytes("VmHWM") - before
            for n, p in getattr(holder, module).named_parameters():
                assert torch.equal(full_value(p), values[n]), f"{module}: {n} changed"
            bound = received + (rows * dim * 4 if moves else 0)  # the largest moved block: weights
            out.append({"what": f"{module}, {len(moved)} moved", "growth": growth, "bound": bound, "old": received + sum(rows * row_bytes for n in names if new[n].ranks[0] == rank)})
            placed = new
    return out


def _values_through_given_back_pages() -> None:
    """The old shards' pages are given back in chunks as kept blocks are copied: through a chain
    of every sharding type, with chunks of two pages and tables of 128 pages, every weight and
    row statistic (set to random values first, so a page read as zeros would show) is bit for
    bit what it was."""
    world = dist.get_world_size()
    configs = [
        EmbeddingBagConfig(name=n, embedding_dim=32, num_embeddings=4096, feature_names=[f"f{n}"])
        for n in ("p0", "p1")
    ]  # fmt: skip
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=configs)
    modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=FUSED_LR, eps=FUSED_EPS)
    modular.shard(ebc, ShardingPlan(world_size=world, modules={"": _placements("table_wise", ebc, world)}))
    for states in ebc.fused_tables.states().values():  # each row's statistic is held once here
        states["row_sum"].copy_(torch.rand(states["row_sum"].shape, generator=torch.Generator().manual_seed(7)) + 1)
    states = None  # the loop's last would hold an old shard

    def values() -> dict[str, torch.Tensor]:
        out = {n: full_value(p) for n, p in ebc.named_parameters()}
        layout = ebc.layout
        for c in configs:
            out[f"{c.name} row_sum"] = torch.zeros(c.num_embeddings)
        for (name, j), states in ebc.fused_tables.states().items():
            spec = layout.shards[layout.table_index(name)][j]
            out[f"{name} row_sum"][spec.row_offset : spec.row_offset + spec.num_rows] = states["row_sum"]
        for c in configs:  # copies (column pieces, data-parallel tables) hold the same positive values
            dist.all_reduce(out[f"{c.name} row_sum"], op=dist.ReduceOp.MAX)
        return out

    want = values()
    with mock.patch.object(reshard_moves, "KEEP_CHUNK_BYTES", 8192):
        for case in ("row_wise", "column_wise", "table_row_wise", "data_parallel", "column_pieces", "table_wise"):
            modular.reshard(ebc, ShardingPlan(world_size=world, modules={"": _placements(case, ebc, world)}))
            for key, value in values().items():
                assert torch.equal(value, want[key]), f"-> {case}: {key} changed"


@contextlib.contextmanager
def _reshard_warnings(said: list):
    """Collects what `modular.reshard` warns inside (every warning, repeats too)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    said.extend(str(w.message) for w in caught if str(w.message).startswith("modular.reshard"))


def _local_values(state: dict) -> dict[str, list[torch.Tensor]]:
    """Copies of this rank's values of each entry of a state_dict (its pieces where sharded)."""
    return {
        k: [p.tensor.clone() for p in local_pieces(v)] if is_sharded(v) else [v.clone()]
        for k, v in state.items()
    }


def _references_held(tensor_type: str, holds: tuple[str, ...]) -> dict[str, list[str]]:
    """References to the old shards taken before a reshard and held across it (`holds`, one a
    reshard: a `state_dict()`, a slice view in the middle of a local shard, the tables' parameter
    objects, or nothing) read what they read before: their old shards are kept whole, with a
    warning, where they were given back (and read as zeros) before; with nothing held the old
    shards are given back without one. Tables of 32-160 pages, so that every shard has whole
    pages to give back. Training equals the reference throughout (the optimizer is rebuilt after
    each reshard and dropped before it, and each step's loss goes with `_train_steps`' frame)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    tables = [dataclasses.replace(c, num_embeddings=c.num_embeddings * 512) for c in unweighted_tables()]
    ebc = EmbeddingBagCollection(tables=tables)
    ref = copy.deepcopy(ebc)
    holder = _Holder(ebc)
    plan = lambda case: ShardingPlan(world_size=world, modules={"ebc": placements_for(case, ebc, world)})  # noqa: E731
    modular.shard(holder, plan("row_wise"), tensor_type=tensor_type)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)

    def view() -> dict[str, torch.Tensor]:
        piece = local_pieces(holder.ebc.table_weights()["t_sum"])[0].tensor
        return {"view": piece[piece.shape[0] // 2 : piece.shape[0] // 2 + 2]}

    take = {
        "state_dict": holder.state_dict, "view": view, "nothing": dict,
        "parameters": lambda: dict(holder.ebc.table_weights()),  # the very objects the module held
    }  # fmt: skip
    said: dict[str, list[str]] = {}
    cases = ("column_wise", "table_wise", "row_wise", "table_row_wise")
    for i, (case, hold) in enumerate(zip(cases, holds)):
        what = f"rank {rank} {tensor_type}: resharding to {case} holding {hold}"
        opt = torch.optim.SGD(modular.local_parameters(holder), lr=LR)
        _train_steps(holder, ref, opt, ref_opt, range(2 * i, 2 * i + 2), what)
        del opt  # it holds the old shards too
        held = take[hold]()
        if hold == "nothing":  # a batch prefetched for the old module: its prefetcher and the
            modular.prefetch(holder, make_batch(ref, seed=100 + rank))  # module hold each other
        want = _local_values(held)
        said[f"{tensor_type} {hold}"] = got = []
        with _reshard_warnings(got):
            modular.reshard(holder, plan(case))
        for k, values in _local_values(held).items():
            assert all(torch.equal(a, b) for a, b in zip(values, want[k])), f"{what}: {k} changed"
        _check_weights(holder.ebc, ref, what)
        del held
    opt = torch.optim.SGD(modular.local_parameters(holder), lr=LR)
    _train_steps(holder, ref, opt, ref_opt, range(2 * len(holds), 2 * len(holds) + 2), f"rank {rank}: after")
    _check_weights(holder.ebc, ref, f"rank {rank} {tensor_type}: after the reshards")
    return said


def _staged_through_host() -> tuple[dict[str, list[str]], list[int], list[int]]:
    """The device path (Note [reshard memory], "On a device") on CPU ranks: the old storages of
    rebuilt kernels copied to host and freed before the build; values bit for bit through a
    chain with nothing held (no storage given its bytes back), and a `state_dict()` held across
    a reshard reads what it read (its storages given their bytes back, with the warning).
    Returns the warnings, and per reshard how many storages were staged and given back."""
    staged, restored = [], []
    init, restore = reshard_staging.Staged.__init__, reshard_staging.Staged.restore

    def spy_init(self, *args) -> None:
        init(self, *args)
        staged.append(len(self._storages))

    def spy_restore(self, *args, **kwargs) -> set:
        out = restore(self, *args, **kwargs)
        restored.append(len(out))
        return out

    with (
        mock.patch.object(reshard_staging, "_STAGE_THROUGH_HOST", True),
        mock.patch.object(reshard_staging.Staged, "__init__", spy_init),
        mock.patch.object(reshard_staging.Staged, "restore", spy_restore),
    ):
        _values_through_given_back_pages()
        said = _references_held("sharded_tensor", ("state_dict", "nothing"))
    return {f"staged {k}": v for k, v in said.items()}, staged, restored


def _peak_growth_and_held_references() -> tuple[list[dict], dict[str, list[str]], list[int], list[int]]:
    rows = _peak_growth()
    said = _references_held("sharded_tensor", ("state_dict", "view", "parameters", "nothing"))
    staged_said, staged, restored = _staged_through_host()
    return rows, {**said, **_references_held("dtensor", ("state_dict", "nothing")), **staged_said}, staged, restored


def test_peak_memory_is_at_most_what_a_rank_receives_plus_its_largest_moved_block() -> None:
    """What a rank holds beyond its old shards during a reshard (issue 39): at most the bytes it
    receives plus its largest moved block, where building new kernels beside the old ones took
    the bytes it receives plus all its new shards (`old`); a user's references to the old shards
    keep them whole (and intact), with a warning."""
    results = run_on_ranks(2, _peak_growth_and_held_references, timeout=TIMEOUT)
    for rank, (rows, said, staged, restored) in enumerate(results):
        # Through host: 6 reshards holding nothing, then one holding a state_dict, one nothing.
        assert len(staged) == len(restored) == 8 and all(staged), (rank, staged, restored)
        assert restored[:6] == [0] * 6 and restored[6] > 0 and restored[7] == 0, (rank, restored)
        assert said["staged sharded_tensor nothing"] == [], (rank, said)
        assert said["staged sharded_tensor state_dict"], (rank, said)
        for r in rows:
            assert r["growth"] <= r["bound"] + (1 << 20), (rank, r)  # 1 MiB: the interpreter's own
            assert r["growth"] < r["old"] or r["old"] <= r["bound"], (rank, r)
        assert said["sharded_tensor nothing"] == said["dtensor nothing"] == [], (rank, said)
        names = {"t_sum", "t_mean", "t_small", "t_big"}
        held = {
            "sharded_tensor state_dict": names, "sharded_tensor view": {"t_sum"},
            "sharded_tensor parameters": set(), "dtensor state_dict": names,
        }  # fmt: skip
        for hold, tables in held.items():  # at least these (and those sharing their storages)
            assert len(said[hold]) == 1, (rank, hold, said[hold])
            named = re.match(
                rf"modular\.reshard on rank {rank}: the old shards of tables? (.*) of module 'ebc' are "
                r"still referenced outside the model .* so they were kept whole and read as before",
                said[hold][0],
            )
            assert named and tables <= set(re.findall(r"'(\w+)'", named[1])) <= names, (rank, hold, said[hold])


def _tables_that_stay() -> list[dict]:
    """World 3, one table moved from rank 0 to rank 1: Adam's moments and step count under the
    kernels rank 2 adopts, a failure on rank 1 that leaves rank 2's old module as it was (its
    adopted dense kernel's parameters given back), then the memory of a rank neither sending
    nor receiving."""
    assert _ebc_chain("adam", ["one_before", "one_moved"]) == 1
    world, rank = dist.get_world_size(), dist.get_rank()
    ebc = make_ebc(False)
    ref, holder = copy.deepcopy(ebc), _Holder(ebc)
    plan = lambda case: ShardingPlan(world_size=world, modules={"ebc": _placements(case, ebc, world)})  # noqa: E731
    modular.shard(holder, plan("one_before"))
    opt = torch.optim.SGD(modular.local_parameters(holder), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    _train_steps(holder, ref, opt, ref_opt, range(2), f"rank {rank} before")
    old, views = holder.ebc, list(holder.ebc.local_shard_views().values())
    fault = RuntimeError("injected fault")
    failing = mock.patch.object(reshard_moves, "copy_block", side_effect=fault) if rank == 1 else contextlib.nullcontext()
    with failing, pytest.raises(modular.ShardingError, match="injected fault"):
        modular.reshard(holder, plan("one_moved"))
    assert holder.ebc is old and all(a is b for a, b in zip(old.local_shard_views().values(), views, strict=True))
    _train_steps(holder, ref, opt, ref_opt, range(2, 5), f"rank {rank} after the failed reshard")
    _check_weights(holder.ebc, ref, f"rank {rank} after the failed reshard")
    return _peak_growth()


def test_a_rank_whose_tables_stay_keeps_its_kernels_and_copies_nothing() -> None:
    """Rank 2 adopts its kernels as they are (Note [reshard memory]): Adam trains on with its
    moments and step count, a failed reshard leaves its old module whole, and its peak grows by
    next to nothing, where copying its kept
    shards into new kernels took one 1 MiB chunk of each tensor (issue 39's bound is 0)."""
    results = run_on_ranks(3, _tables_that_stay, timeout=TIMEOUT)
    for rank, rows in enumerate(results):
        for r in rows:
            assert r["growth"] <= r["bound"] + (1 << 20), (rank, r)
    still = [r for r in results[2] if r["what"].endswith("1 moved")]
    assert len(still) == 2 and all(r["bound"] == 0 for r in still), still
    for r in still:
        assert r["growth"] < 256 << 10, r


# -- faults and refusals -------------------------------------------------------------------------


def _train_steps(holder, ref, opt, ref_opt, steps: range, what: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in steps:
        loss, ref_loss = _step(holder.ebc, ref, step, world, rank, f"{what}, step {step}")
        loss.backward()
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()


def _fails_mid_reshard() -> str:
    """Rank 1 fails while writing a block into its new shards: every rank raises, every rank's
    old module stays in place and keeps training exactly, with the optimizer built before."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ebc = make_ebc(False)
    ref = copy.deepcopy(ebc)
    holder = _Holder(ebc)
    modular.shard(holder, ShardingPlan(world_size=world, modules={"ebc": placements_for("table_wise", ebc, world)}))
    opt = torch.optim.SGD(modular.local_parameters(holder), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    _train_steps(holder, ref, opt, ref_opt, range(2), f"rank {rank} before")
    old = holder.ebc
    fault = RuntimeError("injected fault")
    failing = mock.patch.object(reshard_moves, "copy_block", side_effect=fault) if rank == 1 else contextlib.nullcontext()
    plan = ShardingPlan(world_size=world, modules={"ebc": placements_for("row_wise", ebc, world)})
    for staged in (False, True):  # through host (Note [reshard memory]): the old bytes come back
        what = f"rank {rank} after the failed reshard{' staged through host' if staged else ''}"
        with failing, pytest.raises(modular.ShardingError) as raised:
            with mock.patch.object(reshard_staging, "_STAGE_THROUGH_HOST", staged):
                modular.reshard(holder, plan)
        assert holder.ebc is old, "a failed reshard replaced the module"
        _train_steps(holder, ref, opt, ref_opt, range(2 + 3 * staged, 5 + 3 * staged), what)
        _check_weights(holder.ebc, ref, what)
    # Past the last agreement (and the swap) only local copies are left: a rank failing there
    # raises alone, saying its shards are partly copied; every rank holds the new plan.
    late = mock.patch.object(reshard_call, "keep", side_effect=fault) if rank == 1 else contextlib.nullcontext()
    late_message = ""
    with late:
        try:
            modular.reshard(holder, plan)
        except modular.ShardingError as e:
            late_message = str(e)
    assert holder.ebc is not old
    return str(raised.value), late_message


def test_a_rank_failing_mid_reshard_raises_everywhere_and_keeps_the_old_module() -> None:
    results = run_on_ranks(2, _fails_mid_reshard, timeout=TIMEOUT)
    assert results[0][1] == "", results[0][1]
    assert results[1][1].startswith("modular.reshard failed on rank 1 after every rank had received its blocks"), results[1][1]
    assert "every rank holds the new plan" in results[1][1], results[1][1]
    assert "load the last checkpoint on every rank" in results[1][1], results[1][1]
    for m, _ in results:
        assert "modular.reshard failed on rank 1 while filling the new shards of module 'ebc'" in m, m
        assert "RuntimeError: injected fault" in m and "keeps its old shards" in m, m


def _collective_fails() -> tuple[str, str]:
    """Rank 1's all-to-all raises (as a closed socket does); rank 0, left in it, fails at its
    group's timeout. Both raise CollectiveError, and both keep the old module untouched."""
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(timeout=timedelta(seconds=3))
    ebc = make_ebc(False)
    holder = _Holder(ebc)
    plan = ShardingPlan(world_size=world, modules={"ebc": placements_for("table_wise", ebc, world)})
    modular.shard(holder, plan, process_group=group)
    old = holder.ebc
    values = {n: [t.detach().clone() for t, _, _ in local_blocks(p)] for n, p in old.named_parameters()}
    closed = RuntimeError("injected: connection closed by peer")
    failing = mock.patch.object(dist, "all_to_all_single", side_effect=closed) if rank == 1 else contextlib.nullcontext()
    new_plan = ShardingPlan(world_size=world, modules={"ebc": placements_for("row_wise", ebc, world)})
    with failing, pytest.raises(modular.CollectiveError) as raised:
        modular.reshard(holder, new_plan)
    assert holder.ebc is old
    for n, p in old.named_parameters():
        for (t, _, _), kept in zip(local_blocks(p), values[n]):
            assert torch.equal(t.detach(), kept), f"a failed reshard changed {n}"
    return type(raised.value).__name__, str(raised.value)


def test_a_failed_collective_raises_collective_error_on_every_rank() -> None:
    results = run_on_ranks(2, _collective_fails, timeout=TIMEOUT)
    assert [kind for kind, _ in results] == ["CollectiveError"] * 2
    assert all("the reshard's all-to-all of torch.float32 blocks failed" in m for _, m in results), results


def _refused_plans() -> dict[str, str]:
    """Plans that do not fit, refused on every rank before anything moves (no all-to-all), the
    model left as it was; then a per-piece statistic that cannot follow its table."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ebc = make_ebc(False)
    holder = _Holder(ebc)
    holder.plain = make_ebc(True)
    placements = placements_for("table_wise", ebc, world)
    modular.shard(holder, ShardingPlan(world_size=world, modules={"ebc": placements}))
    old = holder.ebc
    row_wise = placements_for("row_wise", ebc, world)
    plans = {
        "bigger_world": ShardingPlan(world_size=world + 1, modules={"ebc": placements_for("row_wise", ebc, world + 1)}),
        "missing_module": ShardingPlan(world_size=world, modules={"tower.ebc": row_wise}),
        "unsharded_module": ShardingPlan(world_size=world, modules={"plain": placements_for("row_wise", holder.plain, world)}),
        "table_left_out": ShardingPlan(world_size=world, modules={"ebc": {k: v for k, v in row_wise.items() if k != "t_mean"}}),
        "unknown_table": ShardingPlan(world_size=world, modules={"ebc": {**row_wise, "t_nope": row_wise["t_sum"]}}),
        "ranks_disagree": ShardingPlan(world_size=world, modules={"ebc": row_wise if rank == 0 else placements_for("column_wise", ebc, world)}),
    }
    messages, calls = {}, []
    with _counting_all_to_alls(calls):
        for problem, plan in plans.items():
            with pytest.raises(modular.ShardingError) as raised:
                modular.reshard(holder, plan)
            messages[problem] = str(raised.value)
            assert holder.ebc is old, f"{problem}: the module was replaced"
    assert not calls, f"a refused plan moved blocks: {calls}"
    # column_wise_statistic="per_shard": pieces move whole, and only to pieces of the same columns.
    cut = fused_ebc()
    modular.fuse_optimizer(cut, "exact_rowwise_adagrad", lr=FUSED_LR, eps=FUSED_EPS, column_wise_statistic="per_shard")
    modular.shard(cut, ShardingPlan(world_size=world, modules={"": placements_for("column_wise", cut, world)}))
    swapped = {n: TablePlacement(ShardingType.COLUMN_WISE, ranks=tuple(reversed(range(world)))) for n in placements}
    modular.reshard(cut, ShardingPlan(world_size=world, modules={"": swapped}))
    with pytest.raises(modular.ShardingError) as raised:
        modular.reshard(cut, ShardingPlan(world_size=world, modules={"": _placements("column_pieces", cut, world)}))
    messages["per_piece"] = str(raised.value)
    return messages


REFUSALS = {
    "bigger_world": r"the plan is for 3 ranks but the modules are sharded over 2; reshard keeps the world size",
    "missing_module": r"the plan names module 'tower\.ebc', which does not exist in the model; reshard moves the model's sharded collections \['ebc'\]",
    "unsharded_module": r"module 'plain', which is an EmbeddingBagCollection that is not sharded: shard it with modular\.shard first",
    "table_left_out": r"the plan for module 'ebc' has no placement for tables \['t_mean'\]",
    "unknown_table": r"the plan for module 'ebc' places tables \['t_nope'\], which the module does not have",
    "ranks_disagree": r"ranks disagree on the plan .* every rank must call modular\.reshard with the same plan",
    "per_piece": r"module '': table 't_sum' keeps one row-wise Adagrad statistic per column piece .* pieces \[\(0, 4\), \(4, 8\)\]\), but the new plan gives it column pieces \[\(0, 3\), \(3, 6\), \(6, 8\)\]",
}


def test_plans_that_do_not_fit_are_refused_on_every_rank_before_anything_moves() -> None:
    results = run_on_ranks(2, _refused_plans, timeout=TIMEOUT)
    for problem, pattern in REFUSALS.items():
        assert results[0][problem] == results[1][problem], problem
        assert re.search(pattern, results[0][problem]), (problem, results[0][problem])


def _two_dtypes() -> list:
    """An FP16 table beside FP32 ones, fused: one all-to-all per dtype (FP16 weights; FP32
    weights and every table's FP32 row statistic), and every value arrives bit for bit."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    tables = [dataclasses.replace(c, data_type=DataType.FP16) if c.name == "t_big" else c for c in fused_ebc().embedding_bag_configs()]
    ebc = EmbeddingBagCollection(tables=tables)
    modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=FUSED_LR, eps=FUSED_EPS)
    modular.shard(ebc, ShardingPlan(world_size=world, modules={"": placements_for("table_wise", ebc, world)}))
    ebc(make_batch(ebc, seed=rank)).values().sum().backward()
    values = {n: full_value(p) for n, p in ebc.named_parameters()}
    calls: list = []
    with _counting_all_to_alls(calls):
        modular.reshard(ebc, ShardingPlan(world_size=world, modules={"": placements_for("row_wise", ebc, world)}))
    for n, p in ebc.named_parameters():
        assert torch.equal(full_value(p), values[n]), n
    assert dtype_of(ebc.table_weights()["t_big"]) is torch.float16
    return sorted(dtype for dtype, *_ in calls)


def test_one_all_to_all_per_dtype() -> None:
    assert run_on_ranks(2, _two_dtypes, timeout=TIMEOUT) == [["torch.float16", "torch.float32"]] * 2
