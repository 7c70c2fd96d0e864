"""Variable batch per feature (Note [variable batch per feature] in modular/routing/variable_batch.py).

A sharded EBC given torchrec's VBE KeyedJaggedTensors (request-level features deduplicated: fewer
bags than samples, `inverse_indices` back to the batch; ranks with different strides; in a world
of 3 one rank's batch a plain one some steps) computes exactly what torchrec's unsharded EBC does
on each rank's KJT: outputs, every gradient and the weights after the steps (unfused SGD, and
fused), for every sharding type and a mixed plan, weighted and unweighted, ShardedTensor and
DTensor tables. The reference loss is the mean over ranks of each rank's loss, computed with the
unsharded EBC on each rank's own VBE batch. The output dist's bytes scale with the bags, not the
batch; malformed VBE batches raise on every rank naming the feature; an EmbeddingCollection
refuses a VBE batch naming the module.
"""

from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from modular.tables.forms import is_sharded, local_pieces
from tests.dist import expect_errors_on_all_ranks, run_on_ranks
from tests.modular.ebc_cases import CASES, features_of, id_bounds, make_ebc, plan_for
from tests.modular.fused_reference import FUSED_EPS, FUSED_LR, FusedReference

BATCH, STEPS, LR = 6, 3, 0.5
DEDUPED = ("f_c", "f_e", "g_c")  # request-level features: one bag per request


def vbe_batch(ebc, seed: int, requests: int, plain: bool = False) -> KeyedJaggedTensor:
    """A batch of BATCH samples from `requests` requests: the request-level features hold one bag
    per request (samples of a request share it), the others one per sample. `plain`: the same
    batch expanded, an ordinary KJT."""
    g = torch.Generator().manual_seed(seed)
    keys, bounds = features_of(ebc), id_bounds(ebc)
    strides, inverse, lengths, values = [], [], [], []
    request_of = torch.arange(BATCH) * requests // BATCH  # sample -> its request, in order
    for f in keys:
        deduped = f in DEDUPED and not plain
        n_bags = requests if deduped else BATCH
        n = torch.randint(0, 4, (n_bags,), generator=g)
        v = torch.randint(0, bounds[f], (int(n.sum()),), generator=g)
        if f in DEDUPED and plain:  # the request's bag repeated for each of its samples
            per_request = torch.randint(0, 4, (requests,), generator=g)
            bags = list(torch.randint(0, bounds[f], (int(per_request.sum()),), generator=g).split(per_request.tolist()))
            n = per_request[request_of]
            v = torch.cat([bags[int(r)] for r in request_of])
        strides.append(n_bags)
        inverse.append(request_of if deduped else torch.arange(BATCH))
        lengths.append(n)
        values.append(v)
    weights = torch.rand(int(torch.cat(lengths).sum()), generator=g) + 0.5 if ebc.is_weighted() else None
    if plain:
        return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths), weights=weights)
    return KeyedJaggedTensor(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths), weights=weights,
        stride_per_key_per_rank=[[s] for s in strides], inverse_indices=(keys, torch.stack(inverse)),
    )  # fmt: skip


def rank_batches(ebc, world: int, step: int) -> list[KeyedJaggedTensor]:
    """Every rank's batch of one step: 1-3 requests, differing by rank; in a world of 3 the last
    rank's batch is a plain one at odd steps."""
    return [
        vbe_batch(ebc, 100 * step + r, 1 + (r + step) % 3, plain=world == 3 and r == 2 and step % 2 == 1)
        for r in range(world)
    ]


def _pieces(p: torch.Tensor) -> list[tuple[torch.Tensor, slice, slice]]:
    if is_sharded(p):
        return [(t, slice(o[0], o[0] + s[0]), slice(o[1], o[1] + s[1])) for o, s, t in local_pieces(p)]
    return [(p, slice(None), slice(None))]


def _train(case: str, weighted: bool, fused: Optional[str], tensor_type: str) -> int:
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = make_ebc(weighted)
    ebc = copy.deepcopy(ref)
    opt = modular.fuse_optimizer(ebc, fused, lr=FUSED_LR, eps=FUSED_EPS) if fused else None
    modular.shard(ebc, plan_for(case, ebc, world), tensor_type=tensor_type)
    opt = opt or torch.optim.SGD(modular.local_parameters(ebc), lr=LR)
    ref_opt = FusedReference(ref, fused) if fused else torch.optim.SGD(ref.parameters(), lr=LR)
    ref_params = dict(ref.named_parameters())
    label = f"{case} weighted={weighted} fused={fused} {tensor_type}, rank {rank}/{world}"
    compared = 0
    for step in range(STEPS):
        batches = rank_batches(ref, world, step)
        got = ebc(batches[rank]).values()
        wants = [ref(b).values() for b in batches]
        torch.testing.assert_close(got, wants[rank], atol=1e-5, rtol=0, msg=lambda m: f"{label} step {step}: {m}")
        targets = [torch.randn(w.shape, generator=torch.Generator().manual_seed(step * 10 + r)) for r, w in enumerate(wants)]
        (got * targets[rank]).sum().backward()
        (sum((w * t).sum() for w, t in zip(wants, targets)) / world).backward()
        if fused is None:
            for name, p in ebc.named_parameters():
                for t, rows, cols in _pieces(p):
                    torch.testing.assert_close(
                        t.grad, ref_params[name].grad[rows, cols], atol=1e-5, rtol=0,
                        msg=lambda m: f"{label} step {step}: grad of {name}: {m}",
                    )  # fmt: skip
                    compared += 1
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        else:
            ref_opt.step()
        compared += 1
    for name, p in ebc.named_parameters():
        for t, rows, cols in _pieces(p):
            torch.testing.assert_close(
                t.detach(), ref_params[name].detach()[rows, cols], atol=1e-5, rtol=0,
                msg=lambda m: f"{label}: {name} after {STEPS} steps: {m}",
            )  # fmt: skip
            compared += 1
    return compared


def _every_case(world: int) -> int:
    total = 0
    for i, case in enumerate(CASES):
        weighted = bool(i % 2)
        total += _train(case, weighted, None, "sharded_tensor")
        fused = ("exact_sgd", "exact_adagrad", "exact_rowwise_adagrad")[i % 3]
        total += _train(case, not weighted, fused, "dtensor" if i % 2 else "sharded_tensor")
    return total


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_vbe_batches_train_like_torchrec_unsharded_ebc(world: int) -> None:
    compared = run_on_ranks(world, _every_case, world, timeout=240)
    assert min(compared) > 40, compared
