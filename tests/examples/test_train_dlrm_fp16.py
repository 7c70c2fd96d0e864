"""examples/train_dlrm.py with --fp16 (and --fp16-comms) on 2 gloo ranks: FP16 tables train."""

from __future__ import annotations

import torch

from tests.dist import run_on_ranks


def _fp16_run() -> tuple:
    from examples import train_dlrm

    config = train_dlrm.TrainConfig(batch_size=64, eval_batches=1, progress=False, steps=12, fp16=True, fp16_comms=True)
    seen: dict = {}
    shard_model = train_dlrm.shard_model

    def recording(model, plan, config, device):  # what the run really built
        model, opt = shard_model(model, plan, config, device)
        ebc = model.sparse.ebc
        seen["dtypes"] = {p.dtype for n, p in ebc.named_parameters()}
        seen["comm"] = ebc.comm_dtype
        return model, opt

    train_dlrm.shard_model = recording
    try:
        result = train_dlrm.train(config)
    finally:
        train_dlrm.shard_model = shard_model
    return result.losses, seen["dtypes"], seen["comm"]


def test_the_example_trains_fp16_tables_with_one_flag() -> None:
    losses, dtypes, comm = run_on_ranks(2, _fp16_run, timeout=120)[0]
    assert dtypes == {torch.float16} and comm == torch.float16
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] - 0.01, losses  # it learns
