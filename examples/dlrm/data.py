"""Batches for the DLRM example: a synthetic Criteo-like stream and a Criteo TSV reader.

Both yield `Batch(dense [B, 13] float32, sparse KJT, labels [B] float32)` whose KJT has keys
f_cat_0, ..., f_cat_{F-1} in that order, int64 ids and int32 lengths, the layout
`examples.dlrm.model.DLRM` and `model.sparse.ebc` take.

# Note [global batch across ranks]
With `world_size` ranks, each rank draws its own local batch of `batch_size` samples per
step, and the global batch at step s is the concatenation of the ranks' local batches in
rank order (`concat_batches([batch of rank 0, ..., batch of rank W-1])`). A single-process
reference that trains on that concatenation sees exactly what the ranks saw together. What
does NOT hold: for the synthetic stream, one rank with `batch_size * W` draws a different
batch (each rank's stream is seeded by (seed, rank, step)); for the TSV reader it holds,
since rank r reads the r-th stripe of `batch_size` lines of each window of `batch_size * W`
lines.
"""

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import numpy as np
import torch
from torchrec import KeyedJaggedTensor

from examples.dlrm.model import NUM_DENSE_FEATURES, feature_names

NUM_CRITEO_CATEGORICAL = 26


@dataclass(frozen=True)
class Batch:
    """One local batch: dense [B, 13] float32, sparse KJT (keys f_cat_0..), labels [B] float32."""

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """Concatenates batches along the batch dimension, feature by feature.

    Use it to build the global batch from the ranks' local batches, in rank order
    (see Note [global batch across ranks]).
    """
    if not batches:
        raise ValueError("concat_batches needs at least one batch, got none")
    keys = batches[0].sparse.keys()
    for i, b in enumerate(batches):
        if b.sparse.keys() != keys:
            raise ValueError(f"batch {i} has KJT keys {b.sparse.keys()}, batch 0 has {keys}")
    per_batch = [b.sparse.to_dict() for b in batches]
    return Batch(
        dense=torch.cat([b.dense for b in batches]),
        sparse=KeyedJaggedTensor(
            keys=keys,
            values=torch.cat([d[k].values() for k in keys for d in per_batch]),
            lengths=torch.cat([d[k].lengths() for k in keys for d in per_batch]),
        ),
        labels=torch.cat([b.labels for b in batches]),
    )


def _make_kjt(ids: Sequence[np.ndarray]) -> KeyedJaggedTensor:
    """ids[f] is [B, pooling factor of f] -> KJT with fixed-length bags."""
    return KeyedJaggedTensor(
        keys=feature_names(len(ids)),
        values=torch.from_numpy(np.concatenate([a.reshape(-1) for a in ids]).astype(np.int64)),
        lengths=torch.from_numpy(
            np.concatenate([np.full(a.shape[0], a.shape[1], dtype=np.int32) for a in ids])
        ),
    )


# ---------------------------------------------------------------------------------------
# Synthetic stream
# ---------------------------------------------------------------------------------------

# Ids drawn from a power law over [0, n) are spread over the table by x -> (x * P + c) mod n,
# a bijection when n < P (P prime), so hot ids do not all land in one row-wise shard.
_SPREAD_PRIME = 1_000_000_007
_NUM_SIGNAL_FEATURES = 8
_RULE_STREAM, _BATCH_STREAM = 0, 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A fixed 64-bit mixing function (uint64 arithmetic wraps, which is intended)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class _HiddenRule:
    """The fixed rule behind the labels; it depends on the seed only, never on the rank.

    logit = bias + sum over signal features f of mean over the bag of w_f(id)
                 + dense_weights . (dense - dense_center)
    with w_f(id) uniform in [-sparse_scale, sparse_scale), computed by hashing (salt_f, id)
    so no table of hidden weights has to be stored, whatever the cardinality.
    """

    signal_features: tuple[int, ...]
    salts: np.ndarray  # [F] uint64
    spread_offsets: np.ndarray  # [F] int64
    dense_weights: np.ndarray  # [13] float64
    sparse_scale: float = 1.0
    dense_center: float = 1.35  # about the mean of the synthetic log(1 + count)
    bias: float = -1.0

    def id_weights(self, feature: int, ids: np.ndarray) -> np.ndarray:
        h = _splitmix64(ids.astype(np.uint64) ^ self.salts[feature])
        unit = (h >> np.uint64(11)).astype(np.float64) * 2.0**-53
        return self.sparse_scale * (2.0 * unit - 1.0)

    def logits(self, dense: np.ndarray, ids: Sequence[np.ndarray]) -> np.ndarray:
        out = self.bias + (dense.astype(np.float64) - self.dense_center) @ self.dense_weights
        for f in self.signal_features:
            out = out + self.id_weights(f, ids[f]).mean(axis=1)
        return out


class SyntheticCriteo:
    """A deterministic, endless (or `num_batches`-long) stream of Criteo-like batches.

    Labels follow a hidden fixed rule (see `_HiddenRule`): a random weight per id for 8 of
    the features (chosen by the seed) plus a linear term on the dense features, through a
    sigmoid and sampled, so a DLRM can learn it; `ideal_logits` gives the rule's logits to
    judge how close a model gets.

        data = SyntheticCriteo([20_000] * 26, batch_size=256, seed=0, rank=r, world_size=W)
        for batch in itertools.islice(data, 100): ...

    Ids of feature f lie in [0, num_embeddings_per_feature[f]) and follow a power law
    (exponent `zipf_alpha`) spread over the table; dense features look like Criteo's after
    log(1 + x). Each rank's stream is seeded by (seed, rank, step), so `batch_at(step)` is
    random access and ranks differ; see Note [global batch across ranks] for what holds
    between ranks.

    Args:
        num_embeddings_per_feature: rows of each feature's table, one entry per feature.
        batch_size: local (per-rank) batch size.
        seed: seeds both the hidden rule (shared by all ranks) and the streams.
        rank, world_size: this rank and the number of ranks.
        multi_hot: ids per sample for each feature (fixed bag sizes); default one each.
        num_batches: stop after this many batches; None for an endless stream.
        zipf_alpha: power-law exponent of the id distribution (> 0, != 1).
    """

    def __init__(
        self,
        num_embeddings_per_feature: Sequence[int],
        *,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        multi_hot: Sequence[int] | None = None,
        num_batches: int | None = None,
        zipf_alpha: float = 1.1,
    ) -> None:
        num_features = len(num_embeddings_per_feature)
        if num_features == 0:
            raise ValueError("num_embeddings_per_feature needs at least one feature, got none")
        bad = {f: n for f, n in enumerate(num_embeddings_per_feature) if not 1 <= n < _SPREAD_PRIME}
        if bad:
            raise ValueError(
                f"features {bad} need between 1 and {_SPREAD_PRIME - 1:_} rows "
                f"(the id spreading needs n < {_SPREAD_PRIME:_})"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        multi_hot = [1] * num_features if multi_hot is None else list(multi_hot)
        if len(multi_hot) != num_features or min(multi_hot) < 1:
            raise ValueError(
                f"multi_hot needs one bag size >= 1 for each of the {num_features} features, "
                f"got {multi_hot}"
            )
        if num_batches is not None and num_batches < 0:
            raise ValueError(f"num_batches must be >= 0 or None, got {num_batches}")
        if zipf_alpha <= 0 or zipf_alpha == 1:
            raise ValueError(f"zipf_alpha must be > 0 and != 1, got {zipf_alpha}")
        self.num_embeddings_per_feature = list(num_embeddings_per_feature)
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.multi_hot = multi_hot
        self.num_batches = num_batches
        self.zipf_alpha = zipf_alpha

        rule_rng = np.random.default_rng([seed, _RULE_STREAM])
        self._rule = _HiddenRule(
            signal_features=tuple(
                sorted(
                    rule_rng.choice(
                        num_features, size=min(_NUM_SIGNAL_FEATURES, num_features), replace=False
                    ).tolist()
                )
            ),
            salts=rule_rng.integers(0, 2**63, size=num_features, dtype=np.uint64),
            spread_offsets=np.array(
                [rule_rng.integers(0, n) for n in self.num_embeddings_per_feature], dtype=np.int64
            ),
            dense_weights=rule_rng.normal(0.0, 0.3, size=NUM_DENSE_FEATURES),
        )

    def __iter__(self) -> Iterator[Batch]:
        steps = count() if self.num_batches is None else range(self.num_batches)
        for step in steps:
            yield self.batch_at(step)

    def batch_at(self, step: int) -> Batch:
        """This rank's batch at `step`; the same for the same (seed, rank, step)."""
        rng = np.random.default_rng([self.seed, _BATCH_STREAM, self.rank, step])
        b = self.batch_size
        # Criteo dense features are counts; the model sees log(1 + count).
        counts = np.floor(np.exp(1.0 + 1.5 * rng.standard_normal((b, NUM_DENSE_FEATURES))))
        dense = np.log1p(counts).astype(np.float32)
        ids = [
            self._draw_ids(f, rng.random((b, bag)))
            for f, bag in enumerate(self.multi_hot)
        ]
        p = 1.0 / (1.0 + np.exp(-self._rule.logits(dense, ids)))
        labels = (rng.random(b) < p).astype(np.float32)
        return Batch(
            dense=torch.from_numpy(dense), sparse=_make_kjt(ids), labels=torch.from_numpy(labels)
        )

    def ideal_logits(self, batch: Batch) -> torch.Tensor:
        """The hidden rule's logits [B] for a batch of this stream (labels ~ sigmoid of them).

        Their AUC against the labels is, in expectation, the best any model can reach.
        """
        per_feature = batch.sparse.to_dict()
        b = batch.dense.shape[0]
        ids = [
            per_feature[name].values().numpy().reshape(b, bag)
            for name, bag in zip(feature_names(len(self.multi_hot)), self.multi_hot)
        ]
        return torch.from_numpy(self._rule.logits(batch.dense.numpy(), ids))

    def _draw_ids(self, feature: int, unit: np.ndarray) -> np.ndarray:
        # Inverse CDF of a power law with density ~ (x + 1)^-alpha on [0, n).
        n = self.num_embeddings_per_feature[feature]
        e = 1.0 - self.zipf_alpha
        x = np.floor((1.0 + unit * ((n + 1.0) ** e - 1.0)) ** (1.0 / e) - 1.0)
        x = np.clip(x, 0, n - 1).astype(np.int64)
        return (x * _SPREAD_PRIME + self._rule.spread_offsets[feature]) % n


# ---------------------------------------------------------------------------------------
# Criteo TSV reader
# ---------------------------------------------------------------------------------------

_DENSE_RE = re.compile(r"-?[0-9]+")
_CATEGORICAL_RE = re.compile(r"[0-9a-fA-F]{8}")
_NUM_FIELDS = 1 + NUM_DENSE_FEATURES + NUM_CRITEO_CATEGORICAL


def _parse_line(
    path: Path, lineno: int, line: str, num_embeddings: Sequence[int]
) -> tuple[float, list[float], list[int]]:
    fields = line.rstrip("\r\n").split("\t")
    where = f"{path}, line {lineno}"
    if len(fields) != _NUM_FIELDS:
        raise ValueError(
            f"{where}: expected {_NUM_FIELDS} tab-separated fields (label, "
            f"{NUM_DENSE_FEATURES} dense, {NUM_CRITEO_CATEGORICAL} categorical), got {len(fields)}"
        )
    label, dense_fields, cat_fields = fields[0], fields[1:14], fields[14:]
    if label not in ("0", "1"):
        raise ValueError(f"{where}: label must be 0 or 1, got {label!r}")
    dense = []
    for j, s in enumerate(dense_fields):
        if s and not _DENSE_RE.fullmatch(s):
            raise ValueError(
                f"{where}: dense feature {j} (field {2 + j}) must be an integer or empty, got {s!r}"
            )
        dense.append(math.log1p(max(int(s), 0)) if s else 0.0)
    cats = []
    for j, s in enumerate(cat_fields):
        if s and not _CATEGORICAL_RE.fullmatch(s):
            raise ValueError(
                f"{where}: categorical feature {j} (field {15 + j}) must be 8 hex digits or "
                f"empty, got {s!r}"
            )
        cats.append(int(s, 16) % num_embeddings[j] if s else 0)
    return float(label), dense, cats


def _rows_to_batch(rows: Sequence[tuple[float, list[float], list[int]]]) -> Batch:
    cats = np.array([r[2] for r in rows], dtype=np.int64)  # [B, 26]
    return Batch(
        dense=torch.tensor([r[1] for r in rows], dtype=torch.float32),
        sparse=_make_kjt([cats[:, j : j + 1] for j in range(cats.shape[1])]),
        labels=torch.tensor([r[0] for r in rows], dtype=torch.float32),
    )


def read_criteo_tsv(
    path: str | Path,
    num_embeddings_per_feature: Sequence[int],
    *,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[Batch]:
    """Reads a Criteo-format TSV file into batches, for one rank of `world_size`.

    Each line is `label \\t 13 integer dense features \\t 26 categorical features`, the
    categorical ones as 8 hex digits, any feature may be empty (missing):
    - dense: log(1 + max(x, 0)); missing -> 0.
    - categorical: int(hex, 16) % num_embeddings_per_feature[j]; missing -> id 0 (which
      shares row 0 with the real values that hash there).

    The file is read in windows of `batch_size * world_size` lines; rank r takes the
    contiguous stripe of lines [r * batch_size, (r + 1) * batch_size) of each window, so
    every rank yields the same number of batches of exactly `batch_size` lines, and their
    concatenation in rank order is the batch one rank with `batch_size * world_size` reads
    (Note [global batch across ranks]). A final window with fewer lines is dropped. Every rank
    parses every line, so a malformed line (wrong field count, label not 0/1, non-integer
    dense, non-hex categorical) raises a ValueError naming the file and line on all ranks at
    the same step. Parsing is pure Python: meant for samples and small files.
    """
    if len(num_embeddings_per_feature) != NUM_CRITEO_CATEGORICAL:
        raise ValueError(
            f"Criteo files have {NUM_CRITEO_CATEGORICAL} categorical features, but "
            f"num_embeddings_per_feature has {len(num_embeddings_per_feature)} entries"
        )
    bad = {j: n for j, n in enumerate(num_embeddings_per_feature) if n < 1}
    if bad:
        raise ValueError(f"features {bad} need at least 1 row")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Criteo TSV file {path} does not exist")
    return _read_criteo_tsv(path, list(num_embeddings_per_feature), batch_size, rank, world_size)


def _read_criteo_tsv(
    path: Path, num_embeddings: list[int], batch_size: int, rank: int, world_size: int
) -> Iterator[Batch]:
    window: list[tuple[float, list[float], list[int]]] = []
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            window.append(_parse_line(path, lineno, line, num_embeddings))
            if len(window) == batch_size * world_size:
                yield _rows_to_batch(window[rank * batch_size : (rank + 1) * batch_size])
                window = []
