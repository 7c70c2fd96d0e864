"""fbgemm's Adam and LAMB for embedding tables, done in torch on the rows a step looked up.

# Note [fused Adam and LAMB]
`fuse_optimizer(model, name, lr=, betas=(b1, b2), eps=, weight_decay=wd)` with name "adam",
"partial_rowwise_adam", "lamb" or "partial_rowwise_lamb" is fbgemm's optimizer of that name
(`EmbOptimType.ADAM`, ...). Read from fbgemm 1.8.0's CUDA kernels
(fbgemm_gpu/codegen/genscript/optimizers.py: `adam`, `partial_rowwise_adam`, `lamb`,
`partial_rowwise_lamb`; the kernel is what it does where its docs say less), for each row a step
looked up, with g the row's gradient summed over the step's lookups (FP32) and t the step count:
  - Lazy: only rows the step's ids touched change, moments included (a row not looked up keeps
    its moments undecayed, as fbgemm's sparse backward never visits it). A row looked up with a
    zero gradient is still touched: its moments decay and it moves.
  - m = b1*m + (1-b1)*g, per element (exp_avg).
  - adam, lamb: v = b2*v + (1-b2)*g**2 per element (exp_avg_sq);
    partial_rowwise_*: v = b2*v + (1-b2)*mean(g**2 over the row's columns), one per row.
  - Bias correction by t: m_hat = m / (1 - b1**t), v_hat = v / (1 - b2**t). fbgemm's t is its
    TBE's forward count (`iter`, every forward, eval included, and per TBE); here t is the
    module's step count: forwards run with grad enabled, counted once per module forward on every
    rank (`StepCount`), so every shard of every plan corrects by the same t, and fbgemm's CUDA
    kernels are given it before each forward (`FusedKernel`). It is saved as the state `step`.
  - r = m_hat / (sqrt(v_hat) + eps); partial_rowwise_lamb computes it as
    m_hat * (1 / (sqrt(v_hat) + eps)), as its kernel does.
  - adam, partial_rowwise_adam: w -= lr * (r + wd * w), decoupled weight decay on the row's old
    weight (AdamW's form; fbgemm's docs say "decoupled", its kernel adds wd*w inside lr * (...)).
  - lamb, partial_rowwise_lamb: r += wd * w, then w -= lr * (||w|| / ||r||) * r, the norms over
    the whole row (w before the update). fbgemm guards neither norm: a row of zeros never moves
    (ratio 0), and a touched row whose r is all zero gets NaN (0/0 times 0); kept as the kernel
    does.
  - weight_decay is applied as above and nowhere else: never added to g (unlike row-wise
    Adagrad's L2 mode), so neither moment sees it.
  - FP16/BF16 tables: the update is computed in FP32 and the new row rounded once (to nearest
    here; fbgemm's CUDA kernels round stochastically unless told not to); moments stay FP32.
The statistics of a whole row (partial_rowwise's mean of g**2, LAMB's two norms) are combined
across a table's column pieces before they are used (Note [row statistics across column shards]:
`MomentUpdates` in modular/fused/adam.py sums each piece's share over the pieces' ranks), so
every plan trains as the unsharded table does. fbgemm-gpu-cpu 1.8.0 has none of these kernels
("Optimizer adam is not supported in CPU mode"), so on CPU every shard takes this emulation (its
sparse gradient: Note [emulated fused kernels]); off CPU fbgemm's kernels run whole tables and
column pieces under plain adam (whose statistics are per element), the emulation the rest
(column pieces whose rows need whole-row statistics, data-parallel replicas, odd widths).
tests/gpu/test_cuda_adam.py holds this emulation to fbgemm's CUDA kernels.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from modular.kernels.emulated import EmulatedFusedKernel, RowGrad, _add_rows
from modular.tables.layout import KernelGroup

__all__ = ["AdamFusedKernel", "StepCount"]


class StepCount:
    """A fused module's step count, t of Note [fused Adam and LAMB]: forwards with grad enabled.
    One per module, shared by its kernels; the same on every rank (each rank runs every forward)."""

    def __init__(self) -> None:
        self.value = 0

    def advance(self) -> None:
        self.value += 1


class AdamFusedKernel(EmulatedFusedKernel):
    """One kernel group under the Adam family, its update in torch (Note [fused Adam and LAMB]).

    The owning module's `MomentUpdates` runs the update in phases, so that the whole-row
    statistics of column pieces can be summed across ranks between them: `grad_square_sums`,
    `directions` (moves the moments), `norm_squares` (LAMB), `step_rows`. `apply` runs them
    all for tables none of whose rows is cut into column pieces."""

    def __init__(
        self,
        group: KernelGroup,
        sizes: list[tuple[int, int]],
        device: torch.device,
        config,
        *,
        steps: StepCount,
    ) -> None:
        super().__init__(group, sizes, device, config)
        kind = config.optimizer
        self.steps = steps
        self.states = [
            {
                name: torch.zeros((rows,) if kind.row_state(name) else (rows, cols), device=device)
                for name in kind.state_names()
            }
            for rows, cols in sizes
        ]

    def decayed(self, t: int, g: RowGrad) -> torch.Tensor:
        """The gradient the moments see: g itself (weight decay is decoupled, see the Note)."""
        return g.grad

    def grad_square_sums(self, grads: list[Optional[RowGrad]]) -> list[Optional[torch.Tensor]]:
        """Per kernel table, each touched row's sum of g**2 over this shard's columns."""
        return [None if g is None else (g.grad * g.grad).sum(1) for g in grads]

    @torch.no_grad()
    def directions(
        self, grads: list[Optional[RowGrad]], row_means: list[Optional[torch.Tensor]]
    ) -> list[Optional[Direction]]:
        """Moves each touched row's moments and returns its r (with LAMB's wd * w added);
        `row_means[t]`: partial_rowwise's mean of g**2 over the whole row, per touched row."""
        cfg = self.config
        kind = cfg.optimizer
        (b1, b2), eps, wd = cfg.betas, cfg.eps, cfg.weight_decay
        t = self.steps.value  # >= 1: the forward of this backward counted itself
        bias1, bias2 = 1.0 - b1**t, 1.0 - b2**t
        out: list[Optional[Direction]] = []
        for i, g in enumerate(grads):
            if g is None:
                out.append(None)
                continue
            rows, state = g.rows, self.states[i]
            m = _gather(state["exp_avg"], rows).mul_(b1).add_(g.grad, alpha=1.0 - b1)
            state["exp_avg"].index_copy_(0, rows, m)
            v = _gather(state["exp_avg_sq"], rows).mul_(b2)
            if kind.partial_rowwise():
                v.add_(row_means[i], alpha=1.0 - b2)
            else:
                v.addcmul_(g.grad, g.grad, value=1.0 - b2)
            state["exp_avg_sq"].index_copy_(0, rows, v)
            denominator = v.div_(bias2).sqrt_().add_(eps)  # v is stored: reuse its buffer
            if kind.partial_rowwise():
                denominator = denominator[:, None]
            r = m.div_(bias1)  # m is stored too
            if kind.trust_ratio() and kind.partial_rowwise():  # its kernel multiplies by 1/d
                r.mul_(denominator.reciprocal_())
            else:
                r.div_(denominator)
            w = self._rows_fp32(i, rows) if kind.trust_ratio() or wd else None
            if kind.trust_ratio() and wd:
                r.add_(w, alpha=wd)
            out.append(Direction(r, w))
        return out

    def norm_squares(
        self, grads: list[Optional[RowGrad]], directions: list[Optional[Direction]]
    ) -> list[Optional[torch.Tensor]]:
        """LAMB: per kernel table, each touched row's (sum of w**2, sum of r**2) over this
        shard's columns, as a (rows, 2) tensor."""
        return [
            None if d is None else torch.stack(((d.w * d.w).sum(1), (d.r * d.r).sum(1)), dim=1)
            for d in directions
        ]

    @torch.no_grad()
    def step_rows(
        self,
        grads: list[Optional[RowGrad]],
        directions: list[Optional[Direction]],
        norm_squares: Optional[list[Optional[torch.Tensor]]] = None,
    ) -> None:
        """The weight update on each touched row; `norm_squares[t]` (LAMB): the whole rows'
        (sum of w**2, sum of r**2)."""
        cfg = self.config
        lr, wd = cfg.lr, cfg.weight_decay
        for i, (g, d) in enumerate(zip(grads, directions)):
            if g is None:
                continue
            weight, rows, r = self.views[i], g.rows, d.r
            if cfg.optimizer.trust_ratio():
                sums = norm_squares[i]
                ratio = sums[:, 0].sqrt() / sums[:, 1].sqrt()
                step = r.mul_((ratio * -lr)[:, None])
            else:
                if wd:
                    r.add_(d.w, alpha=wd)
                step = r.mul_(-lr)
            spread = rows[:, None].expand(-1, weight.shape[1])
            _add_rows(weight, rows, spread, step, round_step=False)

    @torch.no_grad()
    def apply(
        self,
        grads: list[Optional[RowGrad]],
        row_means: Optional[list[Optional[torch.Tensor]]] = None,
    ) -> None:
        """The whole update for tables whose rows this kernel holds whole (no column pieces
        elsewhere: their statistics are this shard's own)."""
        cols = [c for _, c in self.sizes]
        if row_means is None and self.config.optimizer.partial_rowwise():
            row_means = [
                None if s is None else s / c for s, c in zip(self.grad_square_sums(grads), cols)
            ]
        directions = self.directions(grads, row_means or [None] * len(grads))
        trust = self.config.optimizer.trust_ratio()
        norms = self.norm_squares(grads, directions) if trust else None
        self.step_rows(grads, directions, norms)

    def _rows_fp32(self, t: int, rows: torch.Tensor) -> torch.Tensor:
        return _gather(self.views[t].detach(), rows).float()


class Direction(NamedTuple):
    """One kernel table's update direction r on its touched rows, and their weights (FP32;
    None where the update does not read them)."""

    r: torch.Tensor
    w: Optional[torch.Tensor]


def _gather(state: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`state[rows]`, a new tensor: `embedding` gathers rows of a table faster than
    `index_select` on CPU (0.29 against 0.77 ms for 34,000 rows of 64 floats, one thread)."""
    return F.embedding(rows, state) if state.dim() == 2 else state.index_select(0, rows)
