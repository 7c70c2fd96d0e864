"""Checking a KeyedJaggedTensor before its ids are routed: what a sharded EBC refuses, and why.

Vectorised like routing (modular/routing/router.py): a good batch costs a few reductions and one read on
the host (Note [host syncs per step]); only a bad one pays for finding its first offender.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.routing.variable_batch import check_variable_batch, ids_per_feature
from modular.tables.layout import Layout
from modular.errors import InputError


class Problem(enum.IntEnum):
    """Why a rank rejected its batch; travels to the other ranks as (code, feature index)."""

    NONE = 0
    FEATURES = 1
    DTYPE = 2
    LENGTHS = 3
    ID_RANGE = 4
    WEIGHTS = 5
    DEVICE = 7
    SHAPE = 9  # Note [a batch's shapes] in modular/routing/shapes.py

    def summary(self) -> str:
        return {
            Problem.FEATURES: "missing or repeated features",
            Problem.DTYPE: "a wrong dtype",
            Problem.LENGTHS: "lengths that do not match the values",
            Problem.ID_RANGE: "ids out of range",
            Problem.WEIGHTS: "bad per-sample weights",
            Problem.DEVICE: "a batch on another device than the module",
            Problem.SHAPE: "ids, lengths or weights that are not 1-D",
        }.get(self, "no problem")


class Rejection(NamedTuple):
    problem: Problem
    feature: int  # index into Layout.features, or -1
    message: str


class BatchStats(NamedTuple):
    """What the checks read from a batch's tensors, read on the host in one transfer."""

    negative_lengths: bool
    total: int  # the lengths' sum
    low: int  # the smallest id (0 without ids)
    high: int  # the largest id (-1 without ids)
    weights_sum_finite: bool  # True when the module is unweighted or the batch has no weights
    selected: int  # the ids of the features a module selects from a larger batch (else `total`)


class BatchChecks:
    """What a sharded EBC checks in each batch before routing it (`Router` routes it after).

    A bad batch is refused with a `Rejection` naming the feature, the table and the fix, before
    any kernel or collective sees it: fbgemm's kernels would read out of bounds or crash.
    """

    def __init__(
        self, layout: Layout, *, module: str, is_weighted: bool, device: torch.device,
        variable_batch: bool = False,
    ):  # fmt: skip
        self.module = module
        self.is_weighted = is_weighted
        self.variable_batch = variable_batch  # takes a VBE batch (Note [variable batch per feature])
        self.features = layout.features
        # Note [per-sample weights of low-precision tables]
        # torchrec's unsharded EBC takes per-sample weights in its tables' dtype only (its
        # nn.EmbeddingBag's rule): FP16 weights for FP16 tables. A sharded module takes those
        # and FP32 ones (what it took before FP16 tables), and pools in FP32 as fbgemm does
        # with FP32 weights: `Router.route` and the data-parallel lookup widen them first
        # (exactly: every FP16/BF16 value is an FP32 value), the input dist sends them as FP32.
        table_dtypes = sorted({t.dtype for t in layout.tables}, key=str)
        self.weight_dtypes = (torch.float32, *(d for d in table_dtypes if d != torch.float32))
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
        bags = kjt.stride_per_key() if kjt.variable_stride_per_key() else kjt.stride()
        if not self._ids_in_range(values, lengths, bags, stats):
            return self._id_range_rejection(values, lengths, bags)
        # A NaN or inf weight makes the sum non-finite (so may huge finite ones: test exactly
        # then); summing is several times faster than testing each weight.
        if (
            self.is_weighted
            and weights is not None
            and not stats.weights_sum_finite
            and not bool(torch.isfinite(weights).all())
        ):
            return self._weights_rejection(weights, lengths, bags)
        return None

    def raise_if_rejected(
        self,
        problems: torch.Tensor,
        features: torch.Tensor,
        mine: Optional[Rejection],
    ) -> None:
        """Raises this rank's own rejection, else the first peer's, from the headers of the input
        dist's first all-to-all (Note [ids with their header] in modular/routing/exchange.py): per
        rank, on the host, its `Problem` code and the feature it names. Batch sizes may differ
        (Note [a batch size per rank] in modular/routing/variable_batch.py)."""
        if mine is not None:
            raise InputError(mine.message)
        codes = problems.tolist()  # one conversion, not a tensor read per rank
        for src, code in enumerate(codes):
            problem = Problem(code)
            if problem is not Problem.NONE:
                f = int(features[src])
                where = f" in feature {self.features[f]!r}" if f >= 0 else ""
                raise InputError(
                    f"rank {src} rejected its batch for module {self.module!r} "
                    f"({problem.summary()}{where}); this rank stops too so that no rank hangs. "
                    f"See rank {src}'s error for the details"
                )

    def batch_stats(
        self, kjt: KeyedJaggedTensor, selection: Optional[torch.Tensor] = None
    ) -> BatchStats:
        """The lengths' sign and sum, the ids' range, whether the weights' sum is finite and, with
        `selection` (indices of the batch's features), how many ids the selected features hold.

        # Note [host syncs per step]
        Every read of a device tensor's value on the host (`int(t)`, `bool(t)`, `.tolist()`)
        waits for the GPU to finish all work queued before it: the host stops queueing and the
        GPU then idles while the host catches up. The input dist needs two such reads, as
        TorchRec's does: the checks' statistics here (one `tolist` of one small tensor; the
        ids must be known good before routing), and the counts of ids for each rank, read
        together with the peers' headers (`IdsExchange.exchange` in modular/routing/exchange.py;
        only CPU modules read their counts before sending, which costs nothing there). A bad
        batch, or features with different row counts whose largest id reaches the smallest
        table's size, pays for more reads. On CPU the reads cost nothing extra; on an H100
        eight reads per step made a table-wise step 1.5x TorchRec's (docs/benchmarks.md, "GPU").
        """
        values, lengths, weights = kjt.values(), kjt.lengths(), kjt.weights_or_none()
        parts = [(lengths < 0).any().long(), lengths.sum().long()]
        if values.numel():
            low, high = torch.aminmax(values)
            parts += [low.long(), high.long()]
        else:
            none = lengths.new_zeros((), dtype=torch.int64)
            parts += [none, none - 1]
        if self.is_weighted and weights is not None and weights.is_floating_point():
            parts.append(torch.isfinite(weights.sum()).long())
        else:
            parts.append(lengths.new_ones((), dtype=torch.int64))
        if selection is not None:
            per_key = lengths.view(len(kjt.keys()), kjt.stride())
            parts.append(per_key.index_select(0, selection).sum().long())
        negative, total, low, high, finite, *selected = torch.stack(parts).tolist()
        return BatchStats(
            bool(negative), total, low, high, bool(finite), selected[0] if selected else total
        )

    def _check_structure(self, kjt: KeyedJaggedTensor) -> Optional[Rejection]:
        """Dtypes, and lengths and weights that agree with the values; in any feature order."""
        return self.check_structure(kjt)[0]

    def check_structure(
        self, kjt: KeyedJaggedTensor, selection: Optional[torch.Tensor] = None
    ) -> tuple[Optional[Rejection], int]:
        """`_check_structure` of a whole batch, whose features may be in any order and include
        features this module does not read: (rejection or None, the ids of the features that
        `selection` picks, or of all of them). fbgemm's permutation reads every feature's
        lengths to find the selected ones' ids, so lengths, values and weights must agree over
        the whole batch; the dropped features' ids are never read, so nothing else about them
        is checked (the unsharded module ignores them too)."""
        rejection = self._check_form(kjt)
        if rejection is not None:
            return rejection, 0
        stats = self.batch_stats(kjt, selection)
        return self._check_counts(kjt, stats), stats.selected

    def _check_form(self, kjt: KeyedJaggedTensor) -> Optional[Rejection]:
        """What the host knows without reading a tensor: devices, dtypes and sizes."""
        values, lengths, weights = kjt.values(), kjt.lengths(), kjt.weights_or_none()
        nf = len(kjt.keys())  # the module's features, or a larger batch's (`check_structure`)
        device = self.id_bound.device
        devices = {values.device, lengths.device}
        if weights is not None:
            devices.add(weights.device)
        if devices != {device}:
            where = f"its ids are on {values.device} and its lengths on {lengths.device}"
            if weights is not None:
                where += f", its per-sample weights on {weights.device}"
            return Rejection(
                Problem.DEVICE,
                -1,
                f"module {self.module!r} is on {device} but {where}; move the batch with "
                f"kjt.to({str(device)!r})",
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
        if kjt.variable_stride_per_key():  # Note [variable batch per feature]
            why = (
                check_variable_batch(kjt, self.features, self.module) if self.variable_batch
                else f"module {self.module!r} needs the same batch size for every feature: it "
                "is an EmbeddingCollection, and torchrec's has no variable-batch path either; "
                "expand the batch to one bag per sample for it"
            )  # fmt: skip
            if why is not None:
                return Rejection(Problem.LENGTHS, -1, why)
        elif lengths.numel() != nf * kjt.stride():
            return Rejection(
                Problem.LENGTHS,
                -1,
                f"module {self.module!r}: {lengths.numel()} lengths for {nf} features is not a "
                f"whole batch (batch size {kjt.stride()} x {nf} = {nf * kjt.stride()})",
            )
        return None  # a batch of 0 samples too (Note [a batch size per rank])

    def _check_counts(self, kjt: KeyedJaggedTensor, stats: BatchStats) -> Optional[Rejection]:
        """Lengths, and weights that agree with the values."""
        values, lengths = kjt.values(), kjt.lengths()
        if stats.negative_lengths:
            negative = lengths < 0
            pos = int(negative.nonzero()[0, 0])
            key = kjt.keys()[pos // kjt.stride()]
            f = self.features.index(key) if key in self.features else -1
            which = (
                f"(table {self._tables_of(f)}) of module {self.module!r}" if f >= 0
                else f"of the batch for module {self.module!r} (read by none of its tables, but "
                "its lengths place the other features' ids)"
            )
            return Rejection(
                Problem.LENGTHS,
                f,
                f"feature {key!r} {which} has length {int(lengths[pos])} for sample "
                f"{pos % kjt.stride()}; lengths must count the ids of each bag",
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
            if weights.dtype not in self.weight_dtypes:
                # Note [per-sample weights of low-precision tables]
                return Rejection(
                    Problem.DTYPE,
                    -1,
                    f"per-sample weights for module {self.module!r} are {weights.dtype}, but "
                    f"its tables take per-sample weights in "
                    f"{' or '.join(str(d) for d in self.weight_dtypes)} (float32, or the "
                    "tables' own dtype as torchrec's EBC takes them): pass "
                    "weights.to(torch.float32)",
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
        per_feature = ids_per_feature(lengths, len(self.features), batch)
        bounds = torch.repeat_interleave(self.id_bound, per_feature, output_size=values.numel())
        return not bool((values >= bounds).any())

    def _tables_of(self, f: int) -> str:
        """The tables feature `f` feeds, for messages: "'t_user', 't_user_hist'"."""
        return ", ".join(repr(t) for t in self.feature_tables[f])

    def _first_bad(self, is_bad, lengths, batch) -> tuple[int, int, str, int]:
        """(position, feature, its tables, how many) of the values `is_bad(feature index per
        value)` flags; the slow path of a rejection."""
        fidx = self.feature_of_values(lengths, batch)
        bad = is_bad(fidx)
        pos = int(bad.nonzero()[0, 0])
        f = int(fidx[pos])
        return pos, f, self._tables_of(f), int(bad.sum())

    def _id_range_rejection(self, values, lengths, batch) -> Rejection:
        pos, f, tables, count = self._first_bad(
            lambda fidx: (values < 0) | (values >= self.id_bound[fidx]), lengths, batch
        )
        message = (
            f"feature {self.features[f]!r} of module {self.module!r} has id {int(values[pos])}, "
            f"outside table {tables} (valid ids are 0 to {int(self.id_bound[f]) - 1}); {count} "
            "ids are out of range"
        )
        return Rejection(Problem.ID_RANGE, f, message)

    def _weights_rejection(self, weights, lengths, batch) -> Rejection:
        pos, f, tables, count = self._first_bad(
            lambda fidx: ~torch.isfinite(weights), lengths, batch
        )
        message = (
            f"feature {self.features[f]!r} (table {tables}) of module {self.module!r} has a "
            f"non-finite per-sample weight ({float(weights[pos])}); {count} weights are NaN or inf"
        )
        return Rejection(Problem.WEIGHTS, f, message)

    def feature_of_values(self, lengths: torch.Tensor, batch_size: int) -> torch.Tensor:
        nf = len(self.features)
        per_feature = ids_per_feature(lengths, nf, batch_size)
        return torch.repeat_interleave(
            torch.arange(nf, device=lengths.device), per_feature, output_size=int(per_feature.sum())
        )
