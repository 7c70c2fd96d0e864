"""Routing a checked KeyedJaggedTensor's ids to the ranks that own their rows.

Vectorised: no Python loop over features or tables runs per step. The checks that come first
are in modular/routing/checks.py (`BatchChecks`, which `Router` extends).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.errors import InputError
from modular.kernels.lookups import INT32_MAX
from modular.routing.checks import BatchChecks, Problem, Rejection
from modular.routing.permute import Permutation, permute
from modular.routing.shapes import check_shapes
from modular.routing.variable_batch import permute_segments, segment_sums, strides_of
from modular.tables.layout import ROW_SPLIT, Layout


class Routed(NamedTuple):
    """Ids ordered by route (Note [routes]) with each route's per-sample lengths.

    The tensors may share memory with the batch (when routing moves nothing); treat them as
    read-only.
    """

    lengths: torch.Tensor  # (num_routes * batch_size,)
    values: torch.Tensor
    weights: Optional[torch.Tensor]
    # ids for each rank, on the batch's device: the input dist reads it on the host together
    # with the peers' headers, in one transfer (Note [host syncs per step])
    counts: torch.Tensor

    @property
    def values_per_rank(self) -> list[int]:
        return self.counts.tolist()




def wire_dtype(max_shard_rows: int) -> torch.dtype:
    """The dtype routed ids and lengths travel and are looked up in.

    # Note [ids on the wire]
    Routed ids are rows of one shard (shifted to its first row), so while every shard has
    fewer than 2**31 rows they fit in int32 whatever the batch's dtype: the input all-to-all
    then moves half the bytes of int64 ids, and every copy after it (the arrival permutation,
    the kernels' reads, a deferred kernel's kept batch) touches half the memory. fbgemm's
    kernels take int32 ids and offsets. Lengths travel in the same buffer, so in the same
    dtype, and so do float32 per-sample weights, as their bits (int32; sign-extended to int64
    and back when the wire is int64). A rank whose batch has more than INT32_MAX ids (a bag
    that long could not be represented) says so in its header (Note [ids with their header])
    and every rank then sends int64 for that step, and a rank that receives more than
    INT32_MAX ids in all looks them up with int64 offsets. Tables with a larger shard send
    int64 always.
    """
    return torch.int32 if max_shard_rows <= INT32_MAX else torch.int64


class Router(BatchChecks):
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

    def __init__(
        self,
        layout: Layout,
        *,
        module: str,
        is_weighted: bool,
        device: torch.device,
        variable_batch: bool = False,
    ):
        super().__init__(
            layout, module=module, is_weighted=is_weighted, device=device,
            variable_batch=variable_batch,
        )  # fmt: skip
        self.num_routes = len(layout.routes)
        self.route_features = torch.tensor([r.feature for r in layout.routes], dtype=torch.int64)
        self.routes_per_rank = layout.routes_per_rank()

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
        # The same, on the host, for batches whose features have their own bag counts (Note
        # [variable batch per feature]): bags move, not rows of one width.
        self._source_list = torch.tensor(source, dtype=torch.int64)
        self._slot_feature_list = torch.tensor(slot_feature, dtype=torch.int64)
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
        """This module's features of a batch, in its order (Note [batches with more features]);
        rejects a batch that lacks one or names one twice."""
        keys = tuple(kjt.keys())
        if keys == self.features:  # the common case first: nothing to select, nothing to check
            return None, kjt
        if kjt.variable_stride_per_key():  # Note [variable batch per feature]
            return Rejection(
                Problem.FEATURES, -1,
                f"module {self.module!r}: a variable-batch KJT's keys must be the module's "
                f"features in its order, {list(self.features)}; got {list(keys)}",
            ), None  # fmt: skip
        selection = self._permutations.get(keys)
        if selection is None:
            rejection = self._features_rejection(keys)
            if rejection is not None:
                return rejection, None
            selection = Permutation([keys.index(f) for f in self.features])
            self._permutations[keys] = selection
        # fbgemm's permutation trusts lengths, values and weights to agree; check them first.
        every = selection.is_permutation and len(keys) == len(self.features)
        rejection, selected = self.check_structure(
            kjt, None if every else selection.on(kjt.lengths().device)
        )
        if rejection is not None:
            return rejection, None
        return None, permute(kjt, selection, total=selected)

    def _features_rejection(self, keys: tuple[str, ...]) -> Optional[Rejection]:
        """Why a batch with these keys cannot be read by this module, or None.

        # Note [batches with more features]
        A sharded collection takes what torchrec's unsharded one takes: a KJT whose keys are its
        features in any order, among any others (a model may hand one batch to several
        collections). Input dist selects its own features, in its own order, with one fbgemm
        permutation (`permute`, the selection made once per key tuple), after checking that the
        whole batch's lengths, values and weights agree (fbgemm reads every feature's lengths to
        find the selected ids); the dropped features' ids are never read or checked, as the
        unsharded module ignores them. Keys equal to the module's features skip all of this. A
        missing feature, or a key named twice (which of its two segments would be read?), is a
        rejection like any other bad batch: every rank raises (Note [ids with their header])."""
        known, present = set(self.features), set(keys)
        missing = [f for f in self.features if f not in present]
        repeated = []
        if len(present) < len(keys):
            repeated = sorted({k for k in keys if keys.count(k) > 1})
        if not missing and not repeated:
            return None
        parts = [
            f"feature {f!r} (table {self._tables_of(self.features.index(f))}) is missing"
            for f in missing
        ]
        unread = [k for k in keys if k not in known]
        if missing and unread:  # a misspelt feature shows here
            parts.append(f"features {unread} are not read by any table of this module")
        for k in repeated:
            parts.append(f"feature {k!r} appears {keys.count(k)} times in the keys {list(keys)}")
        feature = self.features.index(missing[0]) if missing else (
            self.features.index(repeated[0]) if repeated[0] in known else -1
        )
        message = (
            f"the batch for module {self.module!r} does not match its tables: "
            + "; ".join(parts)
            + f". It reads the features {list(self.features)}, each once, in any order; "
            "features that none of its tables read are ignored"
        )
        return Rejection(Problem.FEATURES, feature, message)

    def accept(
        self, features: KeyedJaggedTensor, *, alone: bool,
        positions: Optional[KeyedJaggedTensor] = None,
    ) -> tuple[Optional[Rejection], Optional[KeyedJaggedTensor], Optional[Routed]]:
        """`normalise`, `check` and `route` a batch: (rejection, kjt, routed), one of the last two
        None when rejected. `alone` (a world of one, with no peer to tell) raises the
        rejection as `InputError` at once; otherwise the exchange's header shares it first.
        `positions`: the batch with each id's position as its weight (float64), which the
        returned kjt and routed ids carry instead of the weights (Note [learned per-sample
        weights] in modular/routing/learned_weights.py)."""
        # Note [a batch's shapes]
        rejection = check_shapes(features, module=self.module, features=self.features)
        kjt, routed = None, None
        if rejection is None:
            rejection, kjt = self.normalise(features)
        if rejection is None and positions is not None:
            rejection = self.check(kjt)
            if rejection is None:
                keys = tuple(positions.keys())  # checked with `features`
                kjt = positions if keys == self.features else permute(positions, self._permutations[keys])
                routed = self.route(kjt)
        elif rejection is None:
            rejection, routed = self.check_and_route(kjt)
        if alone and rejection is not None:
            raise InputError(rejection.message)
        return rejection, kjt, routed

    def check_and_route(
        self, kjt: KeyedJaggedTensor
    ) -> tuple[Optional[Rejection], Optional[Routed]]:
        """`check`, then `route` if the batch passed: (rejection, None) or (None, routed)."""
        rejection = self.check(kjt)
        if rejection is not None:
            return rejection, None
        return None, self.route(kjt)

    # -- routing ----------------------------------------------------------------------------

    def route(self, kjt: KeyedJaggedTensor) -> Routed:
        """Copies each id into its routes, shifted to the shard's first row, ordered by route."""
        values = kjt.values().long().contiguous()
        lengths = kjt.lengths().long().contiguous()
        # FP32 whatever the tables' dtype (Note [per-sample weights of low-precision tables]);
        # float64 are positions (Note [learned per-sample weights]), which the checks never pass.
        weights = kjt.weights() if self.is_weighted else None
        if weights is not None:
            weights = (weights if weights.dtype is torch.float64 else weights.float()).contiguous()
        batch = kjt.stride()
        nf = len(self.features)
        if self.num_routes == 0:  # data-parallel only
            return Routed(
                lengths=self._zero_lengths,
                values=values.new_empty(0),
                weights=None if weights is None else weights.new_empty(0),
                counts=self.zero_counts,
            )
        if kjt.variable_stride_per_key() or batch == 0:  # Note [a batch size per rank]
            return self._route_bags(lengths, values, weights, strides_of(kjt))
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
        return self._routed(r_lengths.reshape(-1), r_values, r_weights, r_lengths.sum(1))

    def _routed(self, lengths, values, weights, per_route: torch.Tensor) -> Routed:
        """`Routed` of ids in route order, with each rank's count from each route's."""
        cumulative = torch.cat([per_route.new_zeros(1), torch.cumsum(per_route, 0)])
        return Routed(
            lengths=lengths,
            values=values,
            weights=weights,
            counts=torch.diff(cumulative[self.rank_route_ends]),
        )

    def _route_bags(self, lengths, values, weights, strides: list[int]) -> Routed:
        """`route` for a batch whose features have their own bag counts (Note [variable batch
        per feature]): the same bucketing and permutations, of whole features and buckets."""
        stride = torch.tensor(strides, dtype=torch.int64)
        counts = stride  # bags in each row of the source the last permutation reads
        s_lengths, s_values, s_weights = lengths, values, weights
        if self._bucketize:
            slots = self._slot_feature_list
            slot_bags = stride[slots]
            if self._slot_features is not None:
                s_lengths, s_values, s_weights, _ = permute_segments(
                    slots, stride, lengths, values, weights
                )
            b_lengths, b_values, b_weights, _, _ = (
                torch.ops.fbgemm.block_bucketize_sparse_features(
                    s_lengths, s_values, False, False, self._block_sizes, self._num_buckets,
                    s_weights, slot_bags.to(lengths.device), int(slot_bags.max()),
                    self._bucket_pos,
                )
            )
            counts = slot_bags.repeat(self._num_buckets)
            s_lengths, s_values, s_weights = b_lengths, b_values, b_weights
            if self._append_features:
                counts = torch.cat([counts, stride])
                s_lengths = torch.cat([b_lengths, lengths])
                s_values = torch.cat([b_values, values])
                s_weights = None if weights is None else torch.cat([b_weights, weights])
        if self._route_source is None:  # every source row is its route, in order
            per_route = segment_sums(s_lengths, counts)
            return self._routed(s_lengths, s_values, s_weights, per_route)
        r_lengths, r_values, r_weights, per_route = permute_segments(
            self._source_list, counts, s_lengths, s_values, s_weights
        )
        return self._routed(r_lengths, r_values, r_weights, per_route)
