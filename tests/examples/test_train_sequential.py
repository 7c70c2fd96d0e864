"""examples/train_sequential.py: a model with an EmbeddingCollection and an EBC, fully sharded,
trained at world 2, checkpointed, resumed at world 3 under the planner's other plan."""

from __future__ import annotations

from pathlib import Path

import torch

import modular
from tests.dist import run_on_ranks


def _run(config_kwargs: dict):
    from examples import train_sequential

    result = train_sequential.train(train_sequential.TrainConfig(batch_size=8, **config_kwargs))
    return result.start_step, result.losses, result.plan.to_dict(), modular.checkpoint.export(result.model)


def test_trained_at_world_2_resumes_at_world_3(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    start, losses, plan2, saved = run_on_ranks(2, _run, dict(steps=12, checkpoint_dir=ckpt), timeout=120)[0]
    assert start == 0 and len(losses) == 12
    assert (tmp_path / "ckpt" / "step_00000012").is_dir()
    # Resumed with nothing left to train: the world-3 model holds exactly what world 2 saved.
    start, losses, plan3, loaded = run_on_ranks(3, _run, dict(steps=12, checkpoint_dir=ckpt, resume=True), timeout=120)[0]
    assert start == 12 and losses == []
    assert plan3["world_size"] == 3 and plan2["world_size"] == 2
    assert list(loaded) == list(saved)
    for key in saved:
        torch.testing.assert_close(loaded[key], saved[key], atol=0, rtol=0, msg=lambda m: f"{key}: {m}")
    # And it trains on: the loss goes down over the next steps.
    start, losses, _, _ = run_on_ranks(3, _run, dict(steps=30, checkpoint_dir=ckpt, resume=True), timeout=120)[0]
    assert start == 12 and len(losses) == 18
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses
