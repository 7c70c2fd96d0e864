"""The sequence part of the step (`KindPart` in modular/parts.py): fbgemm's sequence kernels
where they take it, each id a bag of one elsewhere (Note [sequence lookups] in
modular/sequence/lookup.py), and an output dist that returns each id's row to its sample's rank
(Note [sequence output dist] in modular/sequence/output.py)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from modular.comm import all_reduce
from modular.local_shards import LocalShards
from modular.parts import Wire
from modular.routing.received import Received
from modular.routing.variable_batch import VariableBatch, segment_sums
from modular.sequence.lookup import lookup_kernels
from modular.sequence.output import Placement, RowGather, RowPlacer, place_rows
from modular.tables.layout import RankLayout

__all__ = ["SequencePart", "Sequences"]


class Sequences(NamedTuple):
    """What `SequencePart.prepare` makes of a batch in the input dist (`Received.extra`)."""

    per_source: torch.Tensor  # (routes on this rank, ranks): ids each rank sent, int64 on the host
    placement: Placement  # where this rank's ids' rows land in the output


class SequencePart:
    """Sequences: the per-kind part of the step (`KindPart` in modular/parts.py). torchrec's EC
    takes no variable-batch KJT (Note [variable batch per feature]), so it is the only part; it
    also runs the steps whose ranks differ in batch size (Note [a batch size per rank])."""

    def __init__(self, at: RankLayout, *, embedding_dim: int, need_indices: bool) -> None:
        self.at, self.layout = at, at.layout
        self.embedding_dim, self.need_indices = embedding_dim, need_indices
        self.placer = RowPlacer(self.layout)  # Note [placing rows without a loop over routes]
        mine = self.layout.routes_to(at.rank)
        self.my_route_features = torch.tensor([r.feature for r in mine], dtype=torch.int64)

    def prepare(
        self, kjt: KeyedJaggedTensor, lengths: torch.Tensor, vbe: Optional[VariableBatch]
    ) -> Sequences:
        """`vbe`: a step whose ranks differ in batch size (Note [a batch size per rank]); each
        route's bags then arrive source by source, as many from a rank as its batch size."""
        if vbe is None:
            batch = kjt.stride()
            per_source = lengths.view(lengths.shape[0], self.at.world, batch).sum(2)
        else:
            bags = vbe.strides[:, self.my_route_features].t()  # (my routes, ranks)
            per_source = segment_sums(lengths, bags.reshape(-1)).view(bags.shape)
        placement = self.placer(kjt.values(), kjt.length_per_key())
        return Sequences(per_source.long().cpu(), placement)

    def lookup(
        self, shards: LocalShards, received: Received
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each route's rows for every rank's ids it received, then this rank's data-parallel
        routes' rows for its own batch (Note [sequence lookups])."""
        counts = received.extra.per_source.sum(1).tolist()
        rows = lookup_kernels(shards.kernels, received.values, counts)
        local_rows: list[torch.Tensor] = []
        if received.local is not None:
            kjt = received.local
            local_counts = kjt.length_per_key()
            local_rows = lookup_kernels(
                shards.local_kernels, kjt.values().long(), local_counts,
                bags=self._copy_bags(local_counts),
            )  # fmt: skip
        return rows, local_rows

    def _copy_bags(self, counts: list[int]) -> Optional[int]:
        """Bags per route of the data-parallel copies: the longest route on any rank (they
        gather every rank's bags in equal shapes, Note [sequence lookups])."""
        if self.at.world == 1:
            return None
        longest = torch.tensor([max(counts, default=0)], dtype=torch.int64)
        all_reduce(
            longest, group=self.at.group, op=dist.ReduceOp.MAX,
            what=f"the data-parallel copies' batch agreement of module {self.at.module!r}",
        )  # fmt: skip
        return max(int(longest), 1)

    def send(self, looked: tuple[list, list], received: Received) -> Wire:
        """Each rank's ids' rows, gathered (Note [gathering rows without a loop over routes])."""
        rows, local_rows = looked
        placement = received.extra.placement
        send, in_splits = None, []
        if self.layout.routes:
            send, in_splits = self.gather(rows, received.extra.per_source)
            send = send.to(self.at.device)
        local = None
        if self.layout.local:
            counts = torch.tensor(placement.counts[len(self.layout.routes) :]).view(-1, 1)
            local = self.local_gather(local_rows, counts)[0]
        return Wire(send, in_splits, placement.arriving, local)

    def place(self, arrived: torch.Tensor, received: Received) -> torch.Tensor:
        return place_rows(arrived, received.extra.placement)

    def wrap(self, out: torch.Tensor, received: Received) -> dict[str, JaggedTensor]:
        """The output as torchrec's EC returns it.

        # Note [low-precision sequences]
        torchrec's unsharded EC returns an FP16 table's rows in FP32 (torchrec 1.8.0: its
        forward widens each nn.Embedding lookup with `.float()`). fbgemm's kernels widen every
        row to FP32 too (Note [low-precision tables] in modular/kernels/table_dtypes.py), and a
        sequence row is a row, not a sum, so ours are the same bits, FP32 on the wire and out.
        Backward differs in rounding only: torchrec rounds each row's gradient to FP16 before
        its embedding backward adds them up; the kernels add a row's FP32 gradients in FP32 and
        round once (into the FP16 `.grad`, or into a fused update with FP32 state).
        `output_dtype` and `comm_dtype` round the rows as they do the EBC's pooled values."""
        kjt = received.kjt
        # torchrec's to_dict cannot split a batch of 0 samples (Note [a batch size per rank])
        features = kjt.to_dict() if kjt.stride() else _empty_features(kjt)
        values = out.view(-1, self.embedding_dim).split(received.extra.placement.rows_per_output)
        result = {}
        for o, rows in zip(self.layout.outputs, values):
            jt = features[o.feature]
            torch._dynamo.maybe_mark_dynamic(rows, 0)  # ids vary by step (Note [compiling a
            # sharded model]): the code after the EC is compiled once for every count
            result[o.key] = JaggedTensor(
                values=rows,
                lengths=jt.lengths(),
                weights=jt.values() if self.need_indices else None,
            )
        return result

    def attach(self, shards: LocalShards) -> None:
        """The row gathers of this rank's kernels, once they exist."""
        # Note [gathering rows without a loop over routes]
        self.gather, self.local_gather = RowGather(shards.kernels), RowGather(shards.local_kernels)


def _empty_features(kjt: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
    """`kjt.to_dict()` of a batch of 0 samples: each feature no lengths and no ids."""
    lengths, values = kjt.lengths(), kjt.values()
    return {f: JaggedTensor(values=values, lengths=lengths) for f in kjt.keys()}
