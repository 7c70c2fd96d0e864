"""Checking a KeyedJaggedTensor and routing its ids to the ranks that own their rows.

Both are vectorised: no Python loop over features or tables runs per step.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular._layout import ROW_SPLIT, Layout
from modular._permute import Permutation, _permute


class InputError(ValueError):
    """A batch that a sharded module cannot look up; the message names the feature and table."""


class Problem(enum.IntEnum):
    """Why a rank rejected its batch; travels to the other ranks as (code, feature index)."""

    NONE = 0
    FEATURES = 1
    DTYPE = 2
    LENGTHS = 3
    ID_RANGE = 4
    WEIGHTS = 5
    BATCH_SIZE = 6
    DEVICE = 7
    EMPTY_BATCH = 8

    def summary(self) -> str:
        return {
            Problem.FEATURES: "missing or unknown features",
            Problem.DTYPE: "a wrong dtype",
            Problem.LENGTHS: "lengths that do not match the values",
            Problem.ID_RANGE: "ids out of range",
            Problem.WEIGHTS: "bad per-sample weights",
            Problem.BATCH_SIZE: "a batch size that differs from the other ranks'",
            Problem.DEVICE: "a batch on another device than the module",
            Problem.EMPTY_BATCH: "an empty batch: batch size 0",
        }.get(self, "no problem")


class Rejection(NamedTuple):
    problem: Problem
    feature: int  # index into Layout.features, or -1
    message: str


class Routed(NamedTuple):
    """Ids ordered by route (Note [routes]) with each route's per-sample lengths.

    The tensors may share memory with the batch (when routing moves nothing); treat them as
    read-only.
    """

    lengths: torch.Tensor  # (num_routes * batch_size,)
    values: torch.Tensor
    weights: Optional[torch.Tensor]
    # ids for each rank, on the batch's device: the input dist reads it on the host together
    # with the agreement all-to-all's answer, in one transfer (Note [host syncs per step])
    counts: torch.Tensor

    @property
    def values_per_rank(self) -> list[int]:
        return self.counts.tolist()


class BatchStats(NamedTuple):
    """What the checks read from a batch's tensors, read on the host in one transfer."""

    negative_lengths: bool
    total: int  # the lengths' sum
    low: int  # the smallest id (0 without ids)
    high: int  # the largest id (-1 without ids)
    weights_sum_finite: bool  # True when the module is unweighted or the batch has no weights


INT32_MAX = 2**31 - 1


def wire_dtype(max_shard_rows: int) -> torch.dtype:
    """The dtype routed ids and lengths travel and are looked up in.

    # Note [ids on the wire]
    Routed ids are rows of one shard (shifted to its first row), so while every shard has
    fewer than 2**31 rows they fit in int32 whatever the batch's dtype: the input all-to-all
    then moves half the bytes of int64 ids, and every copy after it (the arrival permutation,
    the kernels' reads, a deferred kernel's kept batch) touches half the memory. fbgemm's
    kernels take int32 ids and offsets. Lengths travel in the same buffer, so in the same
    dtype; a rank whose batch has more than INT32_MAX ids (a bag that long could not be
    represented) says so in the agreement all-to-all and every rank then sends int64 for
    that step, and a rank that receives more than INT32_MAX ids in all looks them up with
    int64 offsets. Tables with a larger shard send int64 always.
    """
    return torch.int32 if max_shard_rows <= INT32_MAX else torch.int64


class Router:
    """Static routing tables of one sharded EBC, held as tensors on its device.

    Routing (Note [routes]) never looks at single ids in Python and, where it can, not at all:

      - a whole-table route (TABLE_WISE, COLUMN_WISE) receives its feature's ids unchanged, so
        the routes of such features are one segment permutation of the batch (fbgemm's
        `permute_2D_sparse_data`, a copy per column shard);
      - the row-split routes of one output (ROW_WISE, TABLE_ROW_WISE) are the buckets of
        fbgemm's `block_bucketize_sparse_features`, given each table's shard boundaries (or
        only its block size, when all shards but the last have that size);
      - a mix of both bucketizes the row-split outputs, then one permutation over
        [buckets; original features] puts every route in its place.

    Within a route the ids keep their batch order, so the result is exactly "the ids of each
    route, in route order, in batch order" (what a stable sort by route would give).
    """

    def __init__(self, layout: Layout, *, module: str, is_weighted: bool, device: torch.device):
        self.module = module
        self.is_weighted = is_weighted
        self.features = layout.features
        self.num_routes = len(layout.routes)
        self.routes_per_rank = layout.routes_per_rank()
        # Tables each feature feeds, and the smallest of their row counts (its valid id bound).
        self.feature_tables: list[list[str]] = [[] for _ in layout.features]
        bound = [None] * len(layout.features)
        for o in layout.outputs:
            f = layout.features.index(o.feature)
            self.feature_tables[f].append(o.table)
            rows = layout.table(o.table).num_embeddings
            bound[f] = rows if bound[f] is None else min(bound[f], rows)
        self.id_bound = torch.tensor(bound, dtype=torch.int64, device=device)
        # With one bound for all features (or a batch within the smallest one), checking ids is
        # a single min/max over the batch.
        self._min_bound = min(bound) if bound else 0
        self._uniform_bound = len(set(bound)) <= 1

        as_long = dict(dtype=torch.int64, device=device)
        as_int = dict(dtype=torch.int32, device=device)
        ends = [0]
        for n in self.routes_per_rank:
            ends.append(ends[-1] + n)
        self.rank_route_ends = torch.tensor(ends, **as_long)
        self._permutations: dict[tuple[str, ...], Permutation] = {}

        # Row-split outputs ("bucketed slots"), each with its shards in row order.
        slot_of_output: dict[int, int] = {}
        slot_feature: list[int] = []
        slot_shards: list[list[tuple[int, int, int]]] = []  # (row_offset, num_rows, route)
        slot_rows: list[int] = []
        for i, r in enumerate(layout.routes):
            if layout.placements[layout.table_index(r.table)].sharding_type not in ROW_SPLIT:
                continue
            if r.output not in slot_of_output:
                slot_of_output[r.output] = len(slot_feature)
                slot_feature.append(r.feature)
                slot_shards.append([])
                slot_rows.append(layout.table(r.table).num_embeddings)
            slot_shards[slot_of_output[r.output]].append(
                (r.shard.row_offset, r.shard.num_rows, i)
            )
        nf = len(layout.features)
        num_slots = len(slot_feature)
        buckets = max((len(s) for s in slot_shards), default=0)
        # Rows of the jagged source that the last permutation reads: bucket b of slot s is row
        # b * num_slots + s of the bucketized batch; feature f is row buckets * num_slots + f.
        source_rows = buckets * num_slots + (nf if num_slots == 0 or any(
            layout.placements[layout.table_index(r.table)].sharding_type not in ROW_SPLIT
            for r in layout.routes
        ) else 0)
        source = [0] * self.num_routes
        for s, shards in enumerate(slot_shards):
            shards.sort()
            for b, (_, _, route) in enumerate(shards):
                source[route] = b * num_slots + s
        for i, r in enumerate(layout.routes):
            if layout.placements[layout.table_index(r.table)].sharding_type not in ROW_SPLIT:
                source[i] = buckets * num_slots + r.feature
        self._bucketize = num_slots > 0
        self._append_features = source_rows > buckets * num_slots
        if self._bucketize:
            # The slots' copy of the batch, unless the slots are exactly the features in order.
            self._slot_features = (
                None if slot_feature == list(range(nf))
                else torch.tensor(slot_feature, **as_int)
            )
            self._slot_copy_is_permutation = sorted(slot_feature) == list(range(nf))
            # Each slot's shard boundaries, padded with its row count to `buckets` shards
            # (the padding buckets stay empty: every checked id is below the row count).
            self._bucket_pos = [
                torch.tensor(
                    [o for o, _, _ in shards] + [rows] * (buckets + 1 - len(shards)), **as_long
                )
                for shards, rows in zip(slot_shards, slot_rows)
            ]
            self._block_sizes = torch.tensor(
                [max(n for _, n, _ in shards) for shards in slot_shards], **as_long
            )
            # Shards that are blocks of one size (all but the last full, as in TorchRec) are
            # found by a division, twice as fast as fbgemm's search of explicit boundaries.
            if all(
                all(o == j * shards[0][1] for j, (o, _, _) in enumerate(shards))
                and rows <= len(shards) * shards[0][1]
                for shards, rows in zip(slot_shards, slot_rows)
            ):
                self._block_sizes = torch.tensor([s[0][1] for s in slot_shards], **as_long)
                self._bucket_pos = None
            self._num_buckets = buckets
        self._source_rows = source_rows
        # The last permutation, skipped when it is the identity.
        identity = source == list(range(source_rows))
        self._route_source = None if identity else torch.tensor(source, **as_int)
        # A true permutation keeps every id: fbgemm needs no length sum then.
        self._route_source_is_permutation = sorted(source) == list(range(source_rows))
        self._zero_lengths = torch.zeros(0, **as_long)
        self.zero_counts = torch.zeros(len(self.routes_per_rank), **as_long)
        # Note [ids on the wire]
        self.ids_dtype = wire_dtype(max((r.shard.num_rows for r in layout.routes), default=0))

    # -- checking ---------------------------------------------------------------------------

    def normalise(
        self, kjt: KeyedJaggedTensor
    ) -> tuple[Optional[Rejection], Optional[KeyedJaggedTensor]]:
        """Puts the KJT's features in this module's order; rejects missing or unknown ones."""
        keys = tuple(kjt.keys())
        if keys == self.features:
            return None, kjt
        missing = [f for f in self.features if f not in keys]
        unknown = [k for k in keys if k not in self.features]
        if missing or unknown or len(set(keys)) != len(keys):
            parts = []
            for f in missing:
                parts.append(
                    f"feature {f!r} (table {self._tables_of(self.features.index(f))}) is missing"
                )
            if unknown:
                parts.append(
                    f"features {unknown} are not read by any table of this module"
                )
            if len(set(keys)) != len(keys):
                parts.append(f"a feature appears twice in {list(keys)}")
            feature = self.features.index(missing[0]) if missing else -1
            message = (
                f"the batch for module {self.module!r} does not match its tables: "
                + "; ".join(parts)
                + f". Expected exactly the features {list(self.features)}"
            )
            return Rejection(Problem.FEATURES, feature, message), None
        # fbgemm's permutation trusts lengths, values and weights to agree; check them first.
        rejection = self._check_structure(kjt)
        if rejection is not None:
            return rejection, None
        perm = self._permutations.get(keys)
        if perm is None:
            perm = self._permutations[keys] = Permutation([keys.index(f) for f in self.features])
        return None, _permute(kjt, perm)

    def check_and_route(
        self, kjt: KeyedJaggedTensor
    ) -> tuple[Optional[Rejection], Optional[Routed]]:
        """`check`, then `route` if the batch passed: (rejection, None) or (None, routed)."""
        rejection = self.check(kjt)
        if rejection is not None:
            return rejection, None
        return None, self.route(kjt)

    def check(self, kjt: KeyedJaggedTensor) -> Optional[Rejection]:
        """Finds the first problem in a batch whose features are already in order.

        A good batch costs a min/max over its ids (or, when features have different bounds, a
        compare with each feature's bound) and a sum of its weights; only a bad one pays for
        finding and naming the first offender (each id's feature, as before).
        """
        rejection = self._check_form(kjt)
        if rejection is not None:
            return rejection
        stats = self.batch_stats(kjt)
        rejection = self._check_counts(kjt, stats)
        if rejection is not None:
            return rejection
        values, lengths, weights = kjt.values(), kjt.lengths(), kjt.weights_or_none()
        if values.numel() == 0:
            return None
        if not self._ids_in_range(values, lengths, kjt.stride(), stats):
            return self._id_range_rejection(values, lengths, kjt.stride())
        # A NaN or inf weight makes the sum non-finite (so may huge finite ones: test exactly
        # then); summing is several times faster than testing each weight.
        if (
            self.is_weighted
            and weights is not None
            and not stats.weights_sum_finite
            and not bool(torch.isfinite(weights).all())
        ):
            return self._weights_rejection(weights, lengths, kjt.stride())
        return None

    def batch_stats(self, kjt: KeyedJaggedTensor) -> BatchStats:
        """The lengths' sign and sum, the ids' range and whether the weights' sum is finite.

        # Note [host syncs per step]
        Every read of a device tensor's value on the host (`int(t)`, `bool(t)`, `.tolist()`)
        waits for the GPU to finish all work queued before it: the host stops queueing and the
        GPU then idles while the host catches up. The input dist needs two such reads, as
        TorchRec's does: the checks' statistics here (one `tolist` of one small tensor; the
        ids must be known good before routing), and the counts of ids for each rank, read
        together with the agreement all-to-all's answer (`ShardedEmbeddingBagCollection.
        _input_dist`). A bad batch, or features with different row counts whose largest id
        reaches the smallest table's size, pays for more reads. On CPU the reads cost nothing
        extra; on an H100 eight reads per step made a table-wise step 1.5x TorchRec's
        (docs/benchmarks.md, "GPU").
        """
        values, lengths, weights = kjt.values(), kjt.lengths(), kjt.weights_or_none()
        parts = [(lengths < 0).any().long(), lengths.sum().long()]
        if values.numel():
            low, high = torch.aminmax(values)
            parts += [low.long(), high.long()]
        else:
            parts += [lengths.new_zeros((), dtype=torch.int64), lengths.new_full((), -1, dtype=torch.int64)]
        if self.is_weighted and weights is not None and weights.is_floating_point():
            parts.append(torch.isfinite(weights.sum()).long())
        else:
            parts.append(lengths.new_ones((), dtype=torch.int64))
        negative, total, low, high, finite = torch.stack(parts).tolist()
        return BatchStats(bool(negative), total, low, high, bool(finite))

    def _check_structure(self, kjt: KeyedJaggedTensor) -> Optional[Rejection]:
        """Dtypes, and lengths and weights that agree with the values; in any feature order."""
        rejection = self._check_form(kjt)
        if rejection is not None:
            return rejection
        return self._check_counts(kjt, self.batch_stats(kjt))

    def _check_form(self, kjt: KeyedJaggedTensor) -> Optional[Rejection]:
        """What the host knows without reading a tensor: devices, dtypes and sizes."""
        values, lengths = kjt.values(), kjt.lengths()
        nf = len(self.features)
        if values.device != self.id_bound.device or lengths.device != self.id_bound.device:
            return Rejection(
                Problem.DEVICE,
                -1,
                f"module {self.module!r} is on {self.id_bound.device} but the batch's ids are on "
                f"{values.device} and its lengths on {lengths.device}; move the batch with "
                f"kjt.to({str(self.id_bound.device)!r})",
            )
        if values.dtype not in (torch.int32, torch.int64) or lengths.dtype not in (
            torch.int32,
            torch.int64,
        ):
            return Rejection(
                Problem.DTYPE,
                -1,
                f"ids and lengths for module {self.module!r} must be int32 or int64, got "
                f"values {values.dtype} and lengths {lengths.dtype}",
            )
        if kjt.variable_stride_per_key():
            return Rejection(
                Problem.LENGTHS,
                -1,
                f"module {self.module!r} needs the same batch size for every feature; "
                "variable batch per feature is not supported",
            )
        if lengths.numel() != nf * kjt.stride():
            return Rejection(
                Problem.LENGTHS,
                -1,
                f"module {self.module!r}: {lengths.numel()} lengths for {nf} features is not a "
                f"whole batch (batch size {kjt.stride()} x {nf} = {nf * kjt.stride()})",
            )
        if kjt.stride() == 0:
            # Routing cannot shape the lengths of 0 samples (nor does torchrec's EBC take them):
            # refused here, so that every rank hears of it in the agreement, not one crashing.
            return Rejection(
                Problem.EMPTY_BATCH,
                -1,
                f"module {self.module!r} got an empty batch (batch size 0) on this rank; it "
                "needs the same batch size, at least 1, on every rank: give this rank as many "
                "samples as the others (a sample may have no ids), or skip the step on every rank",
            )
        return None

    def _check_counts(self, kjt: KeyedJaggedTensor, stats: BatchStats) -> Optional[Rejection]:
        """Lengths, and weights that agree with the values."""
        values, lengths = kjt.values(), kjt.lengths()
        if stats.negative_lengths:
            negative = lengths < 0
            pos = int(negative.nonzero()[0, 0])
            f = self.features.index(kjt.keys()[pos // kjt.stride()])
            tables = self._tables_of(f)
            return Rejection(
                Problem.LENGTHS,
                f,
                f"feature {self.features[f]!r} (table {tables}) of module {self.module!r} has "
                f"length {int(lengths[pos])} for sample {pos % kjt.stride()}; lengths must count "
                "the ids of each bag",
            )
        if stats.total != values.numel():
            return Rejection(
                Problem.LENGTHS,
                -1,
                f"module {self.module!r}: lengths sum to {stats.total} but there are "
                f"{values.numel()} ids; lengths must count the ids of each bag",
            )
        weights = kjt.weights_or_none()
        if weights is not None and weights.numel() != values.numel():
            return Rejection(
                Problem.WEIGHTS,
                -1,
                f"module {self.module!r}: {weights.numel()} per-sample weights for "
                f"{values.numel()} ids; a batch with weights needs one weight per id",
            )
        if self.is_weighted:
            if weights is None:
                return Rejection(
                    Problem.WEIGHTS,
                    -1,
                    f"module {self.module!r} is weighted (is_weighted=True) but the batch has "
                    "no per-sample weights",
                )
            if weights.dtype != torch.float32:
                return Rejection(
                    Problem.DTYPE,
                    -1,
                    f"per-sample weights for module {self.module!r} must be float32, got "
                    f"{weights.dtype}",
                )
            if weights.requires_grad:
                # The unsharded EBC back-propagates into its weights. Here nothing would: the
                # weights' all-to-all carries no gradient back (it would be lost silently), and
                # the backward of fbgemm's permutation of them (data-parallel tables, shuffled
                # features) corrupts memory on CPU. So they are refused before any of it runs.
                return Rejection(
                    Problem.WEIGHTS,
                    -1,
                    f"per-sample weights for module {self.module!r} require grad, but a sharded "
                    "module does not back-propagate into its per-sample weights (only into its "
                    "tables), so their gradient would be lost: pass weights that do not require "
                    "grad (weights.detach()), or leave this EBC unsharded to learn them",
                )
        return None

    def _ids_in_range(
        self, values: torch.Tensor, lengths: torch.Tensor, batch: int, stats: BatchStats
    ) -> bool:
        if stats.low < 0:
            return False
        if stats.high < self._min_bound or self._uniform_bound:
            return stats.high < self._min_bound
        # Features with different bounds: each id against its feature's bound (the bounds are
        # a fill, not a gather: the ids of a feature are one slice of the batch).
        per_feature = lengths.view(len(self.features), batch).sum(1)
        bounds = torch.repeat_interleave(self.id_bound, per_feature, output_size=values.numel())
        return not bool((values >= bounds).any())

    def _tables_of(self, f: int) -> str:
        """The tables feature `f` feeds, for messages: "'t_user', 't_user_hist'"."""
        return ", ".join(repr(t) for t in self.feature_tables[f])

    def _first_bad(self, bad: torch.Tensor, fidx: torch.Tensor) -> tuple[int, int]:
        """(position, feature) of the first True in `bad`; the slow path of a rejection."""
        pos = int(bad.nonzero()[0, 0])
        return pos, int(fidx[pos])

    def _id_range_rejection(self, values, lengths, batch) -> Rejection:
        fidx = self.feature_of_values(lengths, batch)
        bad = (values < 0) | (values >= self.id_bound[fidx])
        pos, f = self._first_bad(bad, fidx)
        tables = self._tables_of(f)
        return Rejection(
            Problem.ID_RANGE,
            f,
            f"feature {self.features[f]!r} of module {self.module!r} has id "
            f"{int(values[pos])}, outside table {tables} (valid ids are 0 to "
            f"{int(self.id_bound[f]) - 1}); {int(bad.sum())} ids are out of range",
        )

    def _weights_rejection(self, weights, lengths, batch) -> Rejection:
        fidx = self.feature_of_values(lengths, batch)
        bad = ~torch.isfinite(weights)
        pos, f = self._first_bad(bad, fidx)
        tables = self._tables_of(f)
        return Rejection(
            Problem.WEIGHTS,
            f,
            f"feature {self.features[f]!r} (table {tables}) of module {self.module!r} "
            f"has a non-finite per-sample weight ({float(weights[pos])}); "
            f"{int(bad.sum())} weights are NaN or inf",
        )

    def feature_of_values(self, lengths: torch.Tensor, batch_size: int) -> torch.Tensor:
        nf = len(self.features)
        per_feature = lengths.view(nf, batch_size).sum(1)
        return torch.repeat_interleave(
            torch.arange(nf, device=lengths.device), per_feature, output_size=int(per_feature.sum())
        )

    # -- routing ----------------------------------------------------------------------------

    def route(self, kjt: KeyedJaggedTensor) -> Routed:
        """Copies each id into its routes, shifted to the shard's first row, ordered by route."""
        values = kjt.values().long().contiguous()
        lengths = kjt.lengths().long().contiguous()
        weights = kjt.weights().contiguous() if self.is_weighted else None
        batch = kjt.stride()
        nf = len(self.features)
        if self.num_routes == 0:  # data-parallel only
            return Routed(
                lengths=self._zero_lengths,
                values=values.new_empty(0),
                weights=None if weights is None else weights.new_empty(0),
                counts=self.zero_counts,
            )
        lengths = lengths.view(nf, batch)
        if self._bucketize:
            s_lengths, s_values, s_weights = lengths, values, weights
            if self._slot_features is not None:
                s_lengths, s_values, s_weights = torch.ops.fbgemm.permute_2D_sparse_data(
                    self._slot_features, lengths, values, weights,
                    values.numel() if self._slot_copy_is_permutation else None,
                )
            b_lengths, b_values, b_weights, _, _ = (
                torch.ops.fbgemm.block_bucketize_sparse_features(
                    s_lengths.reshape(-1), s_values, False, False, self._block_sizes,
                    self._num_buckets, s_weights, None, -1, self._bucket_pos,
                )
            )
            if self._append_features:
                s_lengths = torch.cat([b_lengths.view(-1, batch), lengths])
                s_values = torch.cat([b_values, values])
                s_weights = None if weights is None else torch.cat([b_weights, weights])
            else:
                s_lengths, s_values, s_weights = b_lengths.view(-1, batch), b_values, b_weights
        else:
            s_lengths, s_values, s_weights = lengths, values, weights
        if self._route_source is None:
            r_lengths, r_values, r_weights = s_lengths, s_values, s_weights
        else:
            r_lengths, r_values, r_weights = torch.ops.fbgemm.permute_2D_sparse_data(
                self._route_source, s_lengths, s_values, s_weights,
                s_values.numel() if self._route_source_is_permutation else None,
            )
        per_route = r_lengths.sum(1)
        cumulative = torch.cat([per_route.new_zeros(1), torch.cumsum(per_route, 0)])
        return Routed(
            lengths=r_lengths.reshape(-1),
            values=r_values,
            weights=r_weights,
            counts=torch.diff(cumulative[self.rank_route_ends]),
        )
