"""Both sharded collections take the same options (issue 41): `tensor_type="dtensor"`,
`output_dtype` and `comm_dtype`, with the same contract, parametrized over the two kinds.

The model is the sequence cases' (tests/modular/sequence_cases.py): two EmbeddingCollections and an
EBC. An option given per module (a dict by FQN) applies to one kind only, so the other kind in the
same model must stay exact: the options follow the module, not the model. Against the unsharded
model on the global batch (the loss averaged over ranks), for 3 SGD steps:
- `output_dtype=d`: the output is in `d` and equals the reference's output rounded to `d` (an EC's
  rows exactly: a row rounded once; an EBC's pooled sums within one rounding of `d`);
- `comm_dtype=d`: the output is FP32 and equals the reference within one rounding of `d` per value
  (an EC's rows exactly `want.to(d).float()`);
- gradients and weights after the steps within the rounding the wire or output adds;
- `tensor_type="dtensor"`: every sharded table of both kinds is a DTensor, with the reference's
  outputs, gradients and weights (1e-5), unfused and fused.
FP16 tables whose rows go out and over the wire in FP16 lose nothing: the EC's output then equals
torchrec's FP16 EmbeddingCollection's bit for bit.
"""

from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

import modular
from modular.tables.forms import is_sharded, local_pieces
from planners.types import ShardingType
from tests.dist import run_on_ranks
from tests.modular.sequence_cases import (
    SeqModel, bag_tables, make_seq_model, seq_a_tables, seq_b_tables, seq_global_batch,
    seq_plan_for, seq_rank_batches,
)

STEPS, LR = 3, 0.5
MODULES = {"ebc": ("bags",), "ec": ("seq_a", "seq_b")}
# One rounding of each dtype, relative (its unit roundoff, doubled for a value that is rounded
# once forward on the wire and whose gradient is rounded once backward).
ROUNDING = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 1e-6}
CASES = ("row_wise", "column_wise", "mixed")


def _pieces(p: torch.Tensor) -> list[tuple[torch.Tensor, slice, slice]]:
    """(tensor, rows, cols) of this rank's pieces of a table: shards, or the whole data-parallel copy."""
    if is_sharded(p):
        return [(t, slice(o[0], o[0] + s[0]), slice(o[1], o[1] + s[1])) for o, s, t in local_pieces(p)]
    return [(p, slice(0, p.shape[0]), slice(0, p.shape[1]))]


def _outputs(out) -> dict[str, torch.Tensor]:
    """Every output of the model by name: each EC key's rows, the EBC's pooled values."""
    seq_a, seq_b, bags = out
    flat = {"bags": bags.values()}
    for name, part in (("seq_a", seq_a), ("seq_b", seq_b)):
        flat.update({f"{name}.{k}": jt.values() for k, jt in part.items()})
    return flat


def _rows(batches, rank: int, name: str) -> slice:
    """This rank's rows of output `name` in the global output."""
    if name == "bags":
        n = batches[rank]["bags"].stride()
        return slice(rank * n, (rank + 1) * n)
    module, key = name.split(".", 1)
    feature = key.split("@")[0]
    before = sum(int(b[module][feature].lengths().sum()) for b in batches[:rank])
    return slice(before, before + int(batches[rank][module][feature].lengths().sum()))


def _check(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    torch.testing.assert_close(
        got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}"
    )


def _train(case: str, options: dict, tolerances: dict, fused: Optional[str]) -> int:
    """3 steps of the sharded model and the unsharded reference; `tolerances` by module FQN
    (relative rounding allowed in its outputs, gradients and weights; absent: exact to 1e-5)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = make_seq_model()
    model = copy.deepcopy(ref)
    tables_opt = modular.fuse_optimizer(model, fused, lr=LR) if fused else None
    modular.shard(model, seq_plan_for(case, world), **options)
    opt = tables_opt or torch.optim.SGD(modular.local_parameters(model), lr=LR)
    ref_opt = (torch.optim.Adagrad if fused else torch.optim.SGD)(ref.parameters(), lr=LR, **({"eps": 1e-8} if fused else {}))
    if options.get("tensor_type") == "dtensor":
        for name, p in model.named_parameters():
            module = name.split(".")[0]
            placed = seq_plan_for(case, world).modules[module][name.split(".")[-2]]
            if placed.sharding_type is not ShardingType.DATA_PARALLEL and not isinstance(p, DTensor):
                raise AssertionError(f"{case}: {name} is a {type(p).__name__}, not a DTensor")
    tol_of = lambda name: tolerances.get(name.split(".")[0], 1e-5)  # noqa: E731
    output_dtype = options.get("output_dtype") or {}
    compared = 0
    ref_params = dict(ref.named_parameters())
    for step in range(STEPS):
        batches = seq_rank_batches(world, step)
        mine = batches[rank]
        got = _outputs(model(mine["seq_a"], mine["seq_b"], mine["bags"]))
        whole = {m: seq_global_batch([b[m] for b in batches]) for m in mine}
        want = _outputs(ref(whole["seq_a"], whole["seq_b"], whole["bags"]))
        assert list(got) == list(want), (list(got), list(want))
        g = torch.Generator().manual_seed(step)
        targets = {k: torch.randn(v.shape, generator=g) for k, v in want.items()}
        for name, w in want.items():
            what = f"{case} rank {rank}/{world} step {step}: output {name}"
            dtype = output_dtype.get(name.split(".")[0], torch.float32)
            if got[name].dtype != dtype:
                raise AssertionError(f"{what}: dtype {got[name].dtype}, expected {dtype}")
            _check(got[name], w[_rows(batches, rank, name)].to(dtype), tol_of(name), what)
            compared += 1
        loss = sum((got[k].float() * targets[k][_rows(batches, rank, k)]).sum() for k in got)
        loss.backward()
        (sum((want[k] * targets[k]).sum() for k in want) / world).backward()
        if tables_opt is None:
            for name, p in model.named_parameters():
                for t, rows, cols in _pieces(p):
                    what = f"{case} rank {rank}/{world} step {step}: grad of {name}[{rows}, {cols}]"
                    _check(t.grad, ref_params[name].grad[rows, cols], 4 * tol_of(name), what)
                    compared += 1
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    for name, p in model.named_parameters():
        for t, rows, cols in _pieces(p):
            what = f"{case} rank {rank}/{world}: {name}[{rows}, {cols}] after {STEPS} steps"
            _check(t.detach(), ref_params[name].detach()[rows, cols], 8 * tol_of(name), what)
            compared += 1
    return compared


def _all_cases(options: dict, tolerances: dict, fused: Optional[str] = None) -> int:
    return sum(_train(case, options, tolerances, fused) for case in CASES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["ebc", "ec"])
@pytest.mark.parametrize("option", ["output_dtype", "comm_dtype"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_options_apply_to_either_kind_alone(world, kind, option, dtype) -> None:
    options = {option: {fqn: dtype for fqn in MODULES[kind]}}
    tolerances = {fqn: ROUNDING[dtype] for fqn in MODULES[kind]}
    compared = run_on_ranks(world, _all_cases, options, tolerances, timeout=240)
    assert min(compared) > 30, compared


def _exact_rows(world: int) -> None:
    """An EC's rows under a low-precision wire or output are the reference's rows rounded once:
    equal, not merely close."""
    rank = dist.get_rank()
    ref = make_seq_model()
    model = modular.shard(
        copy.deepcopy(ref), seq_plan_for("mixed", world),
        output_dtype={"seq_a": torch.float16}, comm_dtype={"seq_b": torch.bfloat16},
    )  # fmt: skip
    batches = seq_rank_batches(world, 1)
    got = _outputs(model(*(batches[rank][m] for m in ("seq_a", "seq_b", "bags"))))
    whole = [seq_global_batch([b[m] for b in batches]) for m in ("seq_a", "seq_b", "bags")]
    want = _outputs(ref(*whole))
    for name, w in want.items():
        if name == "bags":
            continue
        expected = w[_rows(batches, rank, name)]
        if name.startswith("seq_a"):
            expected = expected.to(torch.float16)
        elif name != "seq_b.v_seq":  # the wire's rounding, FP32 out; data-parallel 'v' stays home
            expected = expected.to(torch.bfloat16).float()
        if not torch.equal(got[name], expected):
            raise AssertionError(f"{name}: {got[name]} != {expected}")


@pytest.mark.parametrize("world", [2, 3])
def test_ec_rows_round_exactly_once(world: int) -> None:
    run_on_ranks(world, _exact_rows, world, timeout=120)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("fused", [None, "exact_adagrad"])
def test_dtensor_tables_of_both_kinds_train_exactly(world: int, fused: Optional[str]) -> None:
    compared = run_on_ranks(world, _all_cases, {"tensor_type": "dtensor"}, {}, fused, timeout=240)
    assert min(compared) > 30, compared


class _FP16Sequences(torch.nn.Module):
    """The sequence cases' model with every EC table in FP16."""

    def __init__(self) -> None:
        super().__init__()
        a, b = seq_a_tables(), seq_b_tables()
        for t in (*a, *b):
            t.data_type = DataType.FP16
        self.seq_a = EmbeddingCollection(tables=a)
        self.seq_b = EmbeddingCollection(tables=b)
        self.bags = EmbeddingBagCollection(tables=bag_tables())

    forward = SeqModel.forward


def _fp16_sequences(world: int) -> None:
    """FP16 tables, FP16 output and FP16 wire: torchrec's FP16 EC output, bit for bit."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = _FP16Sequences()
    fp16 = {"seq_a": torch.float16, "seq_b": torch.float16}
    model = modular.shard(
        copy.deepcopy(ref), seq_plan_for("mixed", world), output_dtype=fp16, comm_dtype=fp16
    )
    batches = seq_rank_batches(world, 0)
    modules = ("seq_a", "seq_b", "bags")
    got = _outputs(model(*(batches[rank][m] for m in modules)))
    want = _outputs(ref(*(seq_global_batch([b[m] for b in batches]) for m in modules)))
    for name, w in want.items():
        if name == "bags":
            continue
        expected = w[_rows(batches, rank, name)].to(torch.float16)
        if got[name].dtype != torch.float16 or not torch.equal(got[name], expected):
            raise AssertionError(f"{name}: {got[name]} != {expected}")


@pytest.mark.parametrize("world", [2, 3])
def test_fp16_sequence_tables_with_fp16_outputs_and_wire_lose_nothing(world: int) -> None:
    run_on_ranks(world, _fp16_sequences, world, timeout=120)
