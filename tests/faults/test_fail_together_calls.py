"""Issue 48, the other calls' options: `reshard`, `prefetch` and `modular.checkpoint.load` agree
on what changes their collectives before anything is built, armed or read.

At world 2, rank VICTIM differs from its peer in one option: every rank raises the same error class
(ShardingError for reshard and prefetch, CheckpointError for load) within seconds, naming the
option, the ranks and their values, and the model and optimizer state are bit-for-bit what they
were (Note [agreeing on options], Note [agreeing on what to prefetch] in modular/prefetching.py,
Note [a load's options] in modular/checkpoint/_together.py). The calls then still work.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import modular
import modular.checkpoint as ckpt
from tests.dist import run_on_ranks
from tests.faults.helpers import VICTIM
from tests.faults.state import assert_unchanged, snapshot
from tests.faults.test_fail_together_options import wide_ebc
from tests.faults.test_fail_together_saves import shared_dir, trained
from tests.modular.collectives import no_collectives
from tests.modular.ebc_cases import make_batch, make_ebc, plan_for
from tests.modular.sequence_cases import make_seq_model, seq_plan_for, seq_rank_batches

TIMEOUT_S = 90
FAST_S = 10.0  # far below the pool's collective timeout (60 s)
OTHER = 1 - VICTIM


def _raised(call: Callable[[], Any], state: Callable[[], dict], where: str) -> tuple[str, str, float]:
    """(error class, message, seconds) of `call()`, which must raise and leave `state()` as it was."""
    before = state()
    start = time.monotonic()
    try:
        call()
    except Exception as e:  # the error under test
        got = (type(e).__name__, str(e), time.monotonic() - start)
    else:
        raise AssertionError(f"{where}: the call returned")
    assert_unchanged(before, state(), where)
    return got


def _check(got: list, kind: str, call: str, option: str, victim: str, other: str) -> None:
    assert got[0][1] == got[1][1], got
    for rank, (k, message, seconds) in enumerate(got):
        assert k == kind and seconds < FAST_S, (rank, k, seconds, message)
        assert message.startswith(f"ranks disagree on options of {call} that change what its collectives do ("), message
        assert f"{option}: ranks [{VICTIM}] {victim!r}, ranks [{OTHER}] {other!r}" in message or (
            f"{option}: ranks [{OTHER}] {other!r}, ranks [{VICTIM}] {victim!r}" in message
        ), message


# -- reshard ----------------------------------------------------------------------------------


def _reshard_after_weight_decay_on_one_rank() -> tuple[str, str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = wide_ebc()
    opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1)
    modular.shard(model, plan_for("mixed", model, world))
    batch = make_batch(model, seed=rank)
    model(batch).values().pow(2).sum().backward()
    if rank == VICTIM:  # a scheduler that set weight decay on one rank's live param group
        opt.param_groups[0]["weight_decay"] = 0.01
    new_plan = plan_for("table_wise", model, world)
    got = _raised(lambda: modular.reshard(model, new_plan), lambda: snapshot(model, opt), f"rank {rank}")
    opt.param_groups[0]["weight_decay"] = 0.0
    modular.reshard(model, new_plan)  # agreed again: it moves
    model(batch).values().pow(2).sum().backward()
    return got


@pytest.mark.timeout(180)
def test_reshard_with_fused_options_that_differ_raises_on_every_rank() -> None:
    got = run_on_ranks(2, _reshard_after_weight_decay_on_one_rank, timeout=TIMEOUT_S)
    _check(got, "ShardingError", "modular.reshard", "fused hyper-parameters set of module ''", "eps, lr, weight_decay", "eps, lr")
    assert "set weight decay alike on every rank" in got[0][1], got[0][1]


# -- prefetch ---------------------------------------------------------------------------------

# case -> (VICTIM's modules=, the other rank's)
PREFETCH = {
    "other_module": (["seq_b"], ["seq_a"]),
    "one_more_module": (["seq_a", "seq_b"], ["seq_a"]),
    "unknown_module": (["seq_c"], ["seq_a"]),
}


def _prefetch_state(model: torch.nn.Module) -> dict:
    armed = {n: 0 if m._prefetcher is None else len(m._prefetcher._pending) for n, m in modular.sharded_modules(model)}
    assert not any(armed.values()), f"batches armed by a refused prefetch: {armed}"
    return snapshot(model)


def _prefetch_with_other_modules(case: str) -> tuple[str, str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = modular.shard(make_seq_model(), seq_plan_for("mixed", world))
    batches = [seq_rank_batches(world, step)[rank] for step in range(3)]
    mine, others = PREFETCH[case]
    names = mine if rank == VICTIM else others
    # seq_a and seq_b read the same features: one KJT may go to both
    got = _raised(
        lambda: modular.prefetch(model, batches[0]["seq_a"], modules=names),
        lambda: _prefetch_state(model), f"rank {rank}",
    )  # fmt: skip
    # Agreed once per modules=: the first call gathers, the next ones run no collective.
    modular.prefetch(model, batches[1]["seq_a"], modules=["seq_a"])
    with no_collectives():
        modular.prefetch(model, batches[2]["seq_a"], modules=["seq_a"])
    for step in (1, 2):
        b = batches[step]
        model(b["seq_a"], b["seq_b"], b["bags"])
    return got


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", sorted(PREFETCH))
def test_prefetch_for_other_modules_raises_on_every_rank(case: str) -> None:
    got = run_on_ranks(2, _prefetch_with_other_modules, case, timeout=TIMEOUT_S)
    mine, others = PREFETCH[case]
    if case == "unknown_module":
        for rank, (kind, message, seconds) in enumerate(got):
            assert kind == "ShardingError" and seconds < FAST_S, (rank, kind, seconds, message)
        unknown = "prefetch: modules ['seq_c'] are not sharded collections of the model"
        assert got[VICTIM][1].startswith(unknown), got[VICTIM][1]
        assert got[OTHER][1].startswith(f"rank {VICTIM} refused modular.prefetch: {unknown}"), got[OTHER][1]
        return
    _check(got, "ShardingError", "modular.prefetch", "prefetched for", repr(mine), repr(others))
    assert f"modules=: ranks [{VICTIM}] {repr(mine)!r}" in got[0][1] or f"modules=: ranks [{OTHER}] {repr(others)!r}" in got[0][1], got[0][1]


# -- load -------------------------------------------------------------------------------------

LOAD = ("path", "convert_dtypes", "manifest")


def _load_with_other_options(case: str) -> tuple[str, str, float, str, str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    ebc, opt = trained(rank, world)
    root = shared_dir()
    ckpt.save(root / "a", ebc, opt)
    ebc(make_batch(make_ebc(False), seed=5 + rank)).values().pow(2).sum().backward()
    opt.step()
    ckpt.save(root / "b", ebc, opt)
    path, convert = root / "a", False
    original = ckpt.read_manifest
    if rank == VICTIM:
        if case == "path":
            path = root / "b"
        elif case == "convert_dtypes":
            convert = True
        else:  # a rank whose file system shows it another checkpoint at the same path
            def other(found):
                manifest = original(found)
                name = sorted(manifest["files"])[0]
                return {**manifest, "files": {**manifest["files"], name: {**manifest["files"][name], "sha256": "0" * 64}}}
            ckpt.read_manifest = other
    try:
        got = _raised(
            lambda: ckpt.load(path, ebc, opt, convert_dtypes=convert),
            lambda: snapshot(ebc, opt), f"rank {rank}",
        )  # fmt: skip
    finally:
        ckpt.read_manifest = original
    ckpt.load(root / "a", ebc, opt)  # agreed: it loads
    return (*got, str(root / "a"), str(root / "b"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", LOAD)
def test_load_with_other_options_raises_checkpoint_error_on_every_rank(case: str) -> None:
    got = run_on_ranks(2, _load_with_other_options, case, timeout=TIMEOUT_S)
    a, b = got[0][3], got[0][4]
    triples = [g[:3] for g in got]
    if case == "path":
        _check(triples, "CheckpointError", "modular.checkpoint.load", "path", b, a)
    elif case == "convert_dtypes":
        _check(triples, "CheckpointError", "modular.checkpoint.load", "convert_dtypes", "True", "False")
    else:
        assert got[0][1] == got[1][1], got
        for rank, (kind, message, seconds, *_) in enumerate(got):
            assert kind == "CheckpointError" and seconds < FAST_S, (rank, kind, seconds, message)
            assert message.startswith(f"ranks read different checkpoints at {a!r} ("), message
            assert f"ranks [{VICTIM}] read manifest" in message, message
