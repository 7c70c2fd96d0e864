"""CUDA: `modular.reshard` with the old shards of rebuilt kernels staged through host memory
(issue 39; Note [reshard memory] in modular/resharding/memory.py, "On a device").

Skipped where torch sees no CUDA device; `MODULAR_GPU_TEST_DEVICE=cpu` runs the same bodies on CPU
gloo ranks, as tests/gpu/test_cuda.py explains. Not yet run on a GPU: written in a session
without one; `bash scripts/gpu/run.sh reshard` runs it (docs/gpu.md says what its result
decides). Staging is off by default (`staging._STAGE_THROUGH_HOST = False`): every body forces
it on (True), so the old storages of every kernel a rank rebuilds are copied to host, freed in
place (`resize_(0)`) and refilled, which on CUDA is what nothing else has run: fbgemm's TBE
(weights and momentum buffers) and the emulated kernels must train on after it.

World 2, gloo, both ranks on the one GPU (tests/gpu/test_cuda.py's `run_spawned`), widths 16
and 32 (off CPU every shard is a multiple of 4 columns):
- a chain of plans through every ordered pair of table-wise, row-wise, column-wise and
  data-parallel (12 reshards), 2 steps before the first and 3 after each, unfused (SGD,
  rebuilt after each reshard) and fused (row-wise Adagrad; Adam, moments and step count), against
  the unsharded reference on the same device; every reshard staged something, and with nothing
  held (the last loss and the SGD optimizer dropped first) gave nothing back before the build;
- a `state_dict()` held across a reshard reads its old values (its storages get their bytes
  back, with the warning); a failure injected on rank 1 before the commit restores every staged
  storage bit for bit and the old module trains on in parity;
- the device's peak growth during a reshard (`torch.cuda.max_memory_allocated()` after
  `reset_peak_memory_stats()`, minus `memory_allocated()` before) is at most the bytes the rank
  receives plus its largest moved block (issue 39's bound; 1 MiB for the new modules' small
  buffers), 4 tables of 8 MiB, dense and fused, one table and every table moved; every value
  checked after. On CPU ranks only the values are checked (host copies are CPU memory too).
On CPU ranks (2 cores) the three take about 26 s; writing them found that a table-wise move staged
nothing (every kernel whose tables kept their cuts was an adoption candidate, left on the device:
fixed in modular/resharding/adopt.py).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import modular
from modular.resharding import moves as reshard_moves
from modular.resharding import host_staging as reshard_staging
from modular.tables.forms import Piece, is_sharded, local_pieces
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.gpu.test_cuda import DEVICE_KIND, _close, _ebc, run_spawned
from tests.modular.adam_reference import ADAM_FAMILY, MomentsReference, touched_rows
from tests.modular.compare import full_value, state_error
from tests.modular.ebc_cases import global_batch, make_batch, placements_for
from tests.modular.fused_reference import FusedReference
from tests.modular.resharding.test_reshard import (
    LR, _circuit, _fuse, _Holder, _local_values, _reshard_warnings, memory_holder,
)

pytestmark = pytest.mark.skipif(
    DEVICE_KIND == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
)

WORLD = 2
CHAIN = _circuit(("table_wise", "row_wise", "column_wise", "data_parallel"))  # every ordered pair
MiB = 1 << 20


# -- staging, forced on and counted ----------------------------------------------------------------


@contextlib.contextmanager
def _staged(log: list[dict]) -> Iterator[None]:
    """Staging through host forced on (True), and per reshard on this rank: how many storages it
    staged (`staged`), how many it gave their bytes back from host (`restored`, summed over its
    restores) and, where it restored all of them (a failure before the commit), whether each then
    held its host copy's bytes again (`intact`). Nothing here outlives the call: a tensor on an
    old storage would count as a holder in the next reshard's check (Note [reshard memory])."""
    init, restore = reshard_staging.Staged.__init__, reshard_staging.Staged.restore

    def spy_init(self, *args) -> None:
        init(self, *args)
        log.append({"staged": len(self._storages), "restored": 0})

    def spy_restore(self, *args, **kwargs) -> set:
        out = restore(self, *args, **kwargs)
        log[-1]["restored"] += len(out)
        if not kwargs.get("only_held"):
            log[-1]["intact"] = [
                whole.untyped_storage().nbytes() == host.nbytes()
                and torch.equal(whole.cpu(), torch.empty(0, dtype=torch.uint8).set_(host))
                for whole, host in self._storages.values()
            ]  # fmt: skip
        return out

    with (
        mock.patch.object(reshard_staging, "_STAGE_THROUGH_HOST", True),
        mock.patch.object(reshard_staging.Staged, "__init__", spy_init),
        mock.patch.object(reshard_staging.Staged, "restore", spy_restore),
    ):
        yield


# -- training against the reference ---------------------------------------------------------------


class _Reference:
    """The unsharded EBC on `device`, trained on the global batch by the torch twin of
    `optimizer` ("sgd", "exact_rowwise_adagrad" or one of the Adam family); it never reshards."""

    def __init__(self, ebc: nn.Module, optimizer: str, device: torch.device) -> None:
        self.module, self.optimizer = copy.deepcopy(ebc).to(device), optimizer
        if optimizer == "sgd":
            self.sgd = torch.optim.SGD(self.module.parameters(), lr=LR)
        elif optimizer in ADAM_FAMILY:
            self.moments = MomentsReference(self.module, optimizer)
        else:
            self.fused = FusedReference(self.module, optimizer, device=device)

    def step(self, batches: list) -> None:
        if self.optimizer == "sgd":
            self.sgd.step()
            self.sgd.zero_grad()
        elif self.optimizer in ADAM_FAMILY:
            self.moments.step(touched_rows(self.module, batches))
        else:
            self.fused.step()

    def check(self, model: nn.Module, fused: Any, what: str, prefix: str = "") -> None:
        """`model`'s local shards (on the device) and its fused optimizer's state (whose names
        are `prefix` + the EBC's) against the reference's."""
        refs = dict(self.module.named_parameters())
        for name, p in model.named_parameters():  # ShardedTensor tables, or data-parallel copies
            for piece in local_pieces(p) if is_sharded(p) else [Piece((0, 0), tuple(p.shape), p)]:
                (r0, c0), (nr, nc) = piece.offsets, piece.sizes
                _close(piece.tensor.detach(), refs[name].detach()[r0 : r0 + nr, c0 : c0 + nc], f"{what}: {name}")
        if fused is None:
            return
        states = fused.state_dict()["state"]
        assert sorted(n.removeprefix(prefix) for n in states) == sorted(refs), f"{what}: state of {sorted(states)}"
        for fqn, state in states.items():
            name = fqn.removeprefix(prefix)
            if self.optimizer in ADAM_FAMILY:
                want = self.moments.state(name)
                assert int(state["step"]) == self.moments.steps, f"{what}: step count of {name}: {state['step']}"
            else:
                want = {"row_sum": self.fused.state(name)}
            for key, value in want.items():
                state_error(state[key], value, f"{what}: state {key} of {name}", _close)


def _plan(case: str, ebc: nn.Module, module: str = "") -> ShardingPlan:
    return ShardingPlan(world_size=WORLD, modules={module: placements_for(case, ebc, WORLD)})


def _train(model: nn.Module, ref: _Reference, opt: Any, steps: range, device: torch.device, what: str) -> None:
    """`steps` training steps of `model` on this rank's batches and of `ref` on the global batch,
    outputs compared at each; the losses go with this frame (they hold the kernels' graph)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in steps:
        batches = [make_batch(ref.module, seed=1000 * step + r).to(device) for r in range(world)]
        out = model(batches[rank]).values()
        expected = ref.module(global_batch(batches)).values()
        mine = slice(rank * out.shape[0], (rank + 1) * out.shape[0])
        _close(out, expected[mine], f"{what}, step {step}: output")
        target = torch.randn(expected.shape, generator=torch.Generator().manual_seed(step)).to(device)
        (out * target[mine]).sum().backward()
        ((expected * target).sum() / world).backward()
        opt.step()
        opt.zero_grad()
        ref.step(batches)


def _optimizer(model: nn.Module, fused: Any) -> Any:
    return fused if fused is not None else torch.optim.SGD(modular.local_parameters(model), lr=LR)


# -- bodies ----------------------------------------------------------------------------------------


def _chains(device: torch.device) -> dict[str, list[dict]]:
    """CHAIN under each optimizer (module docstring); per optimizer, each reshard's counts."""
    rank = dist.get_rank()
    out = {}
    for optimizer in ("sgd", "exact_rowwise_adagrad", "adam"):
        ebc = _ebc()
        ref = _Reference(ebc, optimizer, device)
        fused = None if optimizer == "sgd" else _fuse(ebc, optimizer)
        model = modular.shard(ebc, _plan(CHAIN[0], ebc), device=device)
        log: list[dict] = []
        step = 0
        with _staged(log):
            for i, case in enumerate(CHAIN):
                what = f"rank {rank} {optimizer}: {CHAIN[i - 1] if i else ''} -> {case}"
                opt = _optimizer(model, fused)
                steps = range(step, step + (2 if i == 0 else 3))
                _train(model, ref, opt, steps, device, what)
                step = steps.stop
                if i + 1 == len(CHAIN):
                    break
                del opt  # SGD's holds the old parameters (a held storage would be given back)
                said: list[str] = []
                with _reshard_warnings(said):
                    assert modular.reshard(model, _plan(CHAIN[i + 1], ebc)) is model
                assert not said, f"{what}: nothing was held, yet reshard said {said}"
                ref.check(model, fused, f"{what} -> {CHAIN[i + 1]}, after the reshard")
        out[optimizer] = log
    return out


def _held_and_failed(device: torch.device) -> dict[str, Any]:
    """Fused row-wise Adagrad: a `state_dict()` held across a table-wise -> row-wise reshard
    reads its old values (its storages restored, with the warning); then rank 1 fails while
    writing a block of a row-wise -> column-wise reshard, before the commit: every rank raises,
    keeps its old module, every staged storage has its bytes back as they were, and training
    goes on in parity."""
    rank = dist.get_rank()
    ebc = _ebc()
    ref = _Reference(ebc, "exact_rowwise_adagrad", device)
    holder = _Holder(ebc)
    fused = _fuse(holder, "exact_rowwise_adagrad")  # the model's: its state is read at holder.ebc
    modular.shard(holder, _plan("table_wise", ebc, "ebc"), device=device)
    log: list[dict] = []
    with _staged(log):
        _train(holder.ebc, ref, fused, range(2), device, f"rank {rank} before")
        held = holder.state_dict()
        want = _local_values(held)
        said: list[str] = []
        with _reshard_warnings(said):
            modular.reshard(holder, _plan("row_wise", ebc, "ebc"))
        for k, values in _local_values(held).items():
            assert all(torch.equal(a, b) for a, b in zip(values, want[k], strict=True)), f"held state_dict {k} changed"
        assert len(said) == 1 and "still referenced outside the model" in said[0], said
        del held, want
        ref.check(holder.ebc, fused, f"rank {rank} after the reshard holding a state_dict", "ebc.")
        _train(holder.ebc, ref, fused, range(2, 4), device, f"rank {rank} after the held reshard")
        old = holder.ebc
        views = {k: v.detach().clone() for k, v in old.local_shard_views().items()}
        states = {k: {n: s.clone() for n, s in st.items()} for k, st in old.fused_tables.states().items()}
        fault = RuntimeError("injected fault")
        failing = mock.patch.object(reshard_moves, "copy_block", side_effect=fault) if rank == 1 else contextlib.nullcontext()
        with failing, pytest.raises(modular.ShardingError, match="modular.reshard failed on rank 1"):
            modular.reshard(holder, _plan("column_wise", ebc, "ebc"))
        assert holder.ebc is old, "a failed reshard replaced the module"
        intact = log[-1].get("intact")  # every freed storage has its bytes back
        assert intact and all(intact), f"rank {rank}: the failed reshard's staged storages restored: {intact}"
        for k, v in old.local_shard_views().items():
            assert v.device == device and torch.equal(v.detach(), views[k]), f"shard {k} changed by the failed reshard"
        for k, st in old.fused_tables.states().items():
            for n, s in st.items():
                assert torch.equal(s, states[k][n]), f"state {n} of shard {k} changed by the failed reshard"
        _train(holder.ebc, ref, fused, range(4, 7), device, f"rank {rank} after the failed reshard")
        ref.check(holder.ebc, fused, f"rank {rank} after the failed reshard", "ebc.")
    return {"log": log}


def _tables(module: nn.Module) -> dict[str, torch.Tensor]:
    """Each table whole, on the CPU (collective); no tensor of the module outlives this frame,
    which would hold its storages through the next reshard."""
    return {n: full_value(p) for n, p in module.named_parameters()}


def _peak_growth(device: torch.device) -> list[dict]:
    """Per reshard: the device's peak growth (None on CPU) against issue 39's bound, for a dense
    and a fused (row-wise Adagrad) module of 4 tables of 32,768 x 64 FP32 (8 MiB), table-wise,
    moving one table and then every table to the next rank; every value checked after."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rows, dim, names = 32_768, 64, [f"m{i}" for i in range(4)]
    holder, _ = memory_holder(rows, dim, names)
    at: Callable[[dict], dict] = lambda ranks: {  # noqa: E731
        n: TablePlacement(ShardingType.TABLE_WISE, ranks=(ranks[n],)) for n in names
    }  # fmt: skip
    placed = {n: i % world for i, n in enumerate(names)}
    modular.shard(holder, ShardingPlan(world_size=world, modules={m: at(placed) for m in ("dense", "fused")}), device=device)
    out: list[dict] = []
    log: list[dict] = []
    with _staged(log):
        for module, row_bytes in (("dense", dim * 4), ("fused", dim * 4 + 4)):
            ranks = dict(placed)
            for moved in (names[:1], names):
                new = {n: (r + (n in moved)) % world for n, r in ranks.items()}
                received = sum(rows * row_bytes for n in moved if new[n] == rank)
                moves = any(rank in (ranks[n], new[n]) for n in moved)
                values = _tables(getattr(holder, module))
                growth = None
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    before = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                said: list[str] = []
                with _reshard_warnings(said):
                    modular.reshard(holder, ShardingPlan(world_size=world, modules={module: at(new)}))
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    growth = torch.cuda.max_memory_allocated() - before
                for n, value in _tables(getattr(holder, module)).items():
                    assert torch.equal(value, values[n]), f"{module}: {n} changed"
                bound = received + (rows * dim * 4 if moves else 0)  # the largest moved block: weights
                beside = received + sum(rows * row_bytes for n in names if new[n] == rank)
                assert not said, f"rank {rank} {module}, {len(moved)} moved: nothing was held, yet {said}"
                out.append({"what": f"{module}, {len(moved)} moved", "growth": growth, "bound": bound,
                            "beside": beside, **log[-1]})  # fmt: skip
                ranks = new
    return out


# -- tests -----------------------------------------------------------------------------------------


def test_a_chain_of_plans_trains_like_the_unsharded_ebc_through_host_staging() -> None:
    """SGD, row-wise Adagrad and Adam across 12 staged reshards; each staged storages on every
    rank and, with nothing held, gave none back before the new modules took them."""
    for rank, logs in enumerate(run_spawned(WORLD, _chains)):
        for optimizer, log in logs.items():
            assert len(log) == len(CHAIN) - 1, (rank, optimizer, log)
            assert all(e["staged"] > 0 and e["restored"] == 0 for e in log), (rank, optimizer, log)


def test_a_held_state_dict_and_a_failed_reshard_get_their_staged_storages_back() -> None:
    for rank, result in enumerate(run_spawned(WORLD, _held_and_failed)):
        held, failed = result["log"]
        assert held["staged"] > 0 and held["restored"] > 0, (rank, held)  # the state_dict's
        assert failed["staged"] > 0 and failed["restored"] == failed["staged"], (rank, failed)  # all


def test_the_device_grows_by_at_most_what_a_rank_receives_plus_its_largest_moved_block() -> None:
    """On CUDA: issue 39's bound, and less than building the new kernels beside the old ones
    (`beside`) wherever that is over the bound. On CPU ranks: the values only."""
    for rank, rows in enumerate(run_spawned(WORLD, _peak_growth)):
        assert len(rows) == 4 and all(r["staged"] > 0 and r["restored"] == 0 for r in rows), (rank, rows)
        if DEVICE_KIND != "cuda":
            continue
        for r in rows:
            assert r["growth"] <= r["bound"] + MiB, (rank, r["what"], f"grew {r['growth'] / MiB:.1f} MiB, bound {r['bound'] / MiB:.1f}")
            assert r["growth"] < r["beside"] or r["beside"] <= r["bound"], (rank, r)
