"""fbgemm's exact fused optimizers, done in torch on the rows a step looked up.

# Note [emulated fused kernels]
Where fbgemm's fused kernel would be wrong or cannot run (Note [fused tables] in modular/fused/choice.py)
the lookup still runs fbgemm's TBE forward, but backward computes a *sparse* gradient: for each
table, the unique rows its ids touched and their summed gradients (never a dense (rows, dim)
buffer). At the end of backward the owning module applies the update to those rows alone, after
the collectives that make it exact: the per-row statistic of row-wise Adagrad summed over a
column-wise table's shards, and data-parallel gradients averaged over ranks. Rows count as
touched when a step looked them up, which is also what fbgemm's weight decay uses.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from modular.comm import KeptBuffers, all_gather
from modular.kernels.base import KernelLookup, dense_tbe
from modular.kernels.lookups import Lookup, all_gather_packed
from modular.fused.row_grads import summed_row_grads
from modular.profiling import REPLICA_SYNC, label
from modular.tables.layout import KernelGroup
from modular.tables.replicas import Replicas


class RowGrad(NamedTuple):
    """A table's sparse gradient: unique rows (ascending) and their summed gradients."""

    rows: torch.Tensor  # (k,) int64
    grad: torch.Tensor  # (k, cols)


class EmulatedFusedKernel:
    """One kernel group with fbgemm's forward and the optimizer applied in torch (see the Note)."""

    nobag = False  # the dense TBE's forward: sequences as bags of one (Note [sequence lookups])

    def __init__(
        self, group: KernelGroup, sizes: list[tuple[int, int]], device: torch.device, config
    ) -> None:
        self.group = group
        self.sizes = sizes
        self.config = config
        self.tbe = dense_tbe(group, sizes, device)
        self.tbe.weights.requires_grad_(False)
        self.views, start = [], 0
        for rows, cols in sizes:
            view = self.tbe.weights.detach()[start : start + rows * cols].view(rows, cols)
            self.views.append(torch.nn.Parameter(view, requires_grad=False))
            start += rows * cols
        name = config.optimizer.state_name()
        self.states = []
        for rows, cols in sizes:
            shape = (rows,) if config.optimizer.rowwise() else (rows, cols)
            self.states.append({} if name is None else {name: torch.zeros(shape, device=device)})
        self.pending: list[list[Optional[RowGrad]]] = []
        self._placeholder = torch.zeros(0, device=device, requires_grad=True)
        dims = [r.shard.num_cols for r in group.routes]
        self._route_cols = [sum(dims[:i]) for i in range(len(dims))]
        self._across: Optional[Replicas] = None
        self._kept = KeptBuffers()  # all_gather_means' buffers (Note [kept receive buffers])

    def replicate_across(self, replicas: Replicas) -> None:
        """Makes `take_pending` the mean over every replica group's gradients (Note [exact
        replicas] in modular/kernels/exact_replicas.py)."""
        self._across = replicas

    def __call__(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
    ) -> torch.Tensor:
        return KernelLookup.apply(self._placeholder, self, indices, offsets, weights)

    def backward(self, batch: Lookup) -> None:
        """Records this lookup's sparse gradient for the update at the end of backward."""
        self.pending.append(self.sparse_grads(*batch))

    def sparse_grads(
        self,
        grad_out: torch.Tensor,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        weights: Optional[torch.Tensor],
    ) -> list[Optional[RowGrad]]:
        """Each kernel table's gradient from the pooled outputs' gradient, as (rows, sums)
        (`summed_row_grads`, modular/fused/row_grads.py)."""
        got = summed_row_grads(
            self.group, len(self.sizes), self._route_cols, grad_out, indices, offsets, weights
        )
        return [None if g is None else RowGrad(*g) for g in got]

    def take_pending(self) -> list[Optional[RowGrad]]:
        """The gradients of every backward since the last update, summed per table; under
        exact replicas, their mean over every replica group's (Note [exact replicas])."""
        return take_every_pending([self])[0]

    def _own_pending(self) -> list[Optional[RowGrad]]:
        pending, self.pending = self.pending, []
        out: list[Optional[RowGrad]] = []
        for t, (_, cols) in enumerate(self.sizes):
            parts = [p[t] for p in pending if p[t] is not None]
            if not parts:
                out.append(None)
            elif len(parts) == 1:
                out.append(parts[0])
            else:
                rows = torch.cat([p.rows for p in parts])
                out.append(_coalesce(rows, [p.grad for p in parts], cols))
        return out

    def decayed(self, t: int, g: RowGrad) -> torch.Tensor:
        """grad + weight_decay * weight on the touched rows (fbgemm's L2 mode)."""
        wd = self.config.weight_decay
        if wd == 0.0:
            return g.grad
        return g.grad + wd * self.views[t].detach().index_select(0, g.rows).float()

    @torch.no_grad()
    def apply(
        self, grads: list[Optional[RowGrad]], row_means: Optional[list[Optional[torch.Tensor]]] = None
    ) -> None:
        """One optimizer step on the touched rows of each table.

        `row_means[t]`, when given, is row-wise Adagrad's mean of grad**2 over all of a
        column-wise table's shards, one per touched row (`grads[t].rows`, the same sorted rows
        on every shard), replacing this shard's own mean.
        """
        cfg = self.config
        name = cfg.optimizer.state_name()
        for t, g in enumerate(grads):
            if g is None:
                continue
            weight, rows = self.views[t], g.rows
            grad = self.decayed(t, g)
            spread = rows[:, None].expand(-1, weight.shape[1])
            if name is None:
                _add_rows(weight, rows, spread, grad * -cfg.lr, round_step=True)
                continue
            state = self.states[t][name]
            if cfg.optimizer.rowwise():
                given = row_means[t] if row_means else None
                if given is not None and given.numel() != rows.numel():
                    raise RuntimeError(
                        f"kernel table {t}: {given.numel()} row means for {rows.numel()} "
                        "touched rows; every column shard must touch the same rows"
                    )
                mean_sq = given if given is not None else (grad * grad).mean(1)
                total = state.index_select(0, rows) + mean_sq
                state.index_copy_(0, rows, total)
                step = grad / (total.sqrt() + cfg.eps)[:, None]
            else:
                total = state.index_select(0, rows) + grad * grad
                state.index_copy_(0, rows, total)
                step = grad / (total.sqrt() + cfg.eps)
            rowwise = cfg.optimizer.rowwise()
            _add_rows(weight, rows, spread, step.mul_(-cfg.lr), round_step=not rowwise)


def take_every_pending(kernels: list[EmulatedFusedKernel]) -> list[list[Optional[RowGrad]]]:
    """Each kernel's `take_pending`, the means over replica groups of all of them (a module's
    kernels) in the same two all-gathers (Note [exact replicas] in modular/kernels/exact_replicas.py)."""
    out = {id(k): k._own_pending() for k in kernels}
    across = [k for k in kernels if k._across is not None]
    if across:
        with label(REPLICA_SYNC):  # Note [profiler labels] in modular/profiling.py
            average_in_place(across, out, world=across[0]._across.size, group=across[0]._across.group)
    return [out[id(k)] for k in kernels]


def average_in_place(
    kernels: list[EmulatedFusedKernel], grads: dict[int, list[Optional[RowGrad]]], *, world: int, group
) -> None:
    """Replaces `grads[id(k)]` of each of `kernels` by its mean over the `world` ranks of
    `group` (`all_gather_means`: two all-gathers for all of them); nothing for no kernels."""
    if kernels:
        means = all_gather_means(kernels, [grads[id(k)] for k in kernels], world=world, group=group)
        grads.update(zip(map(id, kernels), means))


def all_gather_means(
    kernels: list[EmulatedFusedKernel], grads: list[list[Optional[RowGrad]]], *, world: int, group
) -> list[list[Optional[RowGrad]]]:
    """Every rank's touched rows and gradients of each kernel's tables (`grads[k]`), summed in
    rank order and divided by `world`, so every rank applies the same mean gradient; for all
    `kernels` in two collectives, the same order on every rank: the row counts, then the rows
    and gradients together (Note [one gather per batch] in modular/kernels/lookups.py)."""
    device = kernels[0]._placeholder.device
    per_table = [(i, t, cols) for i, k in enumerate(kernels) for t, (_, cols) in enumerate(k.sizes)]
    mine = [g for per_kernel in grads for g in per_kernel]
    counts = torch.tensor([0 if g is None else g.rows.numel() for g in mine], device=device)
    # The only read back from the device: every rank's row counts, once.
    every = all_gather(counts, group=group, world=world, what="a holder's row counts").tolist()
    empty = torch.zeros(0, device=device)
    rows = [empty.long() if g is None else g.rows.long() for g in mine]
    vals = [empty if g is None else g.grad.reshape(-1).float() for g in mine]
    sizes = [n + [c * w for c, (_, _, w) in zip(n, per_table)] for n in every]
    got = all_gather_packed(rows + vals, sizes, group, world, kept=kernels[0]._kept,
                            what="the holders' touched rows and their gradients")  # fmt: skip
    out: list[list[Optional[RowGrad]]] = [[] for _ in kernels]
    tables = len(per_table)
    for j, (i, t, width) in enumerate(per_table):
        ids = torch.cat([got[r][j] for r in range(world)])
        if ids.numel() == 0:
            out[i].append(None)
            continue
        parts = [got[r][tables + j].view(-1, width) for r in range(world)]
        summed = _coalesce(ids, parts, width, kept=(kernels[i]._kept, f"summed {t}"))
        out[i].append(RowGrad(summed.rows, summed.grad.div_(world)))
    return out


def _add_rows(
    weight: torch.Tensor, rows: torch.Tensor, spread: torch.Tensor, step: torch.Tensor, *,
    round_step: bool,
) -> None:
    """weight[rows] += step (rows unique). An FP16/BF16 table's rows are widened to FP32 and
    the sum rounded to nearest once; with `round_step` the FP32 step is first rounded to the
    table's dtype too, as fbgemm's CPU exact-SGD and Adagrad kernels do (its row-wise Adagrad
    does not): Note [low-precision tables] in modular/kernels/table_dtypes.py. Deterministic, so
    data-parallel copies and replica groups that apply the same step stay bit-identical."""
    if weight.dtype is torch.float32:
        weight.scatter_add_(0, spread, step)  # rows are unique: a scatter
        return
    if round_step:
        step = step.to(weight.dtype).float()
    updated = weight.index_select(0, rows).float().add_(step)
    weight.index_copy_(0, rows, updated.to(weight.dtype))


def _coalesce(
    ids: torch.Tensor,
    grads: list[torch.Tensor],
    cols: int,
    *,
    kept: Optional[tuple[KeptBuffers, str]] = None,
) -> RowGrad:
    """The unique rows of `ids` and each one's gradients summed in the order of `ids`, whose
    rows `grads` hold one part after another (added part by part: no copy of them all); into
    a kept buffer, `kept` = (buffers, key), when given (Note [kept receive buffers])."""
    rows, inverse = torch.unique(ids.long(), return_inverse=True)
    if kept is None:
        summed = torch.zeros(rows.numel(), cols, dtype=grads[0].dtype, device=grads[0].device)
    else:
        buffers, key = kept
        summed = buffers.empty(key, rows.numel() * cols, grads[0]).view(-1, cols).zero_()
    start = 0
    for part in grads:
        summed.index_add_(0, inverse[start : start + part.shape[0]], part)
        start += part.shape[0]
    return RowGrad(rows, summed)
