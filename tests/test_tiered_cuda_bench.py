"""benchmarks/tiered_cuda.py on CPU (issue 47's benchmark against TorchRec's FUSED_UVM_CACHING,
written without a GPU): TorchRec's planner plans the UVM-caching contender without one, and its
plan agrees with `planners.to_torchrec` of modular's tiered plan; the arguments are checked
before any rank starts; and the harness, run at world 1 on CPU, trains the tiered and resident
contenders alike on the same batches."""

from __future__ import annotations

import os

import pytest
import torch

_before = os.environ.get("MODULAR_CUDA_TIERS")
from benchmarks import tiered_cuda  # noqa: E402  (sets MODULAR_CUDA_TIERS for its ranks)

if _before is None:
    os.environ.pop("MODULAR_CUDA_TIERS", None)

GiB = 1 << 30


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_torchrec_plans_uvm_caching_without_a_gpu_as_to_torchrec_converts_ours(sharding: str) -> None:
    from planners import to_torchrec

    world, rows, cache = 2, 1 << 20, 0.05
    tables = tiered_cuda.table_configs(4, rows, 128)
    theirs = tiered_cuda.torchrec_uvm_plan(
        tables, world_size=world, cache=cache, sharding=sharding, batch=4096,
        device_memory=80 * GiB, host_memory=512 * GiB,
    )  # fmt: skip
    model = tiered_cuda.dlrm(tables, torch.device("meta"))
    ours = tiered_cuda.modular_plan(model, world_size=world, cache=cache, sharding=sharding, batch=4096,
                                    device_memory=80 * GiB, host_memory=512 * GiB, on_gpu=True)  # fmt: skip
    converted = to_torchrec(ours, model, device_type="cuda")
    fqn = "sparse.ebc"
    assert set(theirs.plan) == set(converted.plan) == {fqn}
    for t in tables:
        a, b = theirs.plan[fqn][t.name], converted.plan[fqn][t.name]
        assert (a.sharding_type, a.compute_kernel) == (sharding, "fused_uvm_caching"), t.name
        assert (b.sharding_type, b.compute_kernel) == (a.sharding_type, a.compute_kernel), t.name
        assert a.cache_params.load_factor == b.cache_params.load_factor == cache
        assert a.cache_params.algorithm == b.cache_params.algorithm
        shards = a.sharding_spec.shards
        assert sum(s.shard_sizes[0] for s in shards) == rows and {s.shard_sizes[1] for s in shards} == {128}
        assert all(str(s.placement).split("/")[1].startswith("cuda:") for s in shards), shards
        assert len(shards) == (world if sharding == "row_wise" else 1)


def test_the_cpu_stand_in_plans_the_plain_fused_kernel() -> None:
    tables = tiered_cuda.table_configs(2, 1024, 16)
    plan = tiered_cuda.torchrec_uvm_plan(
        tables, world_size=1, cache=None, sharding="table_wise", batch=64,
        device_memory=GiB, host_memory=GiB, compute_device="cpu",
    )  # fmt: skip
    kinds = {(p.compute_kernel, p.cache_params) for p in plan.plan["sparse.ebc"].values()}
    assert kinds == {("fused", None)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_a_gpu_says_so_and_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        tiered_cuda.parse(["--quick"])  # --device cuda is the default
    assert e.value.code == 2
    assert "--device cuda: torch sees no CUDA device here" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cache", "0"], "--cache is a cache_load_factor, 0 < f <= 1, got 0.0"),
        (["--rows", "100", "--resident-rows", "200"], "--resident-rows 200 is more than --rows 100"),
        (["--dim", "30"], "--dim 30: fbgemm's fused kernels take widths that are multiples of 4"),
        (["--block", "0"], "--block must be at least 1, got 0"),
        (["--rows", str(1 << 31), "--dim", "128"], "pass fewer --rows"),
    ],
)
def test_bad_arguments_are_refused_before_any_rank_starts(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        tiered_cuda.parse(["--device", "cpu", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_the_harness_on_cpu_trains_tiered_and_resident_alike(tmp_path, capsys) -> None:
    out = tiered_cuda.main([
        "--device", "cpu", "--world-size", "1", "--tables", "3", "--rows", "4096", "--dim", "8",
        "--batch", "256", "--cache", "0.25", "--warmup", "2", "--blocks", "2", "--block", "2",
        "--dir", str(tmp_path), "--json", str(tmp_path / "out.json"),
    ])  # fmt: skip
    (rank,) = out["ranks"]
    assert rank["not_run"] == {}
    c = rank["contenders"]
    assert set(c) == {"tiered", "uvm", "resident"}
    steps = 2 + 2 * 2
    assert len(c["tiered"]["losses"]) == len(c["resident"]["losses"]) == len(c["uvm"]["losses"]) == steps
    # the same tables, weights and ids: a tiered table trains bit for bit as the resident one
    assert c["tiered"]["losses"] == c["resident"]["losses"]
    assert out["summary"]["loss_diff_tiered_resident"] == 0
    hit = c["tiered"]["hit"]
    # 3 tables x 256 Zipf ids a step, 1,024 slots each (room for a step and the next): prefetched
    # steps miss nothing, and rows still come in
    assert 0 < hit["fetched"] < hit["looked_up"] and hit["step_misses"] == 0, hit
    # TorchRec passes gather_uvm_cache_stats to fbgemm's TBE, found under the sharded EBC's
    # lookups; the CPU stand-in has no cache, so it counts nothing and reports no hit rate
    assert c["uvm"]["hit"] == {"tbes": 1, "looked_up": 0, "fetched": 0, "conflict_misses": 0,
                                "hit_rate": None}
    assert c["resident"]["hit"] is None
    assert (tmp_path / "out.json").exists() and os.listdir(tmp_path) == ["out.json"]  # tiers removed
    text = capsys.readouterr().out
    assert "| modular tiered (cache 0.25, LRU, prefetch) |" in text and "tiered / resident" in text


def _cuda_args(**changes):
    import argparse

    fields = dict(device="cuda", tables=8, rows=1 << 23, dim=128, cache=0.05, resident_rows=1 << 23,
                  world_size=1, no_torchrec=False, host_memory=128 * GiB, device_memory=80 * GiB)  # fmt: skip
    return argparse.ArgumentParser(prog="tiered_cuda.py"), argparse.Namespace(**{**fields, **changes})


def test_the_default_size_fits_the_lent_machine_and_a_smaller_one_is_refused(capsys) -> None:
    tiered_cuda._check_memory(*_cuda_args())  # 2 x 32.2 GiB on the host, 35.5 GiB on an H100
    for changes, message in (
        ({"host_memory": 64 * GiB}, "64.5 GiB in all, over 80% of this machine's 64.0 GiB"),
        ({"device_memory": 40 * GiB}, "take 35.5 GiB per GPU, over 85% of its 40.0 GiB"),
    ):  # fmt: skip
        with pytest.raises(SystemExit):
            tiered_cuda._check_memory(*_cuda_args(**changes))
        assert message in capsys.readouterr().err
    tiered_cuda._check_memory(*_cuda_args(host_memory=64 * GiB, no_torchrec=True))
    tiered_cuda._check_memory(*_cuda_args(device_memory=40 * GiB, resident_rows=0))


def test_the_report_of_a_run_whose_tiered_contender_failed_names_it_and_leaves_out_its_ratios() -> None:
    args = tiered_cuda.parse(["--device", "cpu", "--rows", "1024", "--dim", "8", "--block", "2"])
    uvm = {"step_s": 0.004, "blocks_s": [0.004] * 6, "hit": None, "held": 0, "driver_used": 0, "host": 0,
           "step_peak": None, "peak": None, "losses": [0.7] * 6}  # fmt: skip
    rank = {"rank": 0, "seconds": {"tiered": 0.5, "uvm": 1.0}, "hwm": GiB, "contenders": {"uvm": uvm},
            "not_run": {"tiered": "failed in warm-up: rank 0: RuntimeError: boom"}}  # fmt: skip
    text, out = tiered_cuda.report(args, [rank])
    assert out["summary"] == {}
    assert "| TorchRec DMP, fused (CPU stand-in, no UVM on CPU) | 4.0 |" in text
    assert "modular tiered (cache 0.05, LRU, prefetch): not run, failed in warm-up: rank 0: RuntimeError: boom" in text
    assert "tiered /" not in text and "| modular tiered" not in text  # what run.sh's rerun looks for


def test_two_ranks_sharing_one_gpu_have_their_uvm_shards_on_cuda_0() -> None:
    tables = tiered_cuda.table_configs(2, 1 << 16, 16)
    plan = tiered_cuda.torchrec_uvm_plan(
        tables, world_size=2, cache=0.1, sharding="row_wise", batch=64, device_memory=80 * GiB,
        host_memory=512 * GiB, devices=1,
    )  # fmt: skip
    places = {str(s.placement) for p in plan.plan["sparse.ebc"].values() for s in p.sharding_spec.shards}
    assert places == {"rank:0/cuda:0", "rank:1/cuda:0"}
