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

BATCH, STEPS, LR = 6, 5, 0.5
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


def _malformed(what: str) -> None:
    """Rank 1 (of 2) hands the module a malformed VBE batch; rank 0 a good one."""
    rank = dist.get_rank()
    ref = make_ebc(False)
    ebc = modular.shard(copy.deepcopy(ref), plan_for("mixed", ref, 2))
    good = vbe_batch(ref, rank, 2)
    batch = good
    if rank == 1:
        keys, lengths, values = good.keys(), good.lengths(), good.values()
        strides = [s[0] for s in good.stride_per_key_per_rank()]
        inverse = good.inverse_indices()[1].clone()
        if what == "strides":
            strides[keys.index("f_c")] += 1  # one bag more than the lengths hold
        elif what == "inverse":
            inverse[keys.index("f_e"), 4] = strides[keys.index("f_e")]  # past the feature's bags
        elif what == "order":
            keys = [keys[1], keys[0], *keys[2:]]
        batch = KeyedJaggedTensor(
            keys=keys, values=values, lengths=lengths,
            stride_per_key_per_rank=[[s] for s in strides], inverse_indices=(keys, inverse),
        )  # fmt: skip
    ebc(batch)


@pytest.mark.parametrize(
    "what, message",
    [
        ("strides", "the batch's strides ('f_a': 6, 'f_b': 6, 'f_c': 3"),
        ("inverse", "feature 'f_e' of module '': inverse_indices sends sample 4 to bag 2"),
        ("order", "a variable-batch KJT's keys must be the module's features in its order"),
    ],
)
def test_a_malformed_vbe_batch_raises_on_every_rank_naming_it(what: str, message: str) -> None:
    errors = expect_errors_on_all_ranks(2, _malformed, what, timeout=60)
    assert message in errors[1], errors[1]
    assert "rank 1 rejected its batch" in errors[0], errors[0]


def _ec_refuses() -> None:
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    from planners.types import ShardingPlan, ShardingType, TablePlacement

    ec = EmbeddingCollection(tables=[EmbeddingConfig(name="t", num_embeddings=5, embedding_dim=4, feature_names=["f"])])
    plan = ShardingPlan(world_size=2, modules={"": {"t": TablePlacement(ShardingType.ROW_WISE)}})
    modular.shard(ec, plan)
    ec(KeyedJaggedTensor(
        keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]),
        stride_per_key_per_rank=[[2]], inverse_indices=(["f"], torch.tensor([[0, 1, 1]])),
    ))  # fmt: skip


def test_an_embedding_collection_refuses_a_vbe_batch_naming_the_module() -> None:
    for message in expect_errors_on_all_ranks(2, _ec_refuses, timeout=60):
        assert "module ''" in message and "EmbeddingCollection" in message, message


def _output_bytes(plain: bool) -> int:
    """Floats the pooled output dist sends from this rank in one step (forward)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = make_ebc(False)
    ebc = modular.shard(copy.deepcopy(ref), plan_for("table_wise", ref, world))
    sent, original = [], dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        if input.is_floating_point():
            sent.append(input.numel())
        return original(output, input, *args, **kwargs)

    dist.all_to_all_single = counting
    try:
        ebc(vbe_batch(ref, rank, 1, plain=plain))
    finally:
        dist.all_to_all_single = original
    return sum(sent)


def test_the_output_dist_moves_bags_not_samples() -> None:
    # Tables 't_mean' (dim 7, 'f_c') and 't_big' (dim 7, 'f_e') take deduplicated features: one bag
    # for the 6 samples of the request instead of 6; 't_sum' (5, 2 features) and 't_small' (5, 2)
    # take one per sample. Forward floats: 6 x (10 + 10) + 1 x (7 + 7) = 134 against 6 x 34 = 204.
    # Each of the 2 ranks sends every rank's samples' columns of the tables it holds.
    assert sum(run_on_ranks(2, _output_bytes, True, timeout=60)) == 2 * 204
    assert sum(run_on_ranks(2, _output_bytes, False, timeout=60)) == 2 * 134


def test_permute_segments_moves_whole_segments_with_their_ids_and_weights() -> None:
    from modular.routing.variable_batch import permute_segments

    g = torch.Generator().manual_seed(0)
    bags = torch.tensor([3, 0, 5, 1, 4])  # a segment of no bags, and ones of no ids below
    lengths = torch.randint(0, 3, (int(bags.sum()),), generator=g).to(torch.int32)
    lengths[:3] = 0
    values = torch.randint(0, 100, (int(lengths.sum()),), generator=g).to(torch.int32)
    weights = torch.rand(values.numel(), generator=g)
    order = torch.tensor([4, 2, 0, 2, 1])  # segment 3 dropped, segment 2 twice
    got_lengths, got_values, got_weights, got_ids = permute_segments(order, bags, lengths, values, weights)
    cuts = torch.cumsum(bags, 0) - bags
    bag_lengths = [lengths[c : c + b] for c, b in zip(cuts.tolist(), bags.tolist())]
    firsts = torch.cumsum(lengths.long(), 0) - lengths.long()
    ids = [int(seg.sum()) for seg in bag_lengths]
    starts = [int(firsts[c]) if b else 0 for c, b in zip(cuts.tolist(), bags.tolist())]
    want_values = torch.cat([values[starts[i] : starts[i] + ids[i]] for i in order.tolist()])
    want_weights = torch.cat([weights[starts[i] : starts[i] + ids[i]] for i in order.tolist()])
    assert torch.equal(got_lengths, torch.cat([bag_lengths[i] for i in order.tolist()]))
    assert torch.equal(got_values, want_values)
    assert torch.equal(got_weights, want_weights)
    assert got_ids.tolist() == [ids[i] for i in order.tolist()]


class _Ranker(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = make_ebc(False)
        self.tower = torch.nn.Linear(34, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.tower(self.sparse(kjt).values()).square().mean()


def _prefetched_and_compiled(compiled: bool) -> list[float]:
    """20 steps after one warm-up, strides changing every step, each batch prefetched."""
    from torch._dynamo.utils import counters

    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _Ranker()
    tables = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1)
    modular.shard(model, plan_for("mixed", model.sparse, world, module="sparse"))
    dense = torch.optim.SGD(modular.local_parameters(model), lr=0.1)
    call = torch.compile(model) if compiled else model
    batches = [vbe_batch(model.sparse, 31 * step + rank, 1 + (step + rank) % 3) for step in range(21)]
    losses = []
    for step, batch in enumerate(batches):
        if step + 1 < len(batches):
            modular.prefetch(model, batches[step + 1])
        with torch._dynamo.config.patch(error_on_recompile=step >= 1):
            loss = call(batch)
            loss.backward()
        tables.step()
        dense.step()
        dense.zero_grad()
        losses.append(float(loss))
    assert not model.sparse._prefetcher._pending, "every prefetched batch was used"
    if compiled:
        breaks = {k.split("\n")[0]: v for k, v in counters["graph_break"].items()}
        assert list(breaks.values()) == [1], breaks  # the EBC's one deliberate break
    return losses


@pytest.mark.timeout(300)
def test_vbe_batches_prefetch_and_compile_without_recompiles() -> None:
    eager = run_on_ranks(2, _prefetched_and_compiled, False, timeout=240)
    compiled = run_on_ranks(2, _prefetched_and_compiled, True, timeout=240)
    for rank in range(2):
        assert compiled[rank] == pytest.approx(eager[rank], abs=1e-5, rel=0), rank
        assert eager[rank][0] != pytest.approx(eager[rank][-1], abs=1e-4)
