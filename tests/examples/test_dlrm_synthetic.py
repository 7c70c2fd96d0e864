from itertools import islice

import pytest
import torch

from examples.dlrm.data import Batch, SyntheticCriteo, concat_batches
from examples.dlrm.model import CRITEO_TB, feature_names

ROWS = [min(n, 20_000) for n in CRITEO_TB]


def assert_batches_equal(a: Batch, b: Batch) -> None:
    torch.testing.assert_close(a.dense, b.dense, rtol=0, atol=0)
    torch.testing.assert_close(a.labels, b.labels, rtol=0, atol=0)
    assert a.sparse.keys() == b.sparse.keys()
    assert torch.equal(a.sparse.values(), b.sparse.values())
    assert torch.equal(a.sparse.lengths(), b.sparse.lengths())


def batches_equal(a: Batch, b: Batch) -> bool:
    return torch.equal(a.dense, b.dense) and torch.equal(a.sparse.values(), b.sparse.values())


def test_same_seed_gives_same_batches_and_iter_matches_batch_at() -> None:
    a = list(islice(SyntheticCriteo(ROWS, batch_size=32, seed=7), 3))
    b = list(islice(SyntheticCriteo(ROWS, batch_size=32, seed=7), 3))
    for x, y in zip(a, b):
        assert_batches_equal(x, y)
    random_access = SyntheticCriteo(ROWS, batch_size=32, seed=7)
    for step, x in enumerate(a):
        assert_batches_equal(x, random_access.batch_at(step))
    assert not batches_equal(a[0], a[1])


def test_ranks_and_seeds_give_different_streams() -> None:
    rank0 = SyntheticCriteo(ROWS, batch_size=32, seed=7, rank=0, world_size=2).batch_at(0)
    rank1 = SyntheticCriteo(ROWS, batch_size=32, seed=7, rank=1, world_size=2).batch_at(0)
    other_seed = SyntheticCriteo(ROWS, batch_size=32, seed=8, rank=0, world_size=2).batch_at(0)
    assert not batches_equal(rank0, rank1)
    assert not batches_equal(rank0, other_seed)


def test_global_batch_is_the_concatenation_of_rank_batches() -> None:
    ranks = [SyntheticCriteo(ROWS, batch_size=4, seed=1, rank=r, world_size=3) for r in range(3)]
    local = [d.batch_at(5) for d in ranks]
    glob = concat_batches(local)
    assert glob.dense.shape == (12, 13) and glob.labels.shape == (12,)
    torch.testing.assert_close(glob.dense[4:8], local[1].dense, rtol=0, atol=0)
    for key in feature_names(26):
        expected = torch.cat([b.sparse[key].values() for b in local])
        assert torch.equal(glob.sparse[key].values(), expected)
    # Every rank labels with the same hidden rule.
    torch.testing.assert_close(ranks[0].ideal_logits(glob), ranks[2].ideal_logits(glob))


def test_kjt_layout_and_id_ranges() -> None:
    rows = [3, 10, 100_000, 45_833_188] + [50] * 22
    batch = SyntheticCriteo(rows, batch_size=512, seed=0).batch_at(0)
    assert batch.sparse.keys() == [f"f_cat_{i}" for i in range(26)]
    assert batch.sparse.values().dtype == torch.int64
    assert batch.sparse.lengths().dtype == torch.int32
    assert torch.equal(batch.sparse.lengths(), torch.ones(26 * 512, dtype=torch.int32))
    assert batch.dense.dtype == torch.float32 and batch.dense.shape == (512, 13)
    assert (batch.dense >= 0).all()
    assert set(batch.labels.unique().tolist()) == {0.0, 1.0}
    for f, n in enumerate(rows):
        ids = batch.sparse[f"f_cat_{f}"].values()
        assert ids.min() >= 0 and ids.max() < n, (f, n)
    assert batch.sparse["f_cat_0"].values().unique().numel() == 3


def test_ids_are_skewed_like_real_data() -> None:
    batch = SyntheticCriteo([20_000] * 26, batch_size=4096, seed=0).batch_at(0)
    counts = torch.bincount(batch.sparse["f_cat_3"].values())
    # Uniform ids over 20_000 rows would repeat the top id about 2 times in 4096 draws.
    assert counts.max() > 100
    assert counts.count_nonzero() < 4096 // 2


def test_multi_hot_bag_sizes() -> None:
    multi_hot = [3, 1] + [2] * 24
    data = SyntheticCriteo([100] * 26, batch_size=6, seed=0, multi_hot=multi_hot)
    batch = data.batch_at(0)
    for f, bag in enumerate(multi_hot):
        jt = batch.sparse[f"f_cat_{f}"]
        assert jt.lengths().tolist() == [bag] * 6
        assert jt.values().numel() == 6 * bag
    assert data.ideal_logits(batch).shape == (6,)


def test_num_batches_bounds_the_stream() -> None:
    assert len(list(SyntheticCriteo(ROWS, batch_size=2, seed=0, num_batches=4))) == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rank": 2, "world_size": 2}, r"rank must be in \[0, world_size=2\), got 2"),
        ({"batch_size": 0}, "batch_size must be at least 1, got 0"),
        ({"multi_hot": [1] * 25}, "one bag size >= 1 for each of the 26 features"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict, message: str) -> None:
    args = {"batch_size": 4, "seed": 0} | kwargs
    with pytest.raises(ValueError, match=message):
        SyntheticCriteo(ROWS, **args)


def test_empty_table_is_rejected_with_its_feature() -> None:
    with pytest.raises(ValueError, match=r"features \{1: 0\}"):
        SyntheticCriteo([5, 0], batch_size=4, seed=0)
