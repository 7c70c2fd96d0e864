"""Which collections `modular.prefetch` prefetches for (Note [choosing what to prefetch for] in
modular/prefetching.py): decided from the model, never from the batch, so that every rank decides
alike. A model whose collections read different features (two ECs and an EBC) must name them;
without `modules=` every rank raises the same InputError before any batch is armed, also when one
rank's batch has the wrong keys, and nothing is left pending."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from modular.routing.prefetcher import MAX_PENDING
from tests.dist import run_on_ranks
from tests.modular.compare import close
from tests.modular.sequence_cases import make_seq_model, seq_global_batch, seq_plan_for, seq_rank_batches

TIMEOUT_S = 100
STEPS = MAX_PENDING + 2  # past the point where prefetching for every module would fail


def _wrong_keys(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """`kjt` with its last feature renamed: a batch no collection of the model takes."""
    keys = [*kjt.keys()[:-1], "not_a_feature"]
    return KeyedJaggedTensor(keys=keys, values=kjt.values(), lengths=kjt.lengths())


def _prefetch_per_module(case: str) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_seq_model()
    model = modular.shard(copy.deepcopy(ref), seq_plan_for(case, world))
    messages = []
    # Without modules=: the same InputError on every rank, rank 1's batch bad or not.
    first = seq_rank_batches(world, 0)[rank]
    for batch in (first["seq_a"], _wrong_keys(first["seq_a"]) if rank == 1 else first["seq_a"]):
        try:
            modular.prefetch(model, batch)
        except modular.InputError as e:
            messages.append(str(e))
        else:
            raise AssertionError(f"rank {rank}: prefetch without modules= was accepted")
    for name in ("seq_a", "seq_b", "bags"):
        if getattr(model, name)._prefetcher is not None:
            raise AssertionError(f"rank {rank}: {name} got a prefetcher from a refused prefetch")
    # Named: each collection prefetches its own batch, for more steps than MAX_PENDING.
    batches = [seq_rank_batches(world, step % 4) for step in range(STEPS + 1)]
    for name in ("seq_a", "seq_b", "bags"):
        modular.prefetch(model, batches[0][rank][name], modules=[name])
    for step in range(STEPS):
        for name in ("seq_a", "seq_b", "bags"):
            modular.prefetch(model, batches[step + 1][rank][name], modules=[name])
        mine = batches[step][rank]
        for name in ("seq_a", "seq_b", "bags"):
            if id(mine[name]) not in getattr(model, name)._prefetcher._pending:
                raise AssertionError(f"rank {rank}: step {step}'s batch for {name} was not prefetched")
        out = model(mine["seq_a"], mine["seq_b"], mine["bags"])
        whole = {m: seq_global_batch([b[m] for b in batches[step]]) for m in mine}
        want = ref(whole["seq_a"], whole["seq_b"], whole["bags"])
        for key, jt in want[0].items():
            n = [int(b["seq_a"][key.split("@")[0]].lengths().sum()) for b in batches[step]]
            close(out[0][key].values(), jt.values().split(n)[rank], f"step {step} rows of {key}")
    # Named, with rank 1's batch for seq_a bad: its forward raises on every rank, no hang.
    bad = batches[0][rank]["seq_a"]
    bad = _wrong_keys(bad) if rank == 1 else bad
    modular.prefetch(model, bad, modules=["seq_a"])
    try:
        model.seq_a(bad)
    except modular.InputError as e:
        messages.append(str(e))
    else:
        raise AssertionError(f"rank {rank}: a prefetched batch with the wrong keys was accepted")
    return messages


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", ["table_wise", "mixed"])
def test_prefetch_needs_modules_when_collections_read_different_features(case: str) -> None:
    by_rank = run_on_ranks(2, _prefetch_per_module, case, timeout=TIMEOUT_S)
    for messages in by_rank:
        refused = messages[0]
        assert refused.startswith("prefetch: the model's sharded collections read different features"), refused
        assert "pass modules=[...]" in refused and "['seq_a'] read ['cat', 'hist', 'item']" in refused, refused
        assert messages[1] == refused, "a bad batch on rank 1 changes nothing: the choice is the model's"
    assert "feature 'cat' (table 's_small') is missing" in by_rank[1][2], by_rank[1][2]
    assert "rank 1 rejected its batch for module 'seq_a'" in by_rank[0][2], by_rank[0][2]


class _SameFeatures(torch.nn.Module):
    """Two EBCs reading the same feature: one batch serves both."""

    def __init__(self) -> None:
        super().__init__()
        config = lambda name: EmbeddingBagConfig(name=name, num_embeddings=5, embedding_dim=4, feature_names=["f"])  # noqa: E731
        self.a = EmbeddingBagCollection(tables=[config("ta")])
        self.b = EmbeddingBagCollection(tables=[config("tb")])


def test_collections_reading_the_same_features_all_take_the_batch() -> None:
    torch.manual_seed(0)
    model = _SameFeatures()
    modular.fuse_optimizer(model, "exact_sgd", lr=0.1)  # two one-process sharded modules
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    expected = (model.a(kjt).values(), model.b(kjt).values())
    assert modular.prefetch(model, kjt) is model
    assert torch.equal(model.a(kjt).values(), expected[0])
    assert torch.equal(model.b(kjt).values(), expected[1])
    assert not model.a._prefetcher._pending and not model.b._prefetcher._pending
