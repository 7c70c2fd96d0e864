"""TorchRec's DistributedModelParallel, given `planners.to_torchrec` of our plan, computes what the
unsharded model computes, and what `modular.shard` computes with our plan (issue 24).

One rank body per world size (2 and 3, CPU gloo) runs several plans: every sharding type with
rows and columns that split unevenly (1000 rows over 3 ranks, a 20-wide table cut 8/8/4); plans
a user writes that TorchRec cannot hold as written (row blocks on a subset of ranks in reverse
order, column cuts off multiples of 4, a rank with two column pieces); the planner's own plan;
the planner's plan with `torchrec_compatible=True`, which to_torchrec must convert with nothing
moved; and TorchRec's dense kernel with a 0-row block and 3-column pieces (which its fused kernel
refuses). For each plan, two SGD steps on the same batches: the forward output of DMP and of ours
against the unsharded EBC on the global batch, and after the steps every weight shard DMP holds
against the unsharded weights, and its boundaries against what `from_torchrec` says TorchRec
holds. Routing a row to the wrong shard changes outputs by ~0.1 (the old to_torchrec failed here
at the first forward); fp32 summation order moves them by at most ~2.4e-7, within the 1e-5.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
import planners
from planners import ShardingPlan, ShardingType, TableConstraint, TablePlacement, Topology
from tests.dist import run_on_ranks

T = ShardingType
ATOL = 1e-5
LR = 0.5
STEPS = 2
BATCH = 4


def _configs() -> list[EmbeddingBagConfig]:
    # Widths are multiples of 4 but t_odd's: TorchRec's fused kernel needs that (Note [column
    # pieces in TorchRec]).
    return [
        EmbeddingBagConfig(name="t_tw", num_embeddings=37, embedding_dim=8, feature_names=["f_tw"]),
        EmbeddingBagConfig(name="t_rw", num_embeddings=1000, embedding_dim=8, feature_names=["f_rw", "f_rw2"]),
        EmbeddingBagConfig(name="t_cw", num_embeddings=50, embedding_dim=20, feature_names=["f_cw"],
                           pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="t_twrw", num_embeddings=100, embedding_dim=12, feature_names=["f_twrw"]),
        EmbeddingBagConfig(name="t_dp", num_embeddings=23, embedding_dim=4, feature_names=["f_dp"]),
        EmbeddingBagConfig(name="t_tiny", num_embeddings=5, embedding_dim=4, feature_names=["f_tiny"]),
        EmbeddingBagConfig(name="t_four", num_embeddings=4, embedding_dim=4, feature_names=["f_four"]),
        # 6 wide: only data-parallel (TorchRec's dense kernel) in the fused plans
        EmbeddingBagConfig(name="t_odd", num_embeddings=30, embedding_dim=6, feature_names=["f_odd"]),
    ]  # fmt: skip


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(tables=_configs())

    def forward(self, kjt: KeyedJaggedTensor):
        return self.ebc(kjt)


def _plans(world: int) -> dict[str, tuple[ShardingPlan, str]]:
    """{name: (plan, TorchRec compute kernel)}."""
    everyone = tuple(range(world))
    last = world - 1
    each_type = {
        "t_tw": TablePlacement(T.TABLE_WISE, (last,)),
        "t_rw": TablePlacement(T.ROW_WISE),  # the even split: 334/333/333 over 3 ranks
        "t_cw": TablePlacement(T.COLUMN_WISE, everyone, sizes=(8, 8, 4) if world == 3 else (12, 8)),
        "t_twrw": TablePlacement(T.TABLE_ROW_WISE, everyone),
        "t_dp": TablePlacement(T.DATA_PARALLEL),
        "t_tiny": TablePlacement(T.ROW_WISE),  # 5 rows over 3 ranks: 2/2/1 in both
        "t_four": TablePlacement(T.TABLE_WISE, (0,)),
        "t_odd": TablePlacement(T.DATA_PARALLEL),
    }
    # 4 rows over 3 ranks is 2/1/1 here, 2/2/0 in TorchRec, whose fused CPU kernel fails on a
    # 0-row shard; its dense kernel does not.
    # Column pieces 3 or 2 wide: only the dense kernel takes them.
    dense_kernel = {**each_type, "t_four": TablePlacement(T.ROW_WISE), "t_odd": TablePlacement(T.COLUMN_WISE)}
    user_written = {
        "t_tw": TablePlacement(T.TABLE_WISE, (0,)),
        "t_rw": TablePlacement(T.ROW_WISE, (last, 0), sizes=(600, 400)),  # reverse order
        # cuts off multiples of 4; the last rank holds two pieces
        "t_cw": TablePlacement(T.COLUMN_WISE, (last, 0, last), sizes=(7, 9, 4)),
        "t_twrw": TablePlacement(T.TABLE_ROW_WISE, everyone[::-1], sizes=(1, 59, 40) if world == 3 else (1, 99)),
        "t_dp": TablePlacement(T.ROW_WISE, (last,)),  # one rank of several
        "t_tiny": TablePlacement(T.TABLE_ROW_WISE, (last,)),
        "t_four": TablePlacement(T.COLUMN_WISE, (last,)),
        "t_odd": TablePlacement(T.DATA_PARALLEL),
    }  # fmt: skip
    planned = planners.plan(
        _configs(), Topology(world, ranks_per_host=world), batch_size=BATCH, module_fqn="ebc",
        constraints={"t_rw": TableConstraint(sharding_types=(T.ROW_WISE,), min_shards=world),
                     "t_cw": TableConstraint(sharding_types=(T.COLUMN_WISE,), min_shards=world),
                     "t_four": TableConstraint(sharding_types=(T.TABLE_WISE, T.DATA_PARALLEL)),
                     "t_odd": TableConstraint(sharding_types=(T.DATA_PARALLEL,))},
        pooling_factors={"f_rw": 2.0, "f_cw": 3.0},
    )  # fmt: skip
    # TorchRec's layout from the start (issue 38): to_torchrec moves nothing
    compatible = planners.plan(
        _configs(), Topology(world, ranks_per_host=world), batch_size=BATCH, module_fqn="ebc",
        constraints={"t_rw": TableConstraint(sharding_types=(T.ROW_WISE,)),
                     "t_tiny": TableConstraint(sharding_types=(T.ROW_WISE,)),
                     "t_twrw": TableConstraint(sharding_types=(T.TABLE_ROW_WISE,)),
                     "t_cw": TableConstraint(sharding_types=(T.COLUMN_WISE,), min_shards=world)},
        pooling_factors={"f_rw": 2.0, "f_cw": 3.0}, torchrec_compatible=True,
    )  # fmt: skip
    return {
        "planned_torchrec": (compatible, "fused"),
        "each_type": (ShardingPlan(world, {"ebc": each_type}, ranks_per_host=world), "fused"),
        "user_written": (ShardingPlan(world, {"ebc": user_written}, ranks_per_host=world), "fused"),
        "planned": (planned, "fused"),
        "dense_kernel": (ShardingPlan(world, {"ebc": dense_kernel}, ranks_per_host=world), "dense"),
    }


def _batch(seed: int) -> KeyedJaggedTensor:
    """0-3 ids per bag (the first bag of every feature empty), ids anywhere in the table."""
    g = torch.Generator().manual_seed(seed)
    rows = {f: c.num_embeddings for c in _configs() for f in c.feature_names}
    lengths, values = [], []
    for f, n_rows in rows.items():
        n = torch.randint(0, 4, (BATCH,), generator=g)
        n[0] = 0
        lengths.append(n)
        values.append(torch.randint(0, n_rows, (int(n.sum()),), generator=g))
    return KeyedJaggedTensor(keys=list(rows), values=torch.cat(values), lengths=torch.cat(lengths))


def _global(batches: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    keys = batches[0].keys()
    jts = [b.to_dict() for b in batches]
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([j[k].values() for k in keys for j in jts]),
        lengths=torch.cat([j[k].lengths() for k in keys for j in jts]),
    )


def _dmp(model: nn.Module, tr_plan, kernel: str):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    # Sharded tables take the fused SGD step in backward, data-parallel copies (DDP) the torch
    # SGD; both see the gradient of the mean of the ranks' losses, as ours and the reference do
    # (Note [grad scaling across ranks]).
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=tr_plan, sharders=[sharder])  # fmt: skip
    # With the dense kernel the torch SGD updates the sharded tables too.
    dense = list(dict(in_backward_optimizer_filter(dmp.named_parameters())).values())
    if kernel == "dense" and not dense:
        raise AssertionError("DMP with the dense kernel has no parameters for a torch optimizer")
    return dmp, (torch.optim.SGD(dense, lr=LR) if dense else None)


def _table_of(key: str) -> str:
    return key.split(".")[-2]  # "...embedding_bags.t_rw.weight" -> "t_rw"


def _load_reference(dmp: nn.Module, ref: nn.Module) -> None:
    """DMP on CPU initialises its shards afresh; give them the reference's weights."""
    weights = {c.name: p for c, p in zip(ref.ebc.embedding_bag_configs(), ref.ebc.embedding_bags.values())}
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            full = weights[_table_of(key)].weight
            if isinstance(value, ShardedTensor):
                for s in value.local_shards():
                    (r, c), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
                    s.tensor.copy_(full[r : r + nr, c : c + nc])
            else:
                value.copy_(full)


def _compare(label: str, got: torch.Tensor, want: torch.Tensor) -> float:
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"{label}: {m}")
    return float((got - want).detach().abs().max()) if want.numel() else 0.0


def _run_plans(names: list[str]) -> dict[str, dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    report, plans = {}, _plans(world)
    for name in names:
        plan, kernel = plans[name]
        label = f"plan {name!r}, rank {rank}/{world}"
        ref = _Model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tr_plan = planners.to_torchrec(plan, ref, device_type="cpu", compute_kernel=kernel)
        moved = sorted({line.split("'")[1] for w in caught for line in str(w.message).splitlines()[1:]})
        back = planners.from_torchrec(tr_plan, world_size=world, ranks_per_host=world)

        ours = modular.shard(copy.deepcopy(ref), plan)
        ours_opt = torch.optim.SGD(modular.local_parameters(ours), lr=LR)
        dmp, dmp_opt = _dmp(copy.deepcopy(ref), tr_plan, kernel)
        _load_reference(dmp, ref)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        worst = {"ours": 0.0, "torchrec": 0.0}
        for step in range(STEPS):
            batches = [_batch(1000 * step + 10 * world + r) for r in range(world)]
            expected_kt = ref(_global(batches))
            expected = expected_kt.values()
            target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step))
            for who, model, opt in (("ours", ours, ours_opt), ("torchrec", dmp, dmp_opt)):
                out = model(batches[rank])
                if sorted(out.keys()) != sorted(expected_kt.keys()):
                    raise AssertionError(f"{label}: {who} output keys {out.keys()}, expected {expected_kt.keys()}")
                # TorchRec orders the output's features by sharding type; compare in ours.
                pooled = out.to_dict()
                out_values = torch.cat([pooled[k] for k in expected_kt.keys()], dim=1)
                worst[who] = max(worst[who], _compare(f"{label}: {who} step {step} forward", out_values, expected[mine]))
                (out_values * target[mine]).sum().backward()
                if opt is not None:
                    opt.step()
                    opt.zero_grad()
            ((expected * target).sum() / world).backward()
            ref_opt.step()
            ref_opt.zero_grad()

        # Every weight block DMP holds after the steps, where from_torchrec says it is.
        ref_weights = {c.name: p.weight for c, p in zip(ref.ebc.embedding_bag_configs(), ref.ebc.embedding_bags.values())}
        held, expected_held = {}, {}
        for key, value in dmp.state_dict().items():
            table = _table_of(key)
            full = ref_weights[table].detach()
            blocks = []
            pieces = value.local_shards() if isinstance(value, ShardedTensor) else []
            for s in pieces:
                (r, c), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
                if nr and nc:
                    blocks.append((r, nr, c, nc))
                    worst["torchrec"] = max(worst["torchrec"], _compare(f"{label}: {key}[{r}:{r + nr}, {c}:{c + nc}] after {STEPS} steps", s.tensor, full[r : r + nr, c : c + nc]))
            if not isinstance(value, ShardedTensor):
                blocks.append((0, full.shape[0], 0, full.shape[1]))
                worst["torchrec"] = max(worst["torchrec"], _compare(f"{label}: {key} after {STEPS} steps", value, full))
            held[table] = sorted(blocks)
            p = back.placement("ebc", table)
            specs = p.shards(num_embeddings=full.shape[0], embedding_dim=full.shape[1], world_size=world)
            expected_held[table] = sorted((s.row_offset, s.num_rows, s.col_offset, s.num_cols) for s in specs if s.rank == rank)
        report[name] = {"worst": worst, "moved": moved, "held": held, "expected_held": expected_held}
    return report


# What to_torchrec must move (and warn about) per plan and world: the even row split of 1000
# (334/333/333) is not TorchRec's block split (334/334/332); 1000 over 2 ranks is.
MOVED = {
    ("each_type", 2): [],
    ("each_type", 3): ["ebc.t_rw", "ebc.t_twrw"],
    ("dense_kernel", 2): [],
    ("dense_kernel", 3): ["ebc.t_four", "ebc.t_rw", "ebc.t_twrw"],
    ("user_written", 2): ["ebc.t_cw", "ebc.t_dp", "ebc.t_rw", "ebc.t_tiny", "ebc.t_twrw"],
    ("user_written", 3): ["ebc.t_cw", "ebc.t_dp", "ebc.t_rw", "ebc.t_tiny", "ebc.t_twrw"],
    ("planned_torchrec", 2): [],
    ("planned_torchrec", 3): [],
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
def test_dmp_with_converted_plans_matches_unsharded(world_size: int) -> None:
    names = ["each_type", "user_written", "planned", "planned_torchrec", "dense_kernel"]
    results = run_on_ranks(world_size, _run_plans, names, timeout=180)
    for name in names:
        kinds = {p.sharding_type for p in _plans(world_size)[name][0].modules["ebc"].values()}
        if name in ("each_type", "dense_kernel"):
            assert kinds == set(T), f"plan {name!r} misses a sharding type: {kinds}"
        if name == "planned_torchrec":  # its row-wise tables are uneven at world 3
            assert {T.ROW_WISE, T.TABLE_ROW_WISE, T.COLUMN_WISE} <= kinds, kinds
        for rank, report in enumerate(results):
            r = report[name]
            assert r["worst"]["ours"] <= ATOL and r["worst"]["torchrec"] <= ATOL
            assert r["held"] == r["expected_held"], f"plan {name!r}, rank {rank}: DMP holds other blocks than from_torchrec says"
            if (name, world_size) in MOVED:
                assert r["moved"] == MOVED[name, world_size], f"plan {name!r}: warned about {r['moved']}"
            else:  # the planner's own row split (its refinement makes it uneven) is not TorchRec's
                assert "ebc.t_rw" in r["moved"], f"plan {name!r}: warned about {r['moved']}"
