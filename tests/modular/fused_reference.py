"""The fused optimizers' reference: what `modular.fuse_optimizer` must equal, written in torch.

Used by test_fused.py, the sequence and low-precision tests, and the fuzzing and GPU tests:
`fused_ebc` (`fused_tables`: the EBC cases' tables at widths fbgemm takes and ones it cannot)
trained against `FusedReference`, the same model under the torch equivalent of each fused
optimizer. Exact SGD and Adagrad are torch's own optimizers; exact row-wise Adagrad, which torch
does not have, is `rowwise_adagrad_step`, the one written-out step every test compares with.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from planners.types import ShardingPlan, ShardingType
from tests.modular.ebc_cases import unweighted_tables

FUSED_LR, FUSED_EPS, FUSED_STEPS = 0.3, 1e-3, 5


@torch.no_grad()
def rowwise_adagrad_step(
    weight: torch.Tensor, grad: torch.Tensor, row_sum: torch.Tensor, *, lr: float, eps: float
) -> None:
    """One step of fbgemm's exact row-wise Adagrad, in place: each row's `row_sum` (one entry per
    row, the optimizer's state) gains the mean of the row's squared gradient, and the row moves by
    lr * grad / (sqrt(row_sum) + eps). `weight`, `grad` and `row_sum` may be views (a column piece)."""
    row_sum += (grad * grad).mean(1)
    weight -= lr * grad / (row_sum.sqrt() + eps)[:, None]


def fused_tables() -> list[EmbeddingBagConfig]:
    """`unweighted_tables` at widths fbgemm's fused kernel takes (8, 16) and ones it cannot (7, 5),
    so both kernels of Note [fused tables] are compared against the same reference."""
    return [dataclasses.replace(c, embedding_dim=d) for c, d in zip(unweighted_tables(), (8, 7, 5, 16))]


def fused_ebc(weighted: bool = False) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    if not weighted:
        return EmbeddingBagCollection(tables=fused_tables())
    # Per-sample weights take SUM pooling only (as in torchrec): the same tables, summed, with
    # widths that fbgemm's kernels take whole and in column halves (8 and 16: a kernel group
    # with one odd width is emulated as a whole, which the unweighted tables cover).
    tables = [
        EmbeddingBagConfig(name=c.name, num_embeddings=c.num_embeddings, embedding_dim=dim,
                           feature_names=c.feature_names)
        for c, dim in zip(fused_tables(), (8, 16, 8, 16))
    ]  # fmt: skip
    return EmbeddingBagCollection(tables=tables, is_weighted=True)


class FusedReference:
    """`ebc` (an EBC, or any module of tables) trained with the torch equivalent of a fused optimizer.

    `pieces`: per weight FQN, the (first, end) columns of each column piece that keeps its own
    row-wise Adagrad (column_wise_statistic="per_shard"): each piece is trained as a table of its
    own, whose gradient is its columns' slice of the table's; other tables are one piece.
    """

    def __init__(
        self,
        ebc: nn.Module,
        optimizer: str,
        weight_decay: float = 0.0,
        device: torch.device | None = None,
        pieces: dict[str, list[tuple[int, int]]] | None = None,
    ) -> None:
        self.ebc = ebc
        self.kind = optimizer
        self.weight_decay = weight_decay
        self.lr = FUSED_LR
        params = list(ebc.parameters())
        if optimizer == "exact_sgd":
            self.opt = torch.optim.SGD(params, lr=FUSED_LR)
        elif optimizer == "exact_adagrad":
            self.opt = torch.optim.Adagrad(params, lr=FUSED_LR, eps=FUSED_EPS)
        else:
            self.opt = None
            named = dict(ebc.named_parameters())
            self.pieces = {n: (pieces or {}).get(n, [(0, p.shape[1])]) for n, p in named.items()}
            self.row_sums = {
                n: torch.zeros(p.shape[0], len(self.pieces[n]), device=device)
                for n, p in named.items()
            }

    @torch.no_grad()
    def step(self) -> None:
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad()
            return
        for name, p in self.ebc.named_parameters():
            g = p.grad
            touched = (g != 0).any(1, keepdim=True)
            g = g + self.weight_decay * p * touched  # fbgemm's L2 mode: rows the step touched
            for i, (lo, hi) in enumerate(self.pieces[name]):
                piece_sums = self.row_sums[name][:, i]
                rowwise_adagrad_step(p[:, lo:hi], g[:, lo:hi], piece_sums, lr=self.lr, eps=FUSED_EPS)
            p.grad = None

    def state(self, name: str) -> torch.Tensor | None:
        if self.kind == "exact_sgd":
            return None
        if self.kind == "exact_adagrad":
            return self.opt.state[dict(self.ebc.named_parameters())[name]]["sum"]
        return self.row_sums[name] if len(self.pieces[name]) > 1 else self.row_sums[name][:, 0]


def own_pieces(plan: ShardingPlan, ebc: EmbeddingBagCollection) -> dict[str, list[tuple[int, int]]]:
    """The column ranges of every table the plan cuts into column pieces, by weight FQN."""
    out = {}
    world = plan.world_size
    for c in ebc.embedding_bag_configs():
        placement = plan.modules[""][c.name]
        specs = placement.shards(num_embeddings=c.num_embeddings, embedding_dim=c.embedding_dim, world_size=world)
        if placement.sharding_type is ShardingType.COLUMN_WISE and len(specs) > 1:
            out[f"embedding_bags.{c.name}.weight"] = sorted((s.col_offset, s.col_offset + s.num_cols) for s in specs)
    return out

