"""FP16 tables and low-precision output dist (Note [low-precision tables] in
modular/kernels/table_dtypes.py, Note [low-precision comms] in modular/comm.py).

Every rank body builds the tables of tests/modular/ebc_cases.py in FP16 (the `mixed` plan keeps one
table FP32, so one module holds both dtypes), shards a copy and checks, on the global batch:
- the forward against an FP32 EBC holding the same (FP16-valued) weights: fbgemm widens each row
  to FP32 and sums in FP32, so the only difference is the order of FP32 additions (ATOL 1e-5);
- the forward against torchrec's unsharded FP16 EBC, whose bags are summed in FP16: a bag of L
  terms carries at most L roundings of relative error u = 2**-11 each for the products with
  per-sample weights and L + 1 for the sums and the MEAN division, so |ours - ref| <=
  (2L + 2) * u * (the bag's sum of |w|), that sum pooled by an FP32 EBC on |weights| (per-sample
  weights are FP16 values, which torchrec's FP16 EBC takes as FP16 tensors and ours as FP16 or
  FP32 tensors, bit for bit alike: Note [per-sample weights of low-precision tables]);
- each local table gradient (FP16, the table's dtype) against the FP32 mirror's: one rounding of
  an FP32 sum, |g16 - g32| <= u * |g32| + 1e-6;
- a torch SGD step on the FP16 shard views: one rounding of w - lr * g, and it reaches the kernels.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from tests.dist import expect_errors_on_all_ranks, run_on_ranks
from tests.modular.compare import local_blocks
from tests.modular.ebc_cases import (
    BATCH, CASES, global_batch, plan_for, rank_batches, unweighted_tables, weighted_tables,
)

U16 = 2.0**-11  # FP16's unit roundoff
MAX_BAG = 3  # cases.make_batch: 0-3 ids per bag


def fp16_ebc(weighted: bool, *, keep_fp32: tuple[str, ...] = (), seed: int = 0) -> EmbeddingBagCollection:
    """The cases' tables in FP16 (those in `keep_fp32` stay FP32), seeded."""
    torch.manual_seed(seed)
    tables = weighted_tables() if weighted else unweighted_tables()
    for t in tables:
        if t.name not in keep_fp32:
            t.data_type = DataType.FP16
    return EmbeddingBagCollection(tables=tables, is_weighted=weighted)


def fp32_mirror(ebc: EmbeddingBagCollection, *, absolute: bool = False) -> EmbeddingBagCollection:
    """An FP32 EBC with `ebc`'s weights (their absolute values with `absolute`)."""
    configs = [copy.copy(c) for c in ebc.embedding_bag_configs()]
    for c in configs:
        c.data_type = DataType.FP32
    out = EmbeddingBagCollection(tables=configs, is_weighted=ebc.is_weighted())
    with torch.no_grad():
        for name, bag in ebc.embedding_bags.items():
            w = bag.weight.detach().float()
            out.embedding_bags[name].weight.copy_(w.abs() if absolute else w)
    return out


def fp16_weights(kjt: KeyedJaggedTensor, half: bool = False) -> KeyedJaggedTensor:
    """`kjt` with per-sample weights rounded to FP16 values (FP16 tensors with `half`)."""
    w = kjt.weights_or_none()
    if w is None:
        return kjt
    w = w.half() if half else w.half().float()
    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=w)


def _fp16_parity(cases: tuple[str, ...]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    for case in cases:
        for weighted in (False, True):
            label = f"{case}, {'weighted' if weighted else 'unweighted'}, rank {rank}/{world}"
            keep = ("t_sum", "w_y") if case == "mixed" else ()
            ref = fp16_ebc(weighted, keep_fp32=keep)
            mirror, absolute = fp32_mirror(ref), fp32_mirror(ref, absolute=True)
            ebc = modular.shard(copy.deepcopy(ref), plan_for(case, ref, world))
            for name, p in ebc.named_parameters():
                want = ref.embedding_bags[name.split(".")[1]].weight.dtype
                for tensor, _, _ in local_blocks(p):
                    if p.dtype != want or tensor.dtype != want:
                        raise AssertionError(f"{label}: {name} is {p.dtype}/{tensor.dtype}, want {want}")
            batches = [fp16_weights(b) for b in rank_batches(ref, world, 1)]
            glob = global_batch(batches)
            out = ebc(batches[rank]).values()
            if weighted:  # Note [per-sample weights of low-precision tables]
                # FP16 weights (what torchrec's FP16 EBC takes) pool exactly as their FP32
                # widening; dtypes that neither FP32 nor the tables' dtype are refused, saying so.
                half = ebc(fp16_weights(batches[rank], half=True)).values()
                if not torch.equal(half, out):
                    raise AssertionError(f"{label}: FP16 per-sample weights pool differently from FP32 ones")
                for bad in (torch.float64, torch.bfloat16):
                    b = batches[rank]
                    kjt = KeyedJaggedTensor(keys=b.keys(), values=b.values(), lengths=b.lengths(), weights=b.weights().to(bad))
                    try:
                        ebc(kjt)
                        raise AssertionError(f"{label}: {bad} per-sample weights were taken")
                    except modular.InputError as e:
                        if f"per-sample weights for module '' are {bad}" not in str(e) or "float16" not in str(e):
                            raise
            if out.dtype != torch.float32:
                raise AssertionError(f"{label}: pooled outputs are {out.dtype}, want FP32")
            exact = mirror(glob).values()[mine]
            torch.testing.assert_close(out, exact, atol=1e-5, rtol=0, msg=lambda m: f"{label}: vs FP32 sums: {m}")
            # torchrec's weighted EBC needs per-sample weights of each table's dtype, so one
            # mixing FP16 and FP32 tables cannot run: there the FP32 sums above are the check.
            with torch.no_grad():
                bound = (2 * MAX_BAG + 2) * U16 * absolute(glob).values()[mine] + 1e-7
                if weighted and keep:
                    bound = torch.full_like(bound, float("inf"))
                    err = torch.zeros_like(bound)
                else:
                    err = (out - ref(fp16_weights(glob, half=True)).values()[mine].float()).abs()
            if not bool((err <= bound).all()):
                i = int((err - bound).argmax())
                raise AssertionError(
                    f"{label}: vs torchrec's FP16 EBC: error {err.view(-1)[i]:.3g} over the bound "
                    f"{bound.view(-1)[i]:.3g} at flat index {i}"
                )
            target = torch.randn(exact.shape[0] * world, exact.shape[1], generator=torch.Generator().manual_seed(7))
            (out * target[mine]).sum().backward()
            ((mirror(glob).values() * target).sum() / world).backward()
            for name, p in ebc.named_parameters():
                table = name.split(".")[1]
                full = mirror.embedding_bags[table].weight.grad
                for tensor, rows, cols in local_blocks(p):
                    g = tensor.grad
                    if g is None or g.dtype != tensor.dtype:
                        raise AssertionError(f"{label}: grad of {name} is {None if g is None else g.dtype}")
                    want = full[rows, cols]
                    if not bool(((g.float() - want).abs() <= U16 * want.abs() + 1e-6).all()):
                        raise AssertionError(f"{label}: grad of {name}[{rows}, {cols}] is off: {g} vs {want}")
            # A torch optimizer steps the FP16 shard views in place (through to the kernels):
            # w - lr * g in FP32, rounded once to the table's dtype (1 ulp: 2u|w|).
            local = modular.local_parameters(ebc)
            if local:
                before = [(p, p.detach().clone(), p.grad.detach().clone()) for p in local]
                torch.optim.SGD(local, lr=0.5).step()
                for p, w, g in before:
                    want = w.float() - 0.5 * g.float()
                    if not bool(((p.detach().float() - want).abs() <= 2 * U16 * want.abs() + 1e-7).all()):
                        raise AssertionError(f"{label}: SGD on an FP16 shard view is off")
                after = ebc(batches[rank]).values()
                if torch.equal(after, out):
                    raise AssertionError(f"{label}: the step did not reach the lookup kernels")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fp16_tables_match_the_unsharded_fp16_ebc(world: int) -> None:
    run_on_ranks(world, _fp16_parity, CASES, timeout=240)


def _bf16_on_cpu() -> None:
    torch.manual_seed(0)
    tables = unweighted_tables()
    tables[2].data_type = DataType.BF16
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    modular.shard(ebc, plan_for("row_wise", ebc, dist.get_world_size()))


def test_bf16_tables_on_cpu_are_refused_on_every_rank() -> None:
    for message in expect_errors_on_all_ranks(2, _bf16_on_cpu):
        assert "'t_small'" in message and "bfloat16" in message and "cpu" in message, message


# -- low-precision comms -------------------------------------------------------------------------

U_WIRE = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _sent_dtypes(log: list) -> object:
    """Wraps dist.all_to_all_single to record the dtype of every tensor sent; returns the original."""
    original = dist.all_to_all_single

    def recording(out, inp, *args, **kwargs):
        log.append(inp.dtype)
        return original(out, inp, *args, **kwargs)

    dist.all_to_all_single = recording
    return original


def _comm_precision(cases: tuple[str, ...]) -> None:
    """FP32 tables, so that only the wire rounds: against the same model with FP32 comms, each
    pooled value (a row-wise partial sum, or a whole bag) is rounded once on the wire, so the
    output is off by at most u * (the bag's sum of |w|), and each table gradient by at most
    u * (its gradient for |target|), every output gradient being rounded once on its way back.
    With output_dtype the output is rounded once more (another u of it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    for case in cases:
        for weighted in (False, True):
            torch.manual_seed(3)
            tables = weighted_tables() if weighted else unweighted_tables()
            ref = EmbeddingBagCollection(tables=tables, is_weighted=weighted)
            plan = plan_for(case, ref, world)
            base = modular.shard(copy.deepcopy(ref), plan)
            absolute = modular.shard(fp32_mirror(ref, absolute=True), plan)
            batches = rank_batches(ref, world, 1)
            target = torch.randn(BATCH * world, base.layout.output_dim, generator=torch.Generator().manual_seed(5))[mine]
            out = base(batches[rank]).values()
            (out * target).sum().backward()
            abs_out = absolute(batches[rank]).values()
            (abs_out * target.abs()).sum().backward()
            for wire, output in ((torch.float16, None), (torch.bfloat16, torch.bfloat16)):
                label = f"{case}, {'weighted' if weighted else 'unweighted'}, {wire} comms, rank {rank}/{world}"
                u = U_WIRE[wire]
                # BF16 through the per-module form (a dict by module FQN), FP16 for the plan.
                per = (lambda x: {"": x}) if wire is torch.bfloat16 else (lambda x: x)
                low = modular.shard(copy.deepcopy(ref), plan, comm_dtype=per(wire), output_dtype=per(output))
                sent: list = []
                original = _sent_dtypes(sent)
                try:
                    got = low(batches[rank]).values()
                    (got.float() * target).sum().backward()
                finally:
                    dist.all_to_all_single = original
                if world > 1 and sent.count(wire) != 2:
                    raise AssertionError(f"{label}: dtypes sent {sent}: want the pooled all-to-alls in {wire}")
                want_out = output or torch.float32
                if got.dtype != want_out:
                    raise AssertionError(f"{label}: output is {got.dtype}, want {want_out}")
                rounds = 1 if output is None else 2
                _within(got.float(), out, rounds * u * abs_out + 1e-7, f"{label}: forward")
                for (name, p), (_, q), (_, a) in zip(
                    low.named_parameters(), base.named_parameters(), absolute.named_parameters()
                ):
                    for (t, rows, cols), (t0, _, _), (ta, _, _) in zip(local_blocks(p), local_blocks(q), local_blocks(a)):
                        _within(t.grad, t0.grad, rounds * u * ta.grad + 1e-7, f"{label}: grad of {name}[{rows}, {cols}]")


def _within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (got - want).abs()
    if not bool((err <= bound).all()):
        i = int((err - bound).argmax())
        raise AssertionError(f"{what}: error {err.view(-1)[i]:.3g} over the bound {bound.view(-1)[i]:.3g}")


def test_low_precision_comms_stay_within_one_rounding_of_fp32_comms() -> None:
    run_on_ranks(3, _comm_precision, ("row_wise", "column_wise", "table_wise", "mixed"), timeout=240)


# -- clipping FP16 gradients ---------------------------------------------------------------------


def _clip_fp16_grads() -> list[float]:
    """Every local FP16 table gradient set to 1000 (FP16-exact): the global norm is 1000 *
    sqrt(elements), past FP16's 65504 for these tables, and must come out exact (FP32 norms)."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    tables = unweighted_tables()
    for t in tables:
        t.data_type = DataType.FP16
        t.num_embeddings *= 100
    ebc = modular.shard(EmbeddingBagCollection(tables=tables), plan_for("mixed", EmbeddingBagCollection(tables=tables, device=torch.device("meta")), world))
    local = modular.local_parameters(ebc)
    for p in local:
        p.grad = torch.full_like(p, 1000.0)
    total = modular.clip_grad_norm_(ebc, max_norm=1.0)
    elements = sum(t.num_embeddings * t.embedding_dim for t in tables)
    clipped = max((float(p.grad.float().abs().max()) for p in local), default=0.0)
    return [float(total), 1000.0 * elements**0.5, clipped]


def test_clip_grad_norm_of_fp16_tables_is_exact_past_fp16_range() -> None:
    for total, want, clipped in run_on_ranks(2, _clip_fp16_grads):
        assert want > 65504 and abs(total - want) <= 1e-5 * want, (total, want)
        assert clipped == pytest.approx(1000.0 / want, rel=1e-2), clipped  # scaled, in FP16


def test_dtype_options_name_unknown_modules_and_dtypes() -> None:
    from modular.dtype_options import per_module
    from modular.errors import ShardingError

    assert per_module({"a": torch.float16}, ["a", "b"], "comm_dtype", None) == {"a": torch.float16, "b": None}
    assert per_module(torch.bfloat16, ["a"], "output_dtype", torch.float32) == {"a": torch.bfloat16}
    with pytest.raises(ShardingError, match=r"comm_dtype names modules \['c'\], which the plan does not shard; the plan's modules are \['a', 'b'\]"):
        per_module({"c": torch.float16}, ["a", "b"], "comm_dtype", None)
    with pytest.raises(ShardingError, match=r"output_dtype for module 'a' is torch.int8"):
        per_module(torch.int8, ["a"], "output_dtype", torch.float32)
