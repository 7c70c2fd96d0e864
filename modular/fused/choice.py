"""Which kernel a kernel group gets, and why: one function (`choose_kernel`) over plain facts.

# Note [fused tables]
Fusing is a compute choice, separate from where tables live: `fuse_optimizer` marks an EBC on
meta (`modular.shard` builds its shards fused) or turns a materialised one into a single-process
module with fused kernels, which `modular.shard` cuts into fused shards. The machinery is
`FusedTables` (modular/fused/tables.py), which the sharded module owns; the kernel of each kernel
group is chosen here, by `choose_kernel`, which returns the kernel and the reason (the "modular"
logger says both at DEBUG when `shard` builds a module). Shards whose width is a multiple of 4 use
fbgemm's fused kernel (the others form kernel groups of their own, `kernel_groups` in
modular/tables/layout.py, so they never take a table fbgemm could run into the emulation).
Column-wise shards under row-wise Adagrad (in kernel groups of their own too) use it in two
passes, with the per-row statistic exchanged between the column shards' ranks in between (one
float per id of the step), so the result equals the unsharded table's (`RowStatsFusedKernel`,
Note [row statistics across column shards]; on CPU). Unless `fuse_optimizer(...,
column_wise_statistic="per_shard")` asks for TorchRec's approximation: then each column piece
keeps the statistic of its own columns, as if it were a table of its own, and takes fbgemm's
plain fused kernel like a whole table (one pass, no exchange; the result depends on the plan).
The other cases compute a sparse gradient and apply the identical update in torch at the end of
backward (`EmulatedFusedKernel`): data-parallel copies (touched rows are gathered first, so
they stay identical), shard widths that fbgemm cannot take, weight decay on CPU (fbgemm's CPU
kernel ignores it) and column-wise row-wise Adagrad off CPU. The Adam family ("adam",
"partial_rowwise_adam", "lamb", "partial_rowwise_lamb") takes the emulation on CPU, where fbgemm
has none of its kernels, and off CPU where rows need statistics of the whole row across column
pieces (`AdamFusedKernel`, Note [fused Adam and LAMB] in modular/fused/adam.py). A table
looked up more than once before one backward: fbgemm's own kernel updates once per lookup, the
others once, on the summed gradient (the two agree for SGD up to rounding, not for the Adagrads
or the Adam family, whose step count also advances once per forward).

Optimizer state is keyed by the weight's FQN and named by the optimizer ("sum" for Adagrad,
"row_sum" for row-wise Adagrad, "exp_avg" and "exp_avg_sq" for the Adam family, which also keeps
its module's step count as "step", a plain scalar), never by the sharding type; each state tensor
is a ShardedTensor laid out like its weight (row-wise state, partial_rowwise's exp_avg_sq: one
entry per row), or a plain tensor for data-parallel tables, so DCP saves and reshards it like
the weights (`StateForm` in modular/fused/state.py).
One layout depends on the plan: with column_wise_statistic="per_shard", a table cut into k column
pieces keeps "row_sum" of shape (rows, k), column j the statistic of piece j (pieces left to
right; each piece's shard is (rows, 1) at offsets (0, j)). TorchRec keeps the same numbers as one
(rows * k,) vector, piece j at offset j * rows. Such state loads only into k pieces again (DCP
still moves pieces between ranks). Nothing records the pieces' widths, so k pieces of other
widths would take it as it is (as in TorchRec); a state of one statistic per row loaded where per
piece ones are kept, or per piece ones where one per row (exact, or a table not cut) or k' != k
pieces are kept, is refused naming the table and the fix, by `FusedOptimizer.load_state_dict`
and by `modular.checkpoint.load` before anything is read (`column_statistic_mismatch`). The
exact layout never changes, and tables not cut into column pieces keep one value per row and
train identically in both modes, so their state loads across modes. `modular.shard` of a fused
unsharded model starts each piece from the whole row's statistic, the only one it had.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from modular.fused.config import FusedOptimizerKind
from modular.tables.layout import odd_width

__all__ = ["KernelChoice", "KernelFacts", "KernelKind", "choose_kernel", "emulation_reason"]


class KernelKind(enum.Enum):
    """The kernels a kernel group can get (their classes: modular/kernels/dense.py and
    modular/fused/)."""

    DENSE = "dense"  # DenseKernel: gradients for a torch optimizer
    FBGEMM = "fbgemm"  # FusedKernel: fbgemm's fused update inside its backward
    ROW_STATISTICS = "row_statistics"  # RowStatsFusedKernel: two passes, whole rows' statistic
    REPLAYED = "replayed"  # GatheredFusedKernel: fbgemm's backward over the holders' gathered batch
    EMULATED = "emulated"  # EmulatedFusedKernel: the update in torch, at the end of backward
    ADAM = "adam"  # AdamFusedKernel: the Adam family in torch, at the end of backward


@dataclasses.dataclass(frozen=True)
class KernelFacts:
    """What the choice of one kernel group's kernel reads; plain values, so that a test, a log
    line or a planner can ask the same question without a model."""

    device_type: str  # "cpu", "cuda", ...
    optimizer: Optional[FusedOptimizerKind]  # None: unfused (a torch optimizer steps the tables)
    weight_decay: float = 0.0
    widths: tuple[int, ...] = ()  # the group's shard widths
    data_parallel: bool = False  # data-parallel tables, in a world of more than one rank
    column_rows: bool = False  # column pieces whose rows need the whole row's statistic
    exact_replicas: bool = False  # 2D, replica_sync="exact": copies in other replica groups


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """A kernel group's kernel and the reason for it, e.g. `KernelChoice(EMULATED, because=
    "weight decay on CPU: ...")`. `across_replicas`: the kernel also waits for its copies in the
    other 2D replica groups (Note [exact replicas] in modular/kernels/exact_replicas.py)."""

    kernel: KernelKind
    because: str
    across_replicas: bool = False

    def describe(self) -> str:
        across = " (+ exact 2D replica groups)" if self.across_replicas else ""
        return f"{self.kernel.value}{across}: {self.because}"


def emulation_reason(
    *, device_type: str, optimizer: FusedOptimizerKind, weight_decay: float,
    widths: tuple[int, ...], deferred: Optional[str],
) -> Optional[str]:  # fmt: skip
    """Why a fused kernel over shards of these widths takes the torch emulation (Note [fused
    tables]), or None; `deferred`: why it must run fbgemm's backward ops itself (column-wise row
    statistics, data-parallel copies, replica groups), or None."""
    on_cpu = device_type == "cpu"
    # fbgemm's CPU kernels ignore weight decay and have no Adam family (fbgemm-gpu-cpu 1.8.0;
    # Note [fused Adam and LAMB]).
    if on_cpu and optimizer.adam_family():
        return f"{optimizer.value} on CPU: fbgemm's CPU kernels have no Adam family"
    if on_cpu and weight_decay > 0:
        return f"weight decay {weight_decay} on CPU: fbgemm's CPU kernels ignore it"
    odd = [w for w in widths if odd_width(w)]
    if odd:
        return f"shard width {odd[0]} is not a multiple of 4, which fbgemm's fused kernels need"
    # Note [row statistics across column shards] and Note [fused data-parallel copies] run
    # fbgemm's CPU backward ops directly; other devices take the torch emulation.
    if deferred is not None and not on_cpu:
        return f"{deferred} on {device_type}: fbgemm's backward ops are run directly only on CPU"
    return None


def choose_kernel(facts: KernelFacts) -> KernelChoice:
    """The kernel of one kernel group, and why (Note [fused tables])."""
    across = facts.exact_replicas
    if facts.optimizer is None:
        because = "unfused: gradients into each shard's view for a torch optimizer"
        return KernelChoice(KernelKind.DENSE, because, across_replicas=across)
    optimizer = facts.optimizer
    deferred = (
        "column pieces sharing whole rows' statistic" if facts.column_rows
        else "data-parallel copies" if facts.data_parallel
        else "exact 2D replica groups" if across
        else None
    )  # fmt: skip
    emulated = emulation_reason(
        device_type=facts.device_type, optimizer=optimizer, weight_decay=facts.weight_decay,
        widths=facts.widths, deferred=deferred,
    )  # fmt: skip
    if emulated is not None:
        kind = KernelKind.ADAM if optimizer.adam_family() else KernelKind.EMULATED
        return KernelChoice(kind, f"emulated in torch: {emulated}", across_replicas=across)
    if facts.data_parallel:
        because = "data-parallel copies: fbgemm's backward replayed over every rank's batch"
        return KernelChoice(KernelKind.REPLAYED, because, across_replicas=across)
    if facts.column_rows:
        because = (
            f"column pieces under {optimizer.value}: fbgemm's update in two passes with the "
            "whole row's statistic exchanged between them"
        )
        return KernelChoice(KernelKind.ROW_STATISTICS, because, across_replicas=across)
    if across:
        because = "exact 2D replica groups: fbgemm's backward replayed over every group's batch"
        return KernelChoice(KernelKind.REPLAYED, because, across_replicas=True)
    return KernelChoice(KernelKind.FBGEMM, f"{optimizer.value}: fbgemm's fused kernel", False)
