"""A small sequential recommender: a user's item history (an EmbeddingCollection, one row per
item looked up) and their user id (an EmbeddingBagCollection), scored against a target item.

    history ids ─> seq: EmbeddingCollection ─> per-id rows ─> mean per sample ─┐
    target id   ─> seq (same item table)    ─> the target's row ───────────────┤─> tower ─> score
    user id     ─> user: EmbeddingBagCollection ─> pooled ──────────────────────┘

Small on purpose: it shows a model holding both kinds of collection sharded by `modular`, not a
strong recommender. Sequences may be empty (a new user): their mean is zero.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

DIM = 8
ITEMS, CATEGORIES, USERS = 61, 9, 37
SEQUENCE_FEATURES = ["history", "target", "history_category"]
USER_FEATURES = ["user_id"]


def sequence_tables() -> list[EmbeddingConfig]:
    return [
        # one item table read by the history and the target: keys 'history' and 'target'
        EmbeddingConfig(name="item", num_embeddings=ITEMS, embedding_dim=DIM, feature_names=["history", "target"]),
        EmbeddingConfig(name="category", num_embeddings=CATEGORIES, embedding_dim=DIM, feature_names=["history_category"]),
    ]


def user_tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="user", num_embeddings=USERS, embedding_dim=DIM, feature_names=USER_FEATURES)]


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4 * DIM, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).squeeze(1)


class Batch(NamedTuple):
    sequences: KeyedJaggedTensor  # SEQUENCE_FEATURES: history and its categories, one target each
    users: KeyedJaggedTensor  # USER_FEATURES: one id each
    labels: torch.Tensor  # (batch,) in {0, 1}


class SequentialRecommender(nn.Module):
    def __init__(self, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.seq = EmbeddingCollection(tables=sequence_tables(), device=device)
        self.user = EmbeddingBagCollection(tables=user_tables(), device=device)
        self.tower = Tower()

    def forward(self, batch: Batch) -> torch.Tensor:
        """The score of each sample's target for its user and history (logits)."""
        rows = self.seq(batch.sequences)
        size = batch.labels.shape[0]
        history = _mean_per_sample(rows["history"], size)
        categories = _mean_per_sample(rows["history_category"], size)
        target = _mean_per_sample(rows["target"], size)
        user = self.user(batch.users).values()
        return self.tower(torch.cat([history, categories, target, user], dim=1))

    def loss(self, batch: Batch) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(self(batch), batch.labels)


def _mean_per_sample(jt: JaggedTensor, batch: int) -> torch.Tensor:
    """(batch, DIM): the mean of each sample's rows (zero for an empty sequence)."""
    lengths = jt.lengths().long()
    sample = torch.repeat_interleave(torch.arange(batch), lengths)
    sums = torch.zeros(batch, jt.values().shape[1]).index_add(0, sample, jt.values())
    return sums / lengths.clamp(min=1).unsqueeze(1).to(sums.dtype)


def make_batch(step: int, rank: int, *, batch_size: int = 4, seed: int = 0) -> Batch:
    """A synthetic batch, seeded by (seed, step, rank): histories of 0-5 items; the label says
    whether the target's id shares its parity with most of the history (a learnable signal)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    lengths = torch.randint(0, 6, (batch_size,), generator=g)
    history = torch.randint(0, ITEMS, (int(lengths.sum()),), generator=g)
    target = torch.randint(0, ITEMS, (batch_size,), generator=g)
    labels = torch.zeros(batch_size)
    for i, seq in enumerate(history.split(lengths.tolist())):
        labels[i] = float(bool(seq.numel()) and float((seq % 2 == target[i] % 2).float().mean()) >= 0.5)
    sequences = KeyedJaggedTensor(
        keys=SEQUENCE_FEATURES,
        values=torch.cat([history, target, history % CATEGORIES]),
        lengths=torch.cat([lengths, torch.ones(batch_size, dtype=torch.int64), lengths]),
    )
    users = KeyedJaggedTensor(
        keys=USER_FEATURES,
        values=torch.randint(0, USERS, (batch_size,), generator=g),
        lengths=torch.ones(batch_size, dtype=torch.int64),
    )
    return Batch(sequences, users, labels)


def global_batch(batches: list[Batch]) -> Batch:
    """The ranks' batches as one (rank order), for a single-process reference."""

    def cat(kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        keys = kjts[0].keys()
        values = [k[f].values() for f in keys for k in kjts]
        lengths = [k[f].lengths() for f in keys for k in kjts]
        return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))

    return Batch(
        cat([b.sequences for b in batches]),
        cat([b.users for b in batches]),
        torch.cat([b.labels for b in batches]),
    )
