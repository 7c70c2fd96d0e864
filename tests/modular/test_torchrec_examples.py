"""torchrec's own example models, as torchrec wrote them, trained under `modular` (issue 41).

The models are unmodified copies (tests/third_party/torchrec_examples/README.md, checked here
byte for byte): the retrieval example's `TwoTower` under its `TwoTowerTrainTask` (query and
candidate towers over one EBC of two tables) and `TwoTowerRetrieval` (two EBCs, an index between
them, and a `load_state_dict(state_dict, strict)` override without `assign`), and `BERT4Rec` (an
EmbeddingCollection under a transformer). Every rank builds the same seeded model, deep-copies it
as the reference, shards the copy's collections by a plan (optionally fused first, and its dense
part under DDP or FSDP2), and trains both for `STEPS` steps: the sharded model on each rank's
batch, the reference on the global batch (every rank's, in rank order) with a loss whose gradient
is the mean over ranks of the per-rank ones (Note [grad scaling across ranks]). After every step
the loss (averaged over ranks) and every entry of the state dict, assembled whole, equal the
reference's. Dense parameters and unfused tables take SGD; fused tables take exact row-wise
Adagrad inside backward, the reference `rowwise_adagrad_step` after it. `TwoTowerRetrieval` is
given the two-tower batch's KJT, whose candidate feature its query EBC leaves alone (as torchrec's
EBC does), and an exact index in torch in place of faiss (not installed: the copied file imports
it, tests/third_party/torchrec_examples/_faiss_stand_in.py). It is also checkpointed under one
plan and loaded under another, and exported and loaded back (through its own `load_state_dict`).

BERT4Rec also runs the EC options: `tensor_type="dtensor"`; `output_dtype=torch.float16` (the
model's own code takes FP16 rows: fbgemm's `jagged_2d_to_dense` pads them and adding the FP32
positional embedding promotes); `comm_dtype` FP16 and BF16. For those the reference's EC output is
rounded as the option rounds it (`.to(dtype)` for the output dtype, `.to(dtype).float()` for the
wire, whose autograd also rounds the gradient), and the sharded EC's rows must equal the
reference's rounded rows within one rounding.

Several configurations run inside one rank body per world size to keep the file fast.
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
from pathlib import Path
from typing import Callable, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mlp import MLP
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

import modular
from modular.tables.forms import global_size, is_sharded, local_pieces
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.compare import ATOL
from tests.modular.dlrm_cases import global_loss
from tests.modular.ebc_cases import global_batch
from tests.modular.fused_reference import rowwise_adagrad_step
from tests.third_party.torchrec_examples.bert4rec.models.bert4rec import BERT4Rec, HistoryArch
from tests.third_party.torchrec_examples.retrieval.modules.two_tower import (
    TwoTower, TwoTowerRetrieval, TwoTowerTrainTask,
)

STEPS, LR, FUSED_LR, EPS = 3, 0.1, 0.1, 1e-3
BATCH, DIM = 4, 8
VOCAB, MAX_LEN = 13, 5
TIMEOUT = 180.0
WORLDS = [2, 3]
COPIES = Path(__file__).resolve().parents[1] / "third_party" / "torchrec_examples"
# One rounding of each dtype, relative (a value rounded once forward and its gradient once backward).
ROUNDING = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


# -- the copies ------------------------------------------------------------------------------------


def test_copies_are_torchrecs_files_byte_for_byte() -> None:
    listed = {}
    for line in (COPIES / "MANIFEST.sha256").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        listed[name] = digest
        assert hashlib.sha256((COPIES / name).read_bytes()).hexdigest() == digest, f"{name} was edited"
    # The README's git blob ids are torchrec's (`git rev-parse <commit>:examples/<path>`).
    blobs = dict(re.findall(r"^\| `([\w/.]+)` \| `[\w/.]+` \| `([0-9a-f]{40})` \|$", (COPIES / "README.md").read_text(), re.M))
    assert set(blobs) == set(listed) - {"LICENSE"}
    for name, blob in blobs.items():
        data = (COPIES / name).read_bytes()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, f"{name} is not torchrec's blob"
    ours = {"__init__.py", "_faiss_stand_in.py", "bert4rec/__init__.py", "bert4rec/models/__init__.py",
            "README.md", "MANIFEST.sha256"}  # fmt: skip
    present = {str(p.relative_to(COPIES)) for p in COPIES.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert present == set(listed) | ours, f"files neither copied (MANIFEST.sha256) nor ours: {present - set(listed) - ours}"


# -- training both sides ---------------------------------------------------------------------------


class Config(NamedTuple):
    plan: str
    fused: bool = False
    dense: str = "plain"  # "plain", "ddp" or "fsdp"
    options: tuple = ()  # (name, value) pairs for modular.shard

    def __str__(self) -> str:
        opts = "".join(f", {k}={v}" for k, v in self.options)
        return f"{self.plan}{', fused' if self.fused else ''}, {self.dense}{opts}"


def _placements(case: str, tables: list[str], world: int) -> dict[str, TablePlacement]:
    everyone = tuple(range(world))
    # world + 1 column pieces: the last rank holds two
    column = TablePlacement(ShardingType.COLUMN_WISE, ranks=(world - 1, *everyone))
    kinds = {
        "table_wise": [TablePlacement(ShardingType.TABLE_WISE, ranks=((world - 1 + i) % world,)) for i in range(len(tables))],
        "row_wise": [TablePlacement(ShardingType.ROW_WISE)] * len(tables),
        "column_wise": [column] * len(tables),
        "data_parallel": [TablePlacement(ShardingType.DATA_PARALLEL)] * len(tables),
        "table_row_wise": [TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=everyone)] * len(tables),
        "mixed": [TablePlacement(ShardingType.ROW_WISE, ranks=everyone[::-1]), column],
        "mixed_dp": [TablePlacement(ShardingType.TABLE_WISE, ranks=(0,)), TablePlacement(ShardingType.DATA_PARALLEL)],
    }
    return dict(zip(tables, kinds[case]))


def _plan(case: str, modules: dict[str, list[str]], world: int) -> ShardingPlan:
    """`case` over the tables of every module in turn (a "mixed" plan mixes across modules)."""
    placements = _placements(case, [t for tables in modules.values() for t in tables], world)
    return ShardingPlan(world_size=world, modules={fqn: {t: placements[t] for t in tables} for fqn, tables in modules.items()})


class Reference:
    """The reference's optimizer: SGD, or for tables of a fused model exact row-wise Adagrad."""

    def __init__(self, ref: nn.Module, table_prefixes: list[str], fused: bool) -> None:
        named = dict(ref.named_parameters())
        tables = {n for n in named if any(n.startswith(p) for p in table_prefixes)} if fused else set()
        self.tables = {n: named[n] for n in tables}
        self.row_sums = {n: torch.zeros(p.shape[0]) for n, p in self.tables.items()}
        self.sgd = torch.optim.SGD([p for n, p in named.items() if n not in tables], lr=LR)

    @torch.no_grad()
    def step(self) -> None:
        self.sgd.step()
        self.sgd.zero_grad()
        for n, p in self.tables.items():
            if p.grad is not None:
                rowwise_adagrad_step(p, p.grad, self.row_sums[n], lr=FUSED_LR, eps=EPS)
                p.grad = None


def _prepare(model: nn.Module, config: Config, plan: ShardingPlan, dense_modules: set[type]) -> torch.optim.Optimizer:
    """Fuses (if asked), shards and wraps `model` in place; returns the dense optimizer."""
    if config.fused:
        modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=FUSED_LR, eps=EPS)
    if modular.shard(model, plan, **dict(config.options)) is not model:
        raise AssertionError(f"{config}: shard did not return the model")
    if config.dense == "ddp":
        modular.apply_ddp(model)
    elif config.dense == "fsdp":
        modular.apply_fully_shard(model, modules=dense_modules)
    return torch.optim.SGD(modular.local_parameters(model), lr=LR)


def whole(value: torch.Tensor) -> torch.Tensor:
    """A state dict entry assembled whole on every rank (collective): a sharded table (ShardedTensor
    or DTensor) from every rank's pieces, an FSDP parameter from its shards, a data-parallel copy
    or plain parameter as it is."""
    if is_sharded(value):
        full = torch.zeros(global_size(value), dtype=value.dtype)
        for (r0, c0), (rows, cols), t in local_pieces(value):
            full[r0 : r0 + rows, c0 : c0 + cols] = t.detach()
        dist.all_reduce(full)  # the pieces are disjoint: their sum is the table
        return full
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value.detach()


def assert_state_matches(
    model: nn.Module, want: dict[str, torch.Tensor], what: str, atol: float = ATOL, rtol: float = 0.0
) -> float:
    """Every state dict entry of `model`, assembled whole (collective), against `want` (the
    reference's state dict); returns the largest difference."""
    got = model.state_dict()
    assert list(got) == list(want), f"{what}: state dict keys {list(got)} != reference {list(want)}"
    worst = 0.0
    for name, value in got.items():
        full = whole(value)
        torch.testing.assert_close(full, want[name], atol=atol, rtol=rtol, msg=lambda m: f"{what}: {name}: {m}")
        worst = max(worst, float((full.float() - want[name].float()).abs().max()))
    return worst


def _train(
    config: Config, label: str, model: nn.Module, ref: nn.Module, plan: ShardingPlan, dense_modules: set[type],
    loss_of: Callable[[nn.Module, int, bool], torch.Tensor], atol: float = ATOL, rtol: float = 0.0,
) -> float:
    """`STEPS` steps of both sides; `loss_of(module, step, sharded)` is the loss of this rank's batch
    (sharded) or of the global batch (the reference). Returns the largest difference seen. A
    "plain" dense part averages its gradients over the ranks by hand, as DDP would."""
    opt = _prepare(model, config, plan, dense_modules)
    ref_opt = Reference(ref, [f"{fqn}." if fqn else "" for fqn in plan.modules], config.fused)
    tables = modular.ignored_params(model)
    by_hand = [p for p in model.parameters() if p not in tables] if config.dense == "plain" else []
    worst = 0.0
    for step in range(STEPS):
        loss = loss_of(model, step, True)
        loss.backward()
        for p in by_hand:  # without DDP or FSDP, the dense gradients are averaged here
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        ref_loss = loss_of(ref, step, False)
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        got = global_loss(loss)
        if abs(got - ref_loss.item()) > atol + rtol * abs(ref_loss.item()):
            raise AssertionError(f"{label}: step {step} loss {got} (mean over ranks), reference {ref_loss.item()}")
        worst = max(worst, assert_state_matches(model, ref.state_dict(), f"{label}: after step {step}", atol, rtol))
    return worst


# -- the two-tower models --------------------------------------------------------------------------


def two_tower_ebc() -> EmbeddingBagCollection:
    """A query table and a candidate table of one dim, as TwoTower requires."""
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t_query", num_embeddings=11, embedding_dim=DIM, feature_names=["user_id"]),
        EmbeddingBagConfig(name="t_cand", num_embeddings=13, embedding_dim=DIM, feature_names=["item_id"]),
    ])  # fmt: skip


def _bags(keys: list[str], rows: list[int], seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = [torch.randint(0, 4, (BATCH,), generator=g) for _ in keys]
    values = [torch.randint(0, n, (int(l.sum()),), generator=g) for n, l in zip(rows, lengths)]
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def _labels(seed: int) -> torch.Tensor:
    return torch.randint(0, 2, (BATCH,), generator=torch.Generator().manual_seed(seed)).float()


def two_tower_batch(step: int, rank: int) -> Batch:
    seed = 1000 * step + rank
    return Batch(dense_features=torch.zeros(BATCH, 0), sparse_features=_bags(["user_id", "item_id"], [11, 13], seed),
                 labels=_labels(seed))  # fmt: skip


class ExactIndex:
    """A nearest-neighbour index over fixed vectors, exact and in torch, with faiss's torch `search`
    (`search(x, k, D, I)` fills distances and ids). `min_gap` is the smallest margin seen between the
    k-th and the next distance: above the models' differences, both sides pick the same ids."""

    def __init__(self, vectors: torch.Tensor, ids: torch.Tensor) -> None:
        self.vectors, self.ids, self.min_gap = vectors, ids, float("inf")

    def search(self, x: torch.Tensor, k: int, distances: torch.Tensor, labels: torch.Tensor) -> None:
        d = torch.cdist(x.detach(), self.vectors) ** 2
        order = d.sort(dim=1)
        distances.copy_(order.values[:, :k])
        labels.copy_(self.ids[order.indices[:, :k]])
        self.min_gap = min(self.min_gap, float((order.values[:, k] - order.values[:, k - 1]).min()))


def two_tower_retrieval(seed: int) -> TwoTowerRetrieval:
    torch.manual_seed(seed)
    tables = two_tower_ebc().embedding_bag_configs()
    g = torch.Generator().manual_seed(7)
    index = ExactIndex(torch.randn(7, 4, generator=g), torch.tensor([0, 2, 3, 5, 8, 11, 12]))
    return TwoTowerRetrieval(
        index, EmbeddingBagCollection(tables=[tables[0]]), EmbeddingBagCollection(tables=[tables[1]]),
        layer_sizes=[DIM, 4], k=2,
    )  # fmt: skip


RETRIEVAL_MODULES = {"query_ebc": ["t_query"], "candidate_ebc": ["t_cand"]}


def _retrieval_loss(model: nn.Module, step: int, sharded: bool) -> torch.Tensor:
    """The two-tower batch's loss: its KJT holds the candidate feature too, which the query EBC
    (as torchrec's modules do) leaves alone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [two_tower_batch(step, r) for r in ([rank] if sharded else range(world))]
    kjt = global_batch([b.sparse_features for b in batches])
    return F.binary_cross_entropy_with_logits(model(kjt), torch.cat([b.labels for b in batches]))


TWO_TOWER_CONFIGS = [
    Config("table_wise"),
    Config("row_wise", dense="ddp"),
    Config("column_wise", fused=True),
    Config("data_parallel", dense="fsdp"),
    Config("mixed", fused=True, dense="ddp"),
    Config("mixed", dense="fsdp"),
    Config("row_wise", fused=True, dense="fsdp"),
    Config("mixed_dp", fused=True),
]
RETRIEVAL_CONFIGS = [Config("mixed"), Config("row_wise", fused=True, dense="ddp"), Config("column_wise", dense="fsdp")]


def _two_tower_parity() -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for config in TWO_TOWER_CONFIGS:
        label = f"TwoTower [{config}], rank {rank}/{world}"
        torch.manual_seed(0)
        ref = TwoTowerTrainTask(TwoTower(two_tower_ebc(), layer_sizes=[DIM, 4]))
        model = copy.deepcopy(ref)

        def loss_of(m: nn.Module, step: int, sharded: bool) -> torch.Tensor:
            batches = [two_tower_batch(step, r) for r in range(world)]
            if sharded:
                return m(batches[rank])[0]
            return m(Batch(dense_features=torch.zeros(BATCH * world, 0),
                           sparse_features=global_batch([b.sparse_features for b in batches]),
                           labels=torch.cat([b.labels for b in batches])))[0]  # fmt: skip

        plan = _plan(config.plan, {"two_tower.ebc": ["t_query", "t_cand"]}, world)
        out[label] = _train(config, label, model, ref, plan, {MLP}, loss_of)
    for config in RETRIEVAL_CONFIGS:
        label = f"TwoTowerRetrieval [{config}], rank {rank}/{world}"
        ref = two_tower_retrieval(0)
        model = copy.deepcopy(ref)
        out[label] = _train(config, label, model, ref, _plan(config.plan, RETRIEVAL_MODULES, world), {MLP}, _retrieval_loss)
        if ref.faiss_index.min_gap < 1e-3:
            raise AssertionError(f"{label}: the index's k-th and next distances are {ref.faiss_index.min_gap} apart")
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLDS)
def test_two_tower_models_match_unsharded(world_size: int) -> None:
    results = run_on_ranks(world_size, _two_tower_parity, timeout=TIMEOUT)
    for r in results:
        assert len(r) == len(TWO_TOWER_CONFIGS) + len(RETRIEVAL_CONFIGS)
        assert max(r.values()) <= ATOL


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: whole(v).clone() for n, v in model.state_dict().items()}


def _retrieval_checkpoint(root: str) -> None:
    """Trained under one plan, saved, loaded under another; exported to one process, and loaded
    from that file under a third plan: every weight equal, and training goes on identically."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def build(seed: int, case: str, fused: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = two_tower_retrieval(seed)
        tables = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=FUSED_LR, eps=EPS) if fused else None
        modular.shard(model, _plan(case, RETRIEVAL_MODULES, world))
        modular.apply_fully_shard(model, modules={MLP}) if fused else modular.apply_ddp(model)
        dense = torch.optim.Adagrad(modular.local_parameters(model), lr=LR)
        return model, (modular.CombinedOptimizer({"tables": tables, "dense": dense}) if fused else dense)

    def train(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
        loss = _retrieval_loss(model, step, True)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return global_loss(loss)

    for fused, (saved_plan, loaded_plan) in ((False, ("mixed", "table_wise")), (True, ("column_wise", "row_wise"))):
        label = f"TwoTowerRetrieval {'fused' if fused else 'unfused'} {saved_plan} -> {loaded_plan}, rank {rank}/{world}"
        path = os.path.join(root, f"ckpt_{world}_{fused}")
        model, opt = build(0, saved_plan, fused)
        for step in range(2):
            train(model, opt, step)
        modular.checkpoint.save(path, model, opt)
        saved = _whole(model)
        other, other_opt = build(1, loaded_plan, fused)  # other weights until loaded
        modular.checkpoint.load(path, other, other_opt)
        for name, value in _whole(other).items():
            assert torch.equal(value, saved[name]), f"{label}: {name} differs after load"
        # the optimizer state came along: one more step is the same on both
        if abs(train(model, opt, 2) - train(other, other_opt, 2)) > ATOL:
            raise AssertionError(f"{label}: the step after load has another loss")
        assert_state_matches(other, _whole(model), f"{label}: after a step past the load")

        exported = modular.checkpoint.export(model)
        file = os.path.join(root, f"export_{world}_{fused}.pt")
        whole = _whole(model)
        if rank == 0:
            single = two_tower_retrieval(2)
            single.load_state_dict(exported, True)  # torchrec's override: (state_dict, strict)
            for name, value in single.state_dict().items():
                assert torch.equal(value, whole[name]), f"{label}: exported {name} differs"
            torch.save(exported, file)
        else:
            assert exported is None, f"{label}: export returned a state dict on rank {rank}"
        dist.barrier()
        fresh, _ = build(3, "data_parallel" if fused else "row_wise", fused)
        modular.checkpoint.load_unsharded(fresh, file)
        for name, value in _whole(fresh).items():
            assert torch.equal(value, whole[name]), f"{label}: {name} differs after load_unsharded"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLDS)
def test_two_tower_retrieval_checkpoints_across_plans(world_size: int, tmp_path: Path) -> None:
    run_on_ranks(world_size, _retrieval_checkpoint, str(tmp_path), timeout=TIMEOUT)


# -- BERT4Rec --------------------------------------------------------------------------------------


def bert4rec_batch(step: int, rank: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """Item sequences of 0 to MAX_LEN + 1 ids (one longer than the model reads: it is cut), ids
    1.. (0 pads), and a target item per position (0: no target)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, MAX_LEN + 2, (BATCH,), generator=g)
    values = torch.randint(1, VOCAB, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(keys=["item"], values=values, lengths=lengths), torch.randint(0, VOCAB, (BATCH, MAX_LEN), generator=g)


def _bert4rec_loss(model: nn.Module, step: int, sharded: bool) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [bert4rec_batch(step, r) for r in ([rank] if sharded else range(world))]
    kjt = global_batch([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    logits = model(kjt)
    # summed over the targets, divided by the positions: the mean over ranks of the per-rank
    # losses is the global batch's loss, whatever number of targets each rank has
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=0, reduction="sum") / labels.numel()


def _rounding_hook(dtype: torch.dtype, keep: bool):
    """A forward hook rounding an EC's rows as `output_dtype` (keep) or `comm_dtype` does."""

    def hook(module: nn.Module, args, out):
        return {k: JaggedTensor(values=jt.values().to(dtype) if keep else jt.values().to(dtype).float(), lengths=jt.lengths())
                for k, jt in out.items()}  # fmt: skip

    return hook


BERT4REC_CONFIGS = [
    Config("row_wise"),
    Config("column_wise", fused=True, dense="ddp"),
    Config("table_wise", dense="fsdp"),
    Config("data_parallel", fused=True),
    Config("table_row_wise", dense="ddp"),
    Config("row_wise", options=(("tensor_type", "dtensor"),)),
    Config("column_wise", fused=True, options=(("tensor_type", "dtensor"),)),
    Config("row_wise", options=(("output_dtype", torch.float16),)),
    Config("column_wise", fused=True, dense="ddp", options=(("output_dtype", torch.float16),)),
    Config("table_wise", options=(("comm_dtype", torch.float16),)),
    Config("row_wise", fused=True, options=(("comm_dtype", torch.bfloat16),)),
    Config("column_wise", dense="fsdp", options=(("comm_dtype", torch.bfloat16),)),
]


def _bert4rec_parity() -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for config in BERT4REC_CONFIGS:
        label = f"BERT4Rec [{config}], rank {rank}/{world}"
        torch.manual_seed(0)
        ref = BERT4Rec(vocab_size=VOCAB, max_len=MAX_LEN, emb_dim=DIM, nhead=2, num_layers=1, dropout=0.0)
        model = copy.deepcopy(ref)
        options = dict(config.options)
        rounded = options.get("output_dtype") or options.get("comm_dtype")
        atol, rtol = (ATOL, 0.0) if rounded is None else (ATOL, ROUNDING[rounded])
        if rounded is not None and config.fused:
            # Row-wise Adagrad scales a row's gradient by 1 / its rms, so a gradient element rounded
            # the other way (the two sides' pre-rounding values differ in the last fp32 bits) moves
            # its update by up to lr * rounding * sqrt(DIM); allowed twice over the steps.
            atol += FUSED_LR * ROUNDING[rounded] * 2 * DIM**0.5
        if rounded is not None:
            ref.history.ec.register_forward_hook(_rounding_hook(rounded, keep="output_dtype" in options))
        rows: dict[str, list] = {"model": [], "ref": []}
        plan = _plan(config.plan, {"history.ec": ["item_embedding"]}, world)

        def loss_of(m: nn.Module, step: int, sharded: bool) -> torch.Tensor:
            if not rows["model" if sharded else "ref"]:
                m.history.ec.register_forward_hook(lambda mod, a, o: rows["model" if sharded else "ref"].append(o))
            return _bert4rec_loss(m, step, sharded)

        # FSDP2 wraps HistoryArch, not TransformerBlock: BERT4Rec calls `transformer.forward(x, mask)`,
        # which skips the module hooks that gather a fully sharded module's parameters.
        out[label] = _train(config, label, model, ref, plan, {HistoryArch}, loss_of, atol, rtol)
        _check_rows(rows, config, label, atol, rtol)
    return out


def _check_rows(rows: dict[str, list], config: Config, label: str, atol: float, rtol: float) -> None:
    """The sharded EC's rows (this rank's sequences) against the reference's rows of them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = dict(config.options).get("output_dtype", torch.float32)
    assert len(rows["model"]) == len(rows["ref"]) == STEPS
    for step, (got, want) in enumerate(zip(rows["model"], rows["ref"])):
        lengths = [int(bert4rec_batch(step, r)[0].lengths().sum()) for r in range(world)]
        mine = slice(sum(lengths[:rank]), sum(lengths[: rank + 1]))
        assert list(got) == ["item"], f"{label}: EC output keys {list(got)}"
        values = got["item"].values()
        assert values.dtype == dtype, f"{label}: step {step} EC rows in {values.dtype}, expected {dtype}"
        # At step 0 both sides' tables are equal, so the rows are the reference's rounded ones
        # exactly; later, the tables differ by what the weights may.
        tol = 0.0 if step == 0 else atol
        torch.testing.assert_close(values.float(), want["item"].values()[mine].float(), atol=tol, rtol=tol and rtol,
                                   msg=lambda m: f"{label}: step {step} EC rows: {m}")  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", WORLDS)
def test_bert4rec_matches_unsharded(world_size: int) -> None:
    results = run_on_ranks(world_size, _bert4rec_parity, timeout=TIMEOUT)
    for r in results:
        assert len(r) == len(BERT4REC_CONFIGS)
