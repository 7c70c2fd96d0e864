"""Variable batch per feature (VBE): each feature looked up and sent at its own batch size.

# Note [variable batch per feature]
Ranking models deduplicate request-level features: a request's user features are the same for
every candidate, so such a feature holds one bag per request, not one per sample. torchrec says so
in the KeyedJaggedTensor: `stride_per_key_per_rank` (each feature's own bag count, its "stride")
and `inverse_indices` ((keys, (features, batch)): each sample's bag in its feature). Its unsharded
EBC pools each feature's bags and expands them to the batch with the inverse indices.

A sharded EBC moves and looks up only the deduplicated bags, and expands on the sample's rank,
after the output dist:
  * input dist: the header of the ids' exchange carries every rank's strides (Note [ids with
    their header]), so each rank knows how many bags each route brings from each peer; routing
    and the arrival permutation move whole segments of bags (`permute_segments`, where a batch
    of one stride permutes 2-D feature rows);
  * lookup: a kernel takes one bag count for all its routes, so each route's bags are followed by
    empty ones up to the longest route's; empty bags pool to zero, train nothing, and never
    travel. (fbgemm's own variable-batch lookup, `batch_size_per_feature_per_rank`, would skip
    them, but fbgemm-gpu-cpu 1.8.0's CPU op builds its metadata (`generate_vbe_metadata`) with
    a few tensor ops per bag: a forward of 9,216 bags took 37 ms against 1.3 ms padded, and
    int32 offsets corrupted the heap. TorchRec's CPU VBE step spends most of its time there,
    docs/benchmarks.md);
  * output dist: each rank is sent, for each route, just the bags of its own samples' strides;
    one gather expands the arrivals (every rank's, then the local data-parallel ones) to the
    batch, each sample reading its bag's columns where they arrive; where row-wise pieces must
    be summed (or MEANs divided) the arrivals are first added into each feature's deduplicated
    output (`VariableBags` in modular/pooled/variable_bags.py). Backward is the same in
    reverse: the expansion's gradient sums the samples of each bag, and only bags travel.
  * per step: the indices that depend on the strides alone are made once per distinct strides;
    only the expansion's depend on the batch.
So the bytes of both all-to-alls scale with the deduplicated batch. Ranks may differ in their
strides and in their batch sizes (Note [a batch size per rank]). A batch whose strides are all the
batch size costs what it did: nothing above runs for it. Data-parallel copies gather every
rank's bags in equal shapes (Note [dense data-parallel copies]), so their bags are padded to the
largest stride any rank has for their features, which every rank reads from the same headers.

torchrec's EmbeddingCollection has no VBE path, and neither has a sharded one: it refuses such a
batch naming the module. A VBE batch's keys must be the module's features in its order (a
selection of VBE features would have to move whole bags of every feature first; torchrec's
sharded modules ask the same).

# Note [a batch size per rank]
Each rank may pass its own batch size, 0 included (an epoch's last batch, torchrec's
`ModelInput.generate(variable_batch_size=True)`). Every header of the ids' exchange carries its
rank's batch size (Note [ids with their header]), so every rank sees at once whether the sizes
differ (or are all 0) and all take the same path: a step with equal sizes runs the uniform path
at its usual cost; otherwise the step is a variable-batch one whose strides on a rank are that
rank's batch size for every feature (inverse indices the identity), or its VBE strides. The
pooled EBC runs it as above (`VariableBags`); the EC, which has no VBE part, runs its one part,
which reads each route's ids per source rank from the strides (`SequencePart.prepare`). A rank
with 0 samples routes, sends and receives empty segments and returns an output of 0 rows.
Gradients: each rank's output gradient is its own loss's, and a table's gradient is scaled by
1/world (Note [grad scaling across ranks] in modular/comm.py), so the tables are trained on the
mean over ranks of each rank's loss, whatever the batch sizes: a rank's mean loss weighs the
same however few samples it has, as DDP's and FSDP2's averaging of the dense gradients does
(docs/batch_per_rank.md).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = [
    "VariableBatch", "bag_positions", "element_positions", "permute_segments", "strides_of",
]  # fmt: skip


class VariableBatch(NamedTuple):
    """A variable-batch step as the input dist leaves it (`Received.vbe`)."""

    strides: torch.Tensor  # (world, features) int64 on the host: each rank's bags per feature
    inverse: torch.Tensor  # (features, batch): each of this rank's samples' bag in its feature


def strides_of(kjt: KeyedJaggedTensor) -> list[int]:
    """Each feature's bags in a batch (its stride; the batch size for a uniform batch)."""
    if kjt.variable_stride_per_key():
        return list(kjt.stride_per_key())
    return [kjt.stride()] * len(kjt.keys())


def bag_positions(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`cat([arange(s, s + n) for s, n in zip(starts, counts)])`, without a loop (int64)."""
    counts = counts.long()
    total = int(counts.sum())
    block = torch.repeat_interleave(torch.arange(counts.numel()), counts, output_size=total)
    first = torch.cumsum(counts, 0) - counts
    return starts.long()[block] + (torch.arange(total) - first[block])


def element_positions(
    bases: torch.Tensor, rows: torch.Tensor, widths: torch.Tensor, strides: torch.Tensor
) -> torch.Tensor:
    """Flat positions of blocks of `rows[b] x widths[b]` elements, row-major, block after block:
    element (i, j) of block b is at `bases[b] + i * strides[b] + j`."""
    sizes = rows.long() * widths.long()
    total = int(sizes.sum())
    block = torch.repeat_interleave(torch.arange(sizes.numel()), sizes, output_size=total)
    within = torch.arange(total) - (torch.cumsum(sizes, 0) - sizes)[block]
    if bool((widths == 1).all()):  # one element a row (blocks a table wide): no division
        return bases.long()[block] + within * strides.long()[block]
    width = widths.long()[block]
    return bases.long()[block] + (within // width) * strides.long()[block] + within % width


def permute_segments(
    order: torch.Tensor,
    bags: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Segments of consecutive bags (`bags[i]` each: a feature's, or a route's from one rank) in
    the order `order` (host int64; may repeat or drop segments), with their ids and weights, and
    the ids of each segment moved. Two fbgemm permutations of whole segments, one of the ids
    and one of the bags' lengths: their cost is the bytes moved, not the bag count."""
    ids = segment_sums(lengths, bags)
    device = lengths.device
    perm = order.to(device=device, dtype=torch.int32)
    _, out_values, out_weights = torch.ops.fbgemm.permute_1D_sparse_data(
        perm, ids, values, weights, None
    )
    _, out_lengths, _ = torch.ops.fbgemm.permute_1D_sparse_data(
        perm, bags.to(device=device, dtype=ids.dtype), lengths, None, None
    )
    return out_lengths, out_values, out_weights, ids.index_select(0, order.to(device))


def select_features(
    kjt: KeyedJaggedTensor, features: list[int], keys: list[str]
) -> KeyedJaggedTensor:
    """A variable-batch KJT's features `features` (may repeat), as a variable-batch KJT."""
    strides = torch.tensor(strides_of(kjt), dtype=torch.int64)
    order = torch.tensor(features, dtype=torch.int64)
    lengths, values, weights, _ = permute_segments(
        order, strides, kjt.lengths(), kjt.values(), kjt.weights_or_none()
    )
    return KeyedJaggedTensor(
        keys=keys, values=values, weights=weights, lengths=lengths,
        stride_per_key_per_rank=[[int(s)] for s in strides[order]],
    )  # fmt: skip


def segment_sums(lengths: torch.Tensor, bags: torch.Tensor) -> torch.Tensor:
    """The ids of consecutive segments of `bags[i]` bags each (the lengths of a feature, or of
    a route, whose bag counts differ)."""
    bags = bags.to(lengths.device)
    ends = torch.cumsum(bags, 0)
    summed = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    return summed[ends] - summed[ends - bags]


def ids_per_feature(lengths: torch.Tensor, features: int, bags) -> torch.Tensor:
    """Each feature's ids; `bags`: the batch size, or each feature's own bag count."""
    if isinstance(bags, int):
        return lengths.view(features, bags).sum(1)
    return segment_sums(lengths, torch.tensor(bags, dtype=torch.int64))


def check_variable_batch(kjt: KeyedJaggedTensor, features: tuple[str, ...], module: str) -> Optional[str]:
    """Why a variable-batch KJT (keys already the module's, in order) is malformed, or None:
    strides that do not count the lengths, inverse indices missing, misshapen or out of range."""
    strides = strides_of(kjt)
    lengths = kjt.lengths()
    if lengths.numel() != sum(strides):
        per = ", ".join(f"{f!r}: {s}" for f, s in zip(features, strides))
        return (
            f"module {module!r}: the batch's strides ({per}) add up to {sum(strides)} bags but "
            f"it has {lengths.numel()} lengths; stride_per_key_per_rank must count each "
            "feature's bags"
        )
    inverse = kjt.inverse_indices_or_none()
    if inverse is None:
        return (
            f"module {module!r}: a variable-batch KJT (stride_per_key_per_rank) needs "
            "inverse_indices=(keys, (features, batch) tensor) to expand its bags to the batch, "
            "as torchrec's EmbeddingBagCollection does"
        )
    keys, index = inverse
    batch = kjt.stride()
    if tuple(keys) != features or tuple(index.shape) != (len(features), batch):
        return (
            f"module {module!r}: inverse_indices must be keyed by the batch's features "
            f"{list(features)} with shape ({len(features)}, {batch}) (features, batch); got keys "
            f"{list(keys)} and shape {tuple(index.shape)}"
        )
    if index.dtype not in (torch.int32, torch.int64) or index.device != lengths.device:
        return (
            f"module {module!r}: inverse_indices must be int32 or int64 on {lengths.device}, got "
            f"{index.dtype} on {index.device}"
        )
    bound = torch.tensor(strides, dtype=torch.int64, device=index.device).view(-1, 1)
    bad = (index < 0) | (index >= bound)
    if bool(bad.any()):
        f, b = (int(x) for x in bad.nonzero()[0])
        return (
            f"feature {features[f]!r} of module {module!r}: inverse_indices sends sample {b} to "
            f"bag {int(index[f, b])}, but the feature has {strides[f]} bags (its stride); every "
            "sample's bag must be one of its feature's"
        )
    return None
