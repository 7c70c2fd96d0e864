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
`MomentUpdates` in modular/fused/moments.py sums each piece's share over the pieces' ranks), so
every plan trains as the unsharded table does. fbgemm-gpu-cpu 1.8.0 has none of these kernels
("Optimizer adam is not supported in CPU mode"), so on CPU every shard takes this emulation (its
sparse gradient: Note [emulated fused kernels]); off CPU fbgemm's kernels run whole tables and
column pieces under plain adam (whose statistics are per element), the emulation the rest
(column pieces whose rows need whole-row statistics, data-parallel copies, odd widths).
tests/gpu/test_cuda_adam.py holds this emulation to fbgemm's CUDA kernels.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Optional

import torch

from modular.fused.emulated import EmulatedFusedKernel, RowGrad
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

    `apply` updates a block of rows at a time from gathering them to writing them back (Note
    [updating rows in blocks]): tables whose rows this kernel holds whole, and column pieces
    once partial_rowwise_adam's row means are combined (`grad_square_sums`, summed over the
    pieces by the owning module's `MomentUpdates`). LAMB's column pieces take it in two phases,
    their rows' norms summed across the pieces between them: `directions` (moves the moments),
    `step_rows`."""

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
        """LAMB's first phase: moves each touched row's moments and returns its r (with
        wd * w added) and the row's sums of w**2 and r**2 over this shard's columns, a block of
        rows at a time; `row_means[t]`: partial_rowwise's mean of g**2 over the whole row."""
        out: list[Optional[Direction]] = []
        for i, g in enumerate(grads):
            if g is None:
                out.append(None)
                continue
            n, cols = g.rows.numel(), self.sizes[i][1]
            r, sums = torch.empty_like(g.grad), g.grad.new_empty(n, 2)
            block = min(n, _block_rows(cols))
            w_buf, v_buf = g.grad.new_empty(block, cols), self._second_moment_buffer(i, block)
            for lo, hi in self._blocks(i, n):
                mean = None if row_means[i] is None else row_means[i][lo:hi]
                w = w_buf[: hi - lo]
                d = self._direction(i, g.rows[lo:hi], g.grad[lo:hi], mean, r[lo:hi],
                                    v_buf[: hi - lo], w)  # fmt: skip
                torch.stack(((w * w).sum(1), (d * d).sum(1)), dim=1, out=sums[lo:hi])
            out.append(Direction(r, sums))
        return out

    @torch.no_grad()
    def step_rows(
        self,
        grads: list[Optional[RowGrad]],
        directions: list[Optional[Direction]],
        norm_squares: list[Optional[torch.Tensor]],
    ) -> None:
        """LAMB's second phase: the weight update on each touched row; `norm_squares[t]`: the
        whole rows' (sum of w**2, sum of r**2)."""
        for i, (g, d) in enumerate(zip(grads, directions)):
            if g is None:
                continue
            for lo, hi in self._blocks(i, g.rows.numel()):
                sums = norm_squares[i][lo:hi]
                ratio = sums[:, 0].sqrt() / sums[:, 1].sqrt()
                self._step(i, g.rows[lo:hi], d.r[lo:hi], None, ratio)

    @torch.no_grad()
    def apply(
        self,
        grads: list[Optional[RowGrad]],
        row_means: Optional[list[Optional[torch.Tensor]]] = None,
    ) -> None:
        """The whole update, a block of rows at a time (Note [updating rows in blocks]), for
        tables whose rows this kernel holds whole (their statistics are this shard's own), and
        for partial_rowwise_adam's column pieces given `row_means`, the whole rows' means of
        g**2 (per kernel table, None for this shard's own)."""
        kind = self.config.optimizer
        reads_w = kind.trust_ratio() or bool(self.config.weight_decay)
        for i, g in enumerate(grads):
            if g is None:
                continue
            cols = self.sizes[i][1]
            block = min(g.rows.numel(), _block_rows(cols))
            r_buf = g.grad.new_empty(block, cols)
            w_buf = g.grad.new_empty(block, cols) if reads_w else None
            v_buf = self._second_moment_buffer(i, block)
            for lo, hi in self._blocks(i, g.rows.numel()):
                rows, grad, n = g.rows[lo:hi], g.grad[lo:hi], hi - lo
                mean = None
                if kind.partial_rowwise():
                    given = None if row_means is None else row_means[i]
                    mean = (grad * grad).sum(1) / cols if given is None else given[lo:hi]
                w = None if w_buf is None else w_buf[:n]
                r = self._direction(i, rows, grad, mean, r_buf[:n], v_buf[:n], w)
                ratio = None
                if kind.trust_ratio():
                    ratio = (w * w).sum(1).sqrt() / (r * r).sum(1).sqrt()
                self._step(i, rows, r, w, ratio)

    def _blocks(self, t: int, n: int) -> Iterator[tuple[int, int]]:
        """(first, end) of each block of `n` touched rows of kernel table `t`."""
        step = _block_rows(self.sizes[t][1])
        return ((lo, min(lo + step, n)) for lo in range(0, n, step))

    def _second_moment_buffer(self, t: int, n: int) -> torch.Tensor:
        rowwise = self.config.optimizer.partial_rowwise()
        return torch.empty((n,) if rowwise else (n, self.sizes[t][1]), device=self.views[t].device)

    def _direction(
        self,
        t: int,
        rows: torch.Tensor,
        grad: torch.Tensor,
        mean: Optional[torch.Tensor],
        m: torch.Tensor,
        v: torch.Tensor,
        w: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """Moves the moments of a block of touched rows and returns their r, in `m`'s buffer;
        gathers their weights (FP32) into `w` where the update reads them (LAMB, weight decay),
        and adds LAMB's wd * w to r. `m`, `v`, `w`: buffers of the block's shape."""
        cfg = self.config
        kind = cfg.optimizer
        (b1, b2), eps, wd = cfg.betas, cfg.eps, cfg.weight_decay
        t_step = self.steps.value  # >= 1: the forward of this backward counted itself
        bias1, bias2 = 1.0 - b1**t_step, 1.0 - b2**t_step
        state = self.states[t]
        torch.index_select(state["exp_avg"], 0, rows, out=m).mul_(b1).add_(grad, alpha=1.0 - b1)
        state["exp_avg"].index_copy_(0, rows, m)
        torch.index_select(state["exp_avg_sq"], 0, rows, out=v).mul_(b2)
        if kind.partial_rowwise():
            v.add_(mean, alpha=1.0 - b2)
        else:
            v.addcmul_(grad, grad, value=1.0 - b2)
        state["exp_avg_sq"].index_copy_(0, rows, v)
        denominator = v.div_(bias2).sqrt_().add_(eps)  # v is stored: reuse its buffer
        if kind.partial_rowwise():
            denominator = denominator[:, None]
        r = m.div_(bias1)  # m is stored too
        if kind.trust_ratio() and kind.partial_rowwise():  # its kernel multiplies by 1/d
            r.mul_(denominator.reciprocal_())
        else:
            r.div_(denominator)
        if w is not None:
            weight = self.views[t].detach()
            if weight.dtype is torch.float32:
                torch.index_select(weight, 0, rows, out=w)
            else:
                w.copy_(weight.index_select(0, rows))
            if kind.trust_ratio() and wd:
                r.add_(w, alpha=wd)
        return r

    def _step(
        self,
        t: int,
        rows: torch.Tensor,
        r: torch.Tensor,
        w: Optional[torch.Tensor],
        ratio: Optional[torch.Tensor],
    ) -> None:
        """weight[rows] -= lr * (LAMB: ratio * r; Adam: r + wd * w), in r's buffer."""
        lr, wd = self.config.lr, self.config.weight_decay
        if ratio is not None:
            step = r.mul_((ratio * -lr)[:, None])
        else:
            if wd:
                r.add_(w, alpha=wd)
            step = r.mul_(-lr)
        weight = self.views[t]
        if weight.dtype is torch.float32:
            weight.index_add_(0, rows, step)  # rows are unique: w + step, once each
        else:  # FP16/BF16: the new row in FP32, rounded to nearest once
            updated = weight.index_select(0, rows).float().add_(step)
            weight.index_copy_(0, rows, updated.to(weight.dtype))


class Direction(NamedTuple):
    """LAMB on one kernel table's touched rows: the update direction r, and each row's sums of
    w**2 and r**2 over this shard's columns, (rows, 2)."""

    r: torch.Tensor
    norm_squares: torch.Tensor


# Note [updating rows in blocks]
# A step's touched rows are scattered over tables far larger than the caches. Gathering all of a
# table's touched rows, updating them and writing them back reads each row's moments and weights
# from memory twice (by the write-back they are evicted), and runs every elementwise pass over
# buffers of tens of MB. Taken a block at a time (1 MiB a buffer), the rows are still cached when
# they are written back and the passes run on cached blocks; LAMB's rows are whole in a block, so
# their norms and the weight update come in the same block too. Measured on the benchmark's
# default config (benchmarks/adam_step.py, 2 ranks, rank 0's CPU time a step, loaded machine),
# with the one sort of row_grads.py: row-wise adam 86 -> 53 ms, row-wise lamb 128 -> 53 ms,
# table-wise lamb 78 -> 51 ms; blocks of 256 KiB and 1 MiB took the same, 4 MiB 20-50% more.
# Every operation is per row or per element, so the blocks change no result, bit for bit.


def _block_rows(cols: int) -> int:
    """Rows per block: 1 MiB of FP32 per (rows, cols) buffer."""
    return max(64, (1 << 18) // max(cols, 1))
