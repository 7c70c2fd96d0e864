"""Issue 48, batches: every local check of a batch feeds the input dist's agreement.

A batch whose values, lengths or per-sample weights are not 1-D, on one rank or on all, raises
`InputError` on every rank at once (not torch's raw "Tensors must have same number of
dimensions" on one rank while its peers wait for the collective timeout, nor an error blaming ids
that are all valid), naming the rank, the feature and the shape, for an EBC, a weighted EBC and an
EmbeddingCollection; the tables and optimizer state are bit-for-bit what they were, and the next
good batch is right (Note [a batch's shapes] in modular/routing/shapes.py).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from tests.dist import run_on_ranks
from tests.faults.helpers import VICTIM
from tests.faults.state import assert_unchanged, rejected, snapshot
from tests.modular.ebc_cases import make_batch, make_ebc, plan_for, rank_batches
from tests.modular.sequence_cases import SEQ_FEATURES, make_seq_model, seq_make_batch, seq_plan_for

TIMEOUT_S = 90
FAST_S = 10.0  # far below the pool's collective timeout (60 s): a rank that waited for it fails


def two_d(kjt: KeyedJaggedTensor, part: str) -> KeyedJaggedTensor:
    values, lengths, weights = kjt.values(), kjt.lengths(), kjt.weights_or_none()
    if part == "values":
        values = values.view(-1, 1)
    elif part == "lengths":
        lengths = lengths.view(-1, 1)
    elif part == "weights":
        weights = weights.view(-1, 1)
    else:
        raise ValueError(part)
    return KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=lengths, weights=weights)


def _step(model, opt, batch) -> None:
    out = model(batch)
    loss = (out.values() if hasattr(out, "values") and callable(out.values) else out).float().pow(2).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _ebc_with_bad_shape(part: str, everywhere: bool) -> tuple[str, str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    weighted = part == "weights"
    ref = make_ebc(weighted)
    ebc = modular.shard(copy.deepcopy(ref), plan_for("mixed", ref, world))
    opt = torch.optim.Adagrad(modular.local_parameters(ebc), lr=0.1)
    _step(ebc, opt, make_batch(ref, seed=10 + rank))  # so that the optimizer has state
    batch = make_batch(ref, seed=rank)
    if everywhere or rank == VICTIM:
        batch = two_d(batch, part)
    got = rejected(ebc, opt, batch, f"rank {rank}: 2-D {part}")
    batches = rank_batches(ref, world, step=1)
    ebc(batches[rank])  # the next good batch runs on every rank (no rank is left in a collective)
    return got




@pytest.mark.timeout(180)
@pytest.mark.parametrize("everywhere", [False, True], ids=["one_rank", "every_rank"])
@pytest.mark.parametrize("part", ["values", "lengths", "weights"])
def test_a_2d_batch_raises_input_error_on_every_rank_at_once(part: str, everywhere: bool) -> None:
    got = run_on_ranks(2, _ebc_with_bad_shape, part, everywhere, timeout=TIMEOUT_S)
    name = {"values": "ids (values)", "lengths": "lengths", "weights": "per-sample weights"}[part]
    for rank, (kind, message, seconds) in enumerate(got):
        assert kind == "InputError", (rank, kind, message)
        assert seconds < FAST_S, (rank, seconds, message)
        if everywhere or rank == VICTIM:
            assert message.startswith(f"rank {rank}: the batch for module '' (features ["), message
            assert f"has the wrong shape: its {name} have shape (" in message and "(2-D), not 1-D" in message, message
        else:
            assert message.startswith(
                f"rank {VICTIM} rejected its batch for module '' (ids, lengths or weights that are not 1-D in feature '"
            ), message
        assert "out of range" not in message, message  # valid ids are not blamed


def _ec_with_bad_shape() -> tuple[str, str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_seq_model()
    modular.shard(model, seq_plan_for("mixed", world))
    opt = torch.optim.Adagrad(modular.local_parameters(model), lr=0.1)
    before = snapshot(model, opt)
    batch = seq_make_batch(SEQ_FEATURES["seq_a"], seed=rank)
    if rank == VICTIM:
        batch = two_d(batch, "values")
    start = time.monotonic()
    try:
        model.seq_a(batch)
    except Exception as e:  # the error under test
        got = (type(e).__name__, str(e), time.monotonic() - start)
    else:
        raise AssertionError(f"rank {rank}: 2-D values were accepted by an EmbeddingCollection")
    assert_unchanged(before, snapshot(model, opt), f"rank {rank}")
    model.seq_a(seq_make_batch(SEQ_FEATURES["seq_a"], seed=5 + rank))  # the next batch runs
    return got


@pytest.mark.timeout(180)
def test_an_embedding_collection_gets_the_same() -> None:
    got = run_on_ranks(2, _ec_with_bad_shape, timeout=TIMEOUT_S)
    for rank, (kind, message, seconds) in enumerate(got):
        assert kind == "InputError" and seconds < FAST_S, (rank, kind, seconds, message)
    assert got[VICTIM][1].startswith(f"rank {VICTIM}: the batch for module 'seq_a' (features ['item', 'hist', 'cat']) has the wrong shape: its ids (values) have shape ("), got[VICTIM][1]
    assert got[1 - VICTIM][1].startswith(
        f"rank {VICTIM} rejected its batch for module 'seq_a' (ids, lengths or weights that are not 1-D in feature 'item')"
    ), got[1 - VICTIM][1]
