"""examples/train_dlrm.py on 2 gloo ranks: resume continues the same run, export loads strictly.

The pooled ranks of tests/dist.py run `train` in-process (no start-up cost); one test starts the
script itself, as a user would, to cover the self-launch and the Criteo TSV path.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import modular

from tests.dist import run_on_ranks
from tests.examples.script_run import run_script

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(batch_size=64, eval_batches=1, progress=False)


def _losses(config_kwargs: dict) -> tuple:
    from examples import train_dlrm

    result = train_dlrm.train(train_dlrm.TrainConfig(**SMALL, **config_kwargs))
    return result.start_step, result.end_step, result.losses


def test_resume_continues_the_run_it_stopped(tmp_path: Path) -> None:
    # Uninterrupted: steps 0..7. Interrupted: steps 0..4, saved, then resumed for 5..7.
    whole = run_on_ranks(2, _losses, dict(steps=8, checkpoint_dir=str(tmp_path / "a")), timeout=90)
    first = run_on_ranks(2, _losses, dict(steps=5, checkpoint_dir=str(tmp_path / "b")), timeout=90)
    assert (tmp_path / "b" / "step_00000005" / "checkpoint.json").is_file()
    rest = run_on_ranks(
        2, _losses, dict(steps=8, checkpoint_dir=str(tmp_path / "b"), resume=True), timeout=90
    )
    (_, _, full), (_, _, head), (start, end, tail) = whole[0], first[0], rest[0]
    assert (start, end) == (5, 8)
    assert full[-1] < full[0] - 0.01, full  # it learns at all
    # The resumed run sees the same batches with the same tables, dense weights and optimizer
    # state (Adam moments, row-wise Adagrad sums) as the uninterrupted one.
    torch.testing.assert_close(torch.tensor(head + tail), torch.tensor(full), atol=1e-5, rtol=1e-5)
    assert rest[1][2] == tail  # ranks agree on the (all-reduced) losses


def test_the_column_wise_statistic_reaches_the_planner_and_the_fused_optimizer() -> None:
    # On 4 ranks the plan cuts t_cat_0 into 4 column pieces (in either mode). The first loss
    # comes before any update: the same. After it, each piece's own statistic (per_shard)
    # updates t_cat_0 differently from the whole row's (exact).
    exact = run_on_ranks(4, _losses, dict(steps=3), timeout=120)[0][2]
    per_shard = run_on_ranks(4, _losses, dict(steps=3, column_wise_statistic="per_shard"), timeout=120)[0][2]
    assert per_shard[0] == exact[0]
    assert per_shard[1:] != exact[1:], (exact, per_shard)


def test_prefetching_the_next_batch_does_not_change_the_run() -> None:
    with_prefetch = run_on_ranks(2, _losses, dict(steps=6, prefetch=True), timeout=90)
    without = run_on_ranks(2, _losses, dict(steps=6, prefetch=False), timeout=90)
    assert with_prefetch == without  # the same ops on the same ids: the same losses, bit for bit


def _losses_compiled(config_kwargs: dict) -> tuple:
    torch._dynamo.reset()  # a fresh compile, whatever ran on this pooled rank before
    return _losses(dict(config_kwargs, compile=True))


def test_compile_trains_like_eager() -> None:
    # --compile: the towers and the interaction compiled, the tables eager behind their boundary
    # (Note [compiling a sharded model]); inductor may reorder float sums, so 1e-5, not bit for bit.
    compiled = run_on_ranks(2, _losses_compiled, dict(steps=4), timeout=180)[0][2]
    eager = run_on_ranks(2, _losses, dict(steps=4), timeout=90)[0][2]
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), atol=1e-5, rtol=0)
    assert eager[-1] != eager[0]


def _exported_logits_match(checkpoint_dir: str, export: str) -> float:
    from examples import train_dlrm
    from examples.dlrm import concat_batches

    config = train_dlrm.TrainConfig(**SMALL, steps=3, checkpoint_dir=checkpoint_dir, export=export)
    train_dlrm.train(config)
    # A fresh sharded model from the checkpoint: what the run ended with.
    world = dist.get_world_size()
    model = train_dlrm.build_model("meta")
    plan, _ = train_dlrm.make_plan(model, world_size=world, batch_size=64, device_memory="80GiB")
    model, opt = train_dlrm.shard_model(model, plan, config, torch.device("cpu"))
    _, path = train_dlrm.latest_checkpoint(checkpoint_dir)
    modular.checkpoint.load(path, model, opt)
    data = train_dlrm.Data(config, dist.get_rank(), world)
    batch = data.batch_at(1234)
    with torch.no_grad():
        local = model(batch.dense, batch.sparse)
    logits = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(logits, local)
    batches = [train_dlrm.Data(config, r, world).batch_at(1234) for r in range(world)]
    if dist.get_rank() != 0:
        return 0.0
    reference = train_dlrm.build_model("cpu")
    reference.load_state_dict(torch.load(export, weights_only=True), strict=True)
    global_batch = concat_batches(batches)
    with torch.no_grad():
        expected = reference(global_batch.dense, global_batch.sparse)
    torch.testing.assert_close(torch.cat(logits), expected, atol=1e-5, rtol=1e-5)
    # Trained: the exported tables are not the seeded initial ones.
    fresh = train_dlrm.build_model("cpu")
    return (fresh(global_batch.dense, global_batch.sparse) - expected).abs().max().item()


def test_export_gives_the_sharded_models_logits_in_one_process(tmp_path: Path) -> None:
    export = str(tmp_path / "dlrm.pt")
    moved = run_on_ranks(2, _exported_logits_match, str(tmp_path / "ckpt"), export, timeout=90)
    assert moved[0] > 1e-3, "the exported model equals the untrained one: were the weights trained?"


def test_script_self_launches_two_ranks_on_the_criteo_sample(tmp_path: Path) -> None:
    command = [
        sys.executable, str(ROOT / "examples" / "train_dlrm.py"), "--world-size", "2",
        "--data", str(ROOT / "examples" / "data" / "criteo_sample.tsv"), "--batch-size", "32",
        "--steps", "4", "--checkpoint-dir", str(tmp_path), "--no-progress",
        "--collective-timeout", "60",  # a rank left alone in a collective fails, naming it
    ]  # fmt: skip
    stdout = run_script(command, tmp_path)
    final = [line for line in stdout.splitlines() if line.startswith("final: ")]
    assert len(final) == 1, stdout  # rank 0 alone prints
    assert "AUC" in final[0] and "examples/s" in final[0]
    assert (tmp_path / "step_00000004" / "checkpoint.json").is_file()


def _interrupt_rank_1_in_its_first_save(checkpoint_dir: str):
    from examples import train_dlrm

    # Ctrl-C in a terminal reaches a process whose SIGINT is handled. A rank forked here inherits
    # SIG_IGN when pytest was started in the background by a non-interactive shell (`cmd &`), and
    # train's handler then replaces SIG_IGN: what it restores at the end is checked below.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    save = train_dlrm.save_checkpoint

    def save_after_ctrl_c(directory, step, model, opt):  # rank 1, at its first periodic save
        if dist.get_rank() == 1 and step == 5:
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler, "train's own"
            os.kill(os.getpid(), signal.SIGINT)
        return save(directory, step, model, opt)

    # A signal at a known step, not after a wall-clock delay: the step it stops after, and so the
    # checkpoints left, are then the same on a loaded machine as on an idle one.
    train_dlrm.save_checkpoint = save_after_ctrl_c
    try:
        config = train_dlrm.TrainConfig(
            **SMALL, steps=100_000, checkpoint_dir=checkpoint_dir, checkpoint_every=5
        )
        result = train_dlrm.train(config)
    finally:
        train_dlrm.save_checkpoint = save
    restored = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    return result, restored


def test_ctrl_c_on_one_rank_stops_every_rank_after_the_same_step(tmp_path: Path) -> None:
    from tests.dist import spawn_ranks

    outcomes = spawn_ranks(2, _interrupt_rank_1_in_its_first_save, str(tmp_path), timeout=90)
    logs = "".join(f"\n--- rank {o.rank} (exit {o.exitcode}):\n{o.output[-2000:]}" for o in outcomes)
    for o in outcomes:
        assert o.error is None and not o.timed_out, f"rank {o.rank}: {o.error}{logs}"
    results = [o.result[0] for o in outcomes]
    assert all(o.result[1] for o in outcomes), "train did not restore the SIGINT handler" + logs
    assert all(r.interrupted for r in results), logs
    # Rank 1 got SIGINT during the save after step 5; the flag rides on step 6's loss all-reduce.
    assert [r.end_step for r in results] == [6, 6], logs
    # The save it interrupted completed; none at the interrupted step.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000005"], logs
    assert (tmp_path / "step_00000005" / "checkpoint.json").is_file()
